"""Generation throughput of the reference server's samplers through HTTP, next to bare vLLM, on one GPU.

    python benchmarks/gen_throughput.py --out DIR [--samplers vllm,bare,transformers] [--budget-s 520]

Everything in ONE run, on one Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 q / 8 kv heads
of 128, MLP 3072, tied embeddings, vocab 151,936; random bf16 weights, saved with the project's
character tokenizer), so the ratios compare like with like:

1. for each sampler (``--sampler vllm``, ``--sampler transformers``): a server process
   (``python -m arctic_rl.server --device cuda``), a sampling job, then ``POST /generate`` (JSON,
   token prompts of 256 random ids, ``ignore_eos``, temperature 1, ``logprobs``) at batch 64 and 256
   with 128 and 512 new tokens: one warm-up call per shape, then ``--repeats`` timed calls (the same
   request; the median is reported). tok/s = generated tokens / wall time of the HTTP call (the whole
   request: body, engine, answer). For vLLM also: a
   training job in the same server and ``POST /weight-sync`` training -> sampler (the server's
   ``seconds`` and the wall time, three times);
2. bare ``vllm.LLM.generate`` in this process on the same prompts and parameters, the engine built
   as the server builds it (in-process, sleep mode, ``gpu_memory_utilization`` 0.4), and the cost of
   ``llm.sleep(level=1)`` + ``llm.wake_up()`` (what ``/sleep-inference`` + ``/wake-inference`` run).

Results: ``OUT/gen_results.json`` and a markdown table ``OUT/gen_table.md`` (each cell is one timed
call; the server's vLLM engine and the bare one are separate engine instances, built one after the other).

``--cpu-smoke`` checks the script without a GPU, in seconds: the server on ``--device cpu`` with the
``transformers`` sampler only, a tiny Qwen3, one shape (2 prompts of 8 tokens x 4 new tokens), one timed
call, the weight sync too; any error fails the run (exit status 1) instead of being recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
REPEATS = 3
DEVICE = "cuda"
VLLM_CONFIG = {"gpu_memory_utilization": 0.4, "max_model_len": 1024, "max_num_seqs": 256}


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


class Server:
    def __init__(self, sampler: str, workdir: Path) -> None:
        from arctic_rl.server.launcher import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"server-{sampler}.log"
        cmd = [sys.executable, "-m", "arctic_rl.server", "--device", DEVICE, "--sampler", sampler, "--port",
               str(self.port), "--checkpoint-root", str(workdir / f"ck-{sampler}"), "--generate-batch-size", "256"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
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

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def prompts_for(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 100) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def params_for(new: int) -> dict[str, Any]:
    return {"max_tokens": new, "temperature": 1.0, "ignore_eos": True, "logprobs": True, "seed": 1}


def bench_server(sampler: str, model: Path, workdir: Path, shapes, deadline: float, out: dict) -> None:
    server = Server(sampler, workdir)
    try:
        t0 = time.perf_counter()
        job = server.post("/initialize", {"model_name": str(model), "job_type": "sampling",
                                          **({"vllm_config": VLLM_CONFIG} if sampler == "vllm" else {})})["job_id"]
        out[f"{sampler}_init_s"] = time.perf_counter() - t0
        for batch, new in shapes:
            if time.monotonic() > deadline:
                out.setdefault("skipped", []).append(f"{sampler} b{batch} n{new}")
                continue
            body = {"prompts": prompts_for(batch), "sampling_params": params_for(new)}
            t0 = time.perf_counter()
            server.post("/generate", body, job_id=job)  # warm-up (compiles a new shape)
            warm = time.perf_counter() - t0
            times = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                res = server.post("/generate", body, job_id=job)["results"]
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times)
            tokens = sum(r["generation_len"] for r in res)
            out[f"{sampler}_b{batch}_n{new}"] = {"tok_s": tokens / dt, "s": dt, "tokens": tokens, "first_call_s": warm,
                                                 "times_s": times}
            print(json.dumps({sampler: [batch, new], **out[f"{sampler}_b{batch}_n{new}"]}), flush=True)
        if (sampler == "vllm" or DEVICE == "cpu") and time.monotonic() < deadline:
            train = server.post("/initialize", {"model_name": str(model), "job_type": "training",
                                                "ds_worker_config": {"attn_implementation": "sdpa"}})["job_id"]
            syncs = []
            for _ in range(3):
                t0 = time.perf_counter()
                r = server.post("/weight-sync", {"source_sub_job_id": train, "target_sub_job_ids": [job]},
                                job_id=train)
                syncs.append({"server_s": r["seconds"], "http_s": time.perf_counter() - t0})
            out["weight_sync"] = syncs
            print(json.dumps({"weight_sync": syncs}), flush=True)
    finally:
        server.stop()


def bench_bare_vllm(model: Path, shapes, deadline: float, out: dict) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_sleep_mode=True,
              logprobs_mode="processed_logprobs", **VLLM_CONFIG)
    out["bare_init_s"] = time.perf_counter() - t0
    for batch, new in shapes:
        if time.monotonic() > deadline:
            out.setdefault("skipped", []).append(f"bare b{batch} n{new}")
            continue
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts_for(batch)]
        sp = SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, logprobs=1, seed=1, detokenize=False)
        llm.generate(prompts, sp, use_tqdm=False)
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        dt = statistics.median(times)
        tokens = sum(len(o.outputs[0].token_ids) for o in res)
        out[f"bare_b{batch}_n{new}"] = {"tok_s": tokens / dt, "s": dt, "tokens": tokens, "times_s": times}
        print(json.dumps({"bare": [batch, new], **out[f"bare_b{batch}_n{new}"]}), flush=True)
    costs = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.sleep(level=1)
        t1 = time.perf_counter()
        llm.wake_up()
        costs.append({"sleep_s": t1 - t0, "wake_s": time.perf_counter() - t1})
    out["sleep_wake"] = costs
    print(json.dumps({"sleep_wake": costs}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    del llm


def table(out: dict, shapes) -> str:
    lines = ["| batch x new tokens | server vLLM tok/s | bare vLLM tok/s | ratio | server transformers tok/s |",
             "| --- | --- | --- | --- | --- |"]
    for batch, new in shapes:
        v, b, t = (out.get(f"{k}_b{batch}_n{new}", {}).get("tok_s") for k in ("vllm", "bare", "transformers"))
        ratio = f"{v / b:.2f}" if v and b else "-"
        lines.append(f"| {batch} x {new} | {v or 0:,.0f} | {b or 0:,.0f} | {ratio} | {t or 0:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("gen_bench_out"))
    p.add_argument("--samplers", default="vllm,bare,transformers", help="run in this order: vllm, bare, transformers")
    p.add_argument("--transformers-shapes", default="64x128,64x512,256x128")
    p.add_argument("--budget-s", type=float, default=520)
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per shape (the median is reported)")
    p.add_argument("--cpu-smoke", action="store_true", help="check the script on a CPU: tiny model, transformers only")
    args = p.parse_args()
    globals()["REPEATS"] = max(1, args.repeats)
    if args.cpu_smoke:
        globals().update(DEVICE="cpu", PROMPT_LEN=8, SHAPES=[(2, 4)], REPEATS=1)
        args.samplers, args.transformers_shapes = "transformers", "2x4"
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="genbench-"))
    if args.cpu_smoke:
        from arctic_rl.tiny_models import build_tiny_model

        model = build_tiny_model(work / "tiny_qwen3", "qwen3", seed=0)
    else:
        model = build_model(work / "qwen3_06b")
    out: dict[str, Any] = {"prompt_len": PROMPT_LEN, "vllm_config": VLLM_CONFIG}
    samplers = args.samplers.split(",")
    try:
        for sampler in [s for s in ("vllm", "bare", "transformers") if s in samplers]:
            shapes = SHAPES if sampler != "transformers" else [
                tuple(int(x) for x in s.split("x")) for s in args.transformers_shapes.split(",")]
            try:
                if sampler == "bare":
                    bench_bare_vllm(model, shapes, deadline, out)
                else:
                    bench_server(sampler, model, work, shapes, deadline, out)
            except Exception as exc:  # recorded, then the next engine (the smoke run raises it)
                out[f"{sampler}_error"] = repr(exc)[:3000]
                print(out[f"{sampler}_error"], flush=True)
                if args.cpu_smoke:
                    raise
    finally:
        (args.out / "gen_results.json").write_text(json.dumps(out, indent=2))
        (args.out / "gen_table.md").write_text(table(out, SHAPES) + "\n")
        for log in work.glob("server-*.log"):
            (args.out / log.name).write_text(log.read_text()[-200_000:])
        print(table(out, SHAPES), flush=True)
    if args.cpu_smoke and not ("transformers_b2_n4" in out and "weight_sync" in out):
        raise SystemExit(f"cpu smoke: no timing or no weight sync recorded: {sorted(out)}")


if __name__ == "__main__":
    main()
