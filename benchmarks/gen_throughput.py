"""Generation throughput of the reference server's samplers through HTTP, next to bare vLLM, on one GPU.

    python benchmarks/gen_throughput.py --out DIR [--samplers vllm,bare,transformers] [--repeats 5]

Everything in ONE run, on one Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 q / 8 kv heads
of 128, MLP 3072, tied embeddings, vocab 151,936; random bf16 weights, saved with the project's
character tokenizer), so the ratios compare like with like:

1. the server (``python -m arctic_rl.server --device cuda --sampler vllm``) with a sampling job, and
   bare ``vllm.LLM.generate`` in this process, the engine built as the server builds it (in-process,
   sleep mode, ``gpu_memory_utilization`` 0.4 each: both live on the GPU at once). For each shape
   (batch 64 and 256, 128 and 512 new tokens; token prompts of 256 random ids, ``ignore_eos``,
   temperature 1, one log-prob per token, seed 1): one warm-up call on each side, then ``--repeats``
   rounds of one server call and one bare call, **interleaved** (the order alternates every round), so
   that a drift of the machine during the run falls on both sides alike. The server's call is the whole
   ``POST /generate`` (JSON body in, JSON answer with per-token log-prob entries out, as v1 clients and
   this benchmark's earlier runs send it; ``--wire dssst1``: a DSSST1 frame each way, as the adapter's v2
   dialect sends it); the server's log gives each call's time inside the server (engine and answer
   assembly), the rest is HTTP and the body's encoding. tok/s = generated tokens / wall time
   (median of the rounds); the ratio is server / bare of the medians, and each round's own ratio is kept;
2. on the same server, a training job and ``POST /weight-sync`` training -> sampler (three times), and on
   the bare engine the cost of ``llm.sleep(level=1)`` + ``llm.wake_up()`` (what ``/sleep-inference`` +
   ``/wake-inference`` run);
3. ``--samplers ...,transformers``: the transformers sampler on a server of its own, alone on the GPU.

Results: ``OUT/gen_results.json`` and a markdown table ``OUT/gen_table.md``.

``--cpu-smoke`` checks the script without a GPU, in seconds: the server on ``--device cpu`` with the
``transformers`` sampler, interleaved with a bare ``model.generate`` of a tiny Qwen3 (the CPU stand-in
for bare vLLM), one shape (2 prompts of 8 tokens x 4 new tokens), two rounds, the weight sync too; any
error fails the run (exit status 1) instead of being recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
SHAPES = [(64, 128), (64, 512), (256, 128), (256, 512)]
PROMPT_LEN = 256
REPEATS = 5
DEVICE = "cuda"
VLLM_CONFIG = {"gpu_memory_utilization": 0.4, "max_model_len": 1024, "max_num_seqs": 256}
WIRE = "json"  # the server's /generate body and answer: json (v1) or dssst1 (v2, the adapter's)
ANSWER = "vendor"  # the answer's shape: vendor (per-token candidates, text) or compact (compact_results)
COMPACT = {"logprobs_format": "sampled", "detokenize": False}  # what the adapter asks of a server listing compact_results
#: the server's log line for one /generate (arctic_rl/server/jobs/service.py): the call's seconds inside the server
_SERVER_LINE = re.compile(r"generate job=\d+ prompts=(\d+) n=\d+ tokens=(\d+) ([0-9.]+)s")


def build_model(path: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from arctic_rl.tiny_models import build_char_tokenizer

    if (path / "config.json").exists():
        return path
    tok = build_char_tokenizer()
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True, rope_theta=1e6, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def prompts_for(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 100) for _ in range(PROMPT_LEN)] for _ in range(batch)]


class ServerSide:
    """A server process with one sampling job; ``run`` is one timed ``POST /generate``."""

    def __init__(self, sampler: str, model: Path, workdir: Path, out: dict) -> None:
        from arctic_rl.server.launcher import free_port

        self.name, self.model = sampler, model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"server-{sampler}.log"
        cmd = [sys.executable, "-m", "arctic_rl.server", "--device", DEVICE, "--sampler", sampler, "--port",
               str(self.port), "--checkpoint-root", str(workdir / f"ck-{sampler}"), "--generate-batch-size", "256"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=f, stderr=subprocess.STDOUT)
        self._wait_healthy(180)
        t0 = time.perf_counter()
        self.job = self.post("/initialize", {"model_name": str(model), "job_type": "sampling",
                                             **({"vllm_config": VLLM_CONFIG} if sampler == "vllm" else {})})["job_id"]
        out[f"{sampler}_init_s"] = time.perf_counter() - t0

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            except requests.RequestException:
                time.sleep(0.5)
        raise TimeoutError(self.log.read_text()[-3000:])

    def post(self, path: str, body: Any, timeout: float = 900, **params: Any) -> dict:
        r = requests.post(self.url + path, json=body, params=params, timeout=timeout)
        if not r.ok:
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:2000]}")
        return r.json()

    def run(self, batch: int, new: int) -> tuple[float, int]:
        params = {"max_tokens": new, "temperature": 1.0, "ignore_eos": True, "logprobs": True, "seed": 1}
        if ANSWER == "compact":
            params.update(COMPACT)
        body = {"prompts": prompts_for(batch), "sampling_params": params}
        t0 = time.perf_counter()
        if WIRE == "dssst1":  # what the adapter sends (the v2 dialect): a DSSST1 frame each way
            from arctic_rl import dssst1

            r = requests.post(self.url + "/generate", data=bytes(dssst1.dumps(body)), params={"job_id": self.job},
                              headers={"Content-Type": "application/octet-stream"}, timeout=900)
            if not r.ok:
                raise RuntimeError(f"/generate: {r.status_code} {r.text[:2000]}")
            results = dssst1.loads(r.content)["results"]
        else:
            results = self.post("/generate", body, job_id=self.job)["results"]
        return time.perf_counter() - t0, sum(r["generation_len"] for r in results)

    def server_seconds(self) -> list[float]:
        """Each /generate's seconds inside the server, in call order (from the server's log)."""
        return [float(m.group(3)) for m in _SERVER_LINE.finditer(self.log.read_text(errors="replace"))]

    def weight_sync(self, out: dict) -> None:
        train = self.post("/initialize", {"model_name": str(self.model), "job_type": "training",
                                          "ds_worker_config": {"attn_implementation": "sdpa"}})["job_id"]
        syncs = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = self.post("/weight-sync", {"source_sub_job_id": train, "target_sub_job_ids": [self.job]},
                          job_id=train)
            syncs.append({"server_s": r["seconds"], "http_s": time.perf_counter() - t0})
        out["weight_sync"] = syncs
        print(json.dumps({"weight_sync": syncs}), flush=True)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class BareVllm:
    """``vllm.LLM.generate`` in this process, the engine built with the server's options."""

    name = "bare"

    def __init__(self, model: Path, out: dict, llm: Any = None) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = llm or LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                              enable_sleep_mode=True, logprobs_mode="processed_logprobs", **VLLM_CONFIG)
        out["bare_init_s"] = time.perf_counter() - t0

    def run(self, batch: int, new: int) -> tuple[float, int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts_for(batch)]
        # the vendor answer's one candidate a token, or (compact) only the sampled token's log-prob, as the server asks
        sp = SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, logprobs=0 if ANSWER == "compact" else 1,
                            seed=1, detokenize=False)
        t0 = time.perf_counter()
        res = self.llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in res)

    def sleep_wake(self, out: dict) -> None:
        costs = []
        for _ in range(3):
            t0 = time.perf_counter()
            self.llm.sleep(level=1)
            t1 = time.perf_counter()
            self.llm.wake_up()
            costs.append({"sleep_s": t1 - t0, "wake_s": time.perf_counter() - t1})
        out["sleep_wake"] = costs
        print(json.dumps({"sleep_wake": costs}), flush=True)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


class InProcessSampler:
    """``--decompose``: the server's vLLM sampling engine in this process, called as the server calls it
    (its seeds, parameters and answer assembly; no HTTP, no server process). Its ``llm`` serves as the
    bare side too, so the two differ only by what the engine's ``generate`` adds around ``llm.generate``."""

    name = "inproc"

    def __init__(self, model: Path, workdir: Path, out: dict) -> None:
        from arctic_rl.protocol import JobConfig, JobType
        from arctic_rl.server.engines import create_engine
        from arctic_rl.server.settings import ServerSettings

        settings = ServerSettings(device="cuda", sampler="vllm", checkpoint_root=workdir / "ck-inproc")
        t0 = time.perf_counter()
        self.engine = create_engine(JobConfig(model_name=str(model), job_type=JobType.SAMPLING,
                                              vllm_config=VLLM_CONFIG), settings, None)
        out["inproc_init_s"] = time.perf_counter() - t0

    def run(self, batch: int, new: int) -> tuple[float, int]:
        from arctic_rl.protocol import GenerateRequest, SamplingParams

        request = GenerateRequest(prompts=prompts_for(batch))
        params = SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, logprobs=True, seed=1,
                                **(COMPACT if ANSWER == "compact" else {}))
        t0 = time.perf_counter()
        results = self.engine.generate(request, params)
        return time.perf_counter() - t0, sum(r["generation_len"] for r in results)

    def close(self) -> None:
        self.engine.close()


class BareTransformers:
    """The CPU smoke run's stand-in for bare vLLM: ``model.generate`` of the same prompts."""

    name = "bare"

    def __init__(self, model: Path, out: dict) -> None:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(model))
        out["bare_init_s"] = time.perf_counter() - t0

    def run(self, batch: int, new: int) -> tuple[float, int]:
        import torch

        ids = torch.tensor(prompts_for(batch))
        t0 = time.perf_counter()
        gen = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=True, temperature=1.0, pad_token_id=0)
        return time.perf_counter() - t0, int(gen[:, ids.shape[1]:].numel())

    def sleep_wake(self, out: dict) -> None:
        pass

    def close(self) -> None:
        pass


def measure(sides: list, shapes, repeats: int, deadline: float, out: dict) -> None:
    """Per shape: one warm-up call per side, then ``repeats`` rounds of one call per side, the order
    alternating every round; each side's median and, with two sides, every round's ratio."""
    for batch, new in shapes:
        key = f"b{batch}_n{new}"
        if time.monotonic() > deadline:
            out.setdefault("skipped", []).append(key)
            continue
        first = {side.name: side.run(batch, new)[0] for side in sides}  # compiles a new shape
        times: dict[str, list[float]] = {side.name: [] for side in sides}
        tokens: dict[str, int] = {}
        for r in range(repeats):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                dt, tokens[side.name] = side.run(batch, new)
                times[side.name].append(dt)
        for side in sides:
            dt = statistics.median(times[side.name])
            out[f"{side.name}_{key}"] = {"tok_s": tokens[side.name] / dt, "s": dt, "tokens": tokens[side.name],
                                         "first_call_s": first[side.name], "times_s": times[side.name]}
            print(json.dumps({side.name: [batch, new], **out[f"{side.name}_{key}"]}), flush=True)
        if len(sides) >= 2:  # server / bare in tok/s = bare seconds / server seconds, round by round
            server, bare = times[sides[0].name], times[sides[-1].name]
            out[f"rounds_{key}"] = [b / s for s, b in zip(server, bare)]


def attribute_server_seconds(server: ServerSide, shapes, repeats: int, out: dict) -> None:
    """Each shape's calls' seconds inside the server (the log lists warm-up and timed calls in order)."""
    seconds = server.server_seconds()
    i = 0
    for batch, new in shapes:
        key = f"{server.name}_b{batch}_n{new}"
        if key not in out:
            continue
        calls = seconds[i: i + 1 + repeats]
        i += 1 + repeats
        if len(calls) == 1 + repeats:
            out[key]["server_s"] = calls[1:]
            out[key]["http_json_s"] = statistics.median(t - s for t, s in zip(out[key]["times_s"], calls[1:]))


def table(out: dict, shapes) -> str:
    lines = [("| batch x new tokens | server vLLM tok/s | bare vLLM tok/s | ratio (medians) | ratio per round, min-max "
              "| server: inside / HTTP+encoding s | server transformers tok/s |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for batch, new in shapes:
        key = f"b{batch}_n{new}"
        v, b, t, ip = (out.get(f"{k}_{key}", {}) for k in ("vllm", "bare", "transformers", "inproc"))
        if not v and t and DEVICE == "cpu":
            v = t  # the smoke run's server is the transformers one
        ratio = f"{v['tok_s'] / b['tok_s']:.2f}" if v and b else "-"
        rounds = out.get(f"rounds_{key}")
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"
        inside = (f"{statistics.median(v['server_s']):.3f} / {v['http_json_s']:.3f}" if v.get("server_s") else "-")
        lines.append(f"| {batch} x {new} | {v.get('tok_s', 0):,.0f} | {b.get('tok_s', 0):,.0f} | {ratio} | {spread} "
                     f"| {inside} | {t.get('tok_s', 0):,.0f} |"
                     + (f" in-process engine.generate {ip['tok_s']:,.0f} tok/s ({ip['s']:.3f} s)" if ip else ""))
    return "\n".join(lines)


def run_all(args, model: Path, work: Path, out: dict) -> None:
    deadline = time.monotonic() + args.budget_s
    samplers = args.samplers.split(",")
    server_name = "transformers" if args.cpu_smoke else "vllm"
    sides: list = []
    try:
        if server_name in samplers:
            sides.append(ServerSide(server_name, model, work, out))
        if args.decompose and not args.cpu_smoke:
            inproc = InProcessSampler(model, work, out)
            sides += [inproc, BareVllm(model, out, llm=inproc.engine.llm)]
        elif "bare" in samplers:
            sides.append((BareTransformers if args.cpu_smoke else BareVllm)(model, out))
        measure(sides, SHAPES, REPEATS, deadline, out)
        if sides and isinstance(sides[0], ServerSide):
            attribute_server_seconds(sides[0], SHAPES, REPEATS, out)
            if time.monotonic() < deadline:
                sides[0].weight_sync(out)
        if sides and not isinstance(sides[-1], ServerSide) and not args.decompose and time.monotonic() < deadline:
            sides[-1].sleep_wake(out)
    finally:
        for side in sides:
            if not (args.decompose and isinstance(side, BareVllm)):  # the in-process engine's, closed with it
                side.close()
    if "transformers" in samplers and not args.cpu_smoke:  # alone on the GPU, after the pair
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.transformers_shapes.split(",")]
        server = ServerSide("transformers", model, work, out)
        try:
            measure([server], shapes, REPEATS, deadline, out)
        finally:
            server.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("gen_bench_out"))
    p.add_argument("--samplers", default="vllm,bare,transformers",
                   help="vllm and bare run interleaved; transformers alone afterwards")
    p.add_argument("--transformers-shapes", default="64x128,64x512,256x128")
    p.add_argument("--budget-s", type=float, default=520, help="shapes not started by then are skipped")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds per shape (medians are reported)")
    p.add_argument("--wire", choices=("json", "dssst1"), default="json",
                   help="the server's body and answer: JSON (v1 clients; §2b, §2h) or DSSST1 (v2, what the adapter sends)")
    p.add_argument("--answer", choices=("vendor", "compact"), default="vendor",
                   help="the server's answer: the vendor's per-token candidates and text (§2b, §2h) or the compact "
                        "one the adapter asks for (compact_results: one log-prob float per token, no text)")
    p.add_argument("--decompose", action="store_true",
                   help="a third side: the server's sampling engine in this process; bare runs on its engine")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script on a CPU: tiny model, transformers server vs bare model.generate")
    args = p.parse_args()
    globals().update(REPEATS=max(1, args.repeats), WIRE=args.wire, ANSWER=args.answer)
    if args.cpu_smoke:
        globals().update(DEVICE="cpu", PROMPT_LEN=8, SHAPES=[(2, 4)], REPEATS=2)
        args.samplers = "transformers,bare"
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="genbench-"))
    if args.cpu_smoke:
        from arctic_rl.tiny_models import build_tiny_model

        model = build_tiny_model(work / "tiny_qwen3", "qwen3", seed=0)
    else:
        model = build_model(work / "qwen3_06b")
    out: dict[str, Any] = {"prompt_len": PROMPT_LEN, "vllm_config": VLLM_CONFIG, "repeats": REPEATS, "wire": WIRE,
                           "answer": ANSWER}
    try:
        run_all(args, model, work, out)
    except Exception as exc:  # recorded with what was measured (the smoke run raises it)
        out["error"] = repr(exc)[:3000]
        print(out["error"], flush=True)
        if args.cpu_smoke:
            raise
    finally:
        (args.out / "gen_results.json").write_text(json.dumps(out, indent=2))
        (args.out / "gen_table.md").write_text(table(out, SHAPES) + "\n")
        for log in work.glob("server-*.log"):
            (args.out / log.name).write_text(log.read_text(errors="replace")[-200_000:])
        print(table(out, SHAPES), flush=True)
    if args.cpu_smoke and not ("transformers_b2_n4" in out and "bare_b2_n4" in out and "weight_sync" in out):
        raise SystemExit(f"cpu smoke: a side, its timing or the weight sync is missing: {sorted(out)}")


if __name__ == "__main__":
    main()
