"""Where a GRPO step's time goes between verl and the reference server: compute vs. everything else.

    python benchmarks/step_overhead.py            # 64 rows x (512 prompt + 512 response), ~10 min on 1 core
    python benchmarks/step_overhead.py --quick    # 16 rows x (128 + 128), a smaller model: ~1-2 min
    python benchmarks/step_overhead.py --smoke    # a CPU check of the script (tiny sizes, seconds; run by the tests)

One real ``python -m arctic_rl.server`` subprocess (CPU, one torch thread; started like the tests
start it, ``tests/support/server.py``) serves a locally built Qwen3 (``--hidden``/``--layers``;
the default is small but not trivial on one CPU core). The adapter, ``ArcticRLClient``, runs here
exactly as verl's forwarder worker runs it. Part A drives full GRPO training steps through the
adapter -- ``compute_log_prob`` (old policy), ``compute_ref_log_prob``, ``update_actor`` (one
mini-batch: one ``/forward-backward``, split by the server into ``rows / micro`` micro-batches, and
one ``/step``) and ``update_weights``
-- on a verl-shaped batch (verl's own ``left_right_2_no_padding``: nested ``input_ids``, padded
RL tensors; GRPO groups of ``n`` rows). Every step's wall time is split into:

* ``server compute``: the engines' own ``metrics.seconds`` (``/forward``, ``/forward-backward``,
  ``/weight-sync``); for ``/step``, which reports none, its round trip minus the median round trip
  of a trivial JSON call (``GET /health``) measured in the same run;
* client: ``layout`` (``plan_layout``, ``dense_batch``, ``nested_from_server``), ``encode``
  (DSSST1 ``dumps``), ``decode`` (DSSST1 ``loads``) and ``other`` (the rest of the adapter: row
  slicing, metrics);
* server, outside compute -- replayed here on the very bytes that crossed the wire, since the
  server does not time them: DSSST1 decode + ``parse_batch_body`` validation, the idempotency
  hash of the body, DSSST1 encode of the answer;
* ``http``: the round trips minus all of the above (sockets, ``requests``, uvicorn, FastAPI).

The functions are timed by wrapping them where the adapter looks them up (module attributes and
the session's ``request``); nothing is replaced, every call still reaches the real server.

Part A also measures verl's Ray hop: a Ray actor round trip carrying the step's TensorDicts (the
batch in, the adapter's real answers out) for the four worker calls -- reported separately, since
the adapter does not run it. Part B drives the rollout replica's server
(``ArcticRLRolloutServer``, in-process, no Ray) the way verl's agent loop does: 64 concurrent
``generate(request_id, prompt_ids, sampling_params)`` calls, versus 64 sequential ones, reporting
requests/s and the batch sizes the coalescer actually sent to ``/generate``.

Machine noise: this box is shared, so the tables give medians and ratios from one run, and the
load average at start and end. Target: non-compute time <= 5% of the step at 64 x 1024 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' helpers (tests.support) from a checkout

import torch

torch.set_num_threads(1)

from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from arctic_rl import dssst1
from arctic_rl.protocol import Paths
from arctic_rl.tiny_models import build_tiny_model
from tests.support.arctic import legacy_batch, verl_main_config
from tests.support.server import running_server

#: the Arctic adapter's package: its modules import the wire and layout functions by name
CLIENT_PACKAGE = "verl.workers.remote_client.arctic"
#: (defining module, function, bucket) timed inside the adapter
TIMED_FUNCTIONS = (
    ("verl.workers.remote_client.arctic.layout", "plan_layout", "layout"),
    ("verl.workers.remote_client.arctic.layout", "dense_batch", "layout"),
    ("verl.workers.remote_client.arctic.layout", "nested_from_server", "layout"),
)
#: (module, method, bucket): the wire codecs, methods of each protocol generation's dialect class there
TIMED_METHODS = (
    ("verl.workers.remote_client.arctic.dialect", "encode_tensors", "encode"),
    ("verl.workers.remote_client.arctic.dialect", "decode_tensors", "decode"),
)


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------- probes

class Probe:
    """Times the adapter's wire and layout functions and records every HTTP exchange of the current phase.

    The functions are wrapped wherever the adapter's modules hold them (they import them by name), the
    codecs on each dialect class that defines them, and
    every call of :meth:`ArcticHttp.request` -- the adapter's one HTTP path -- is recorded; :meth:`close`
    puts everything back.
    """

    def __init__(self) -> None:
        import importlib

        from verl.workers.remote_client.arctic.http import ArcticHttp

        self.t: dict[str, float] = defaultdict(float)
        self.exchanges: list[dict[str, Any]] = []
        self._patched: list[tuple[Any, str, Any]] = []
        for module_name, name, bucket in TIMED_FUNCTIONS:
            original = getattr(importlib.import_module(module_name), name)
            timed = self._timed(original, bucket)
            for module in [m for k, m in sorted(sys.modules.items()) if k.startswith(CLIENT_PACKAGE) and m is not None]:
                if getattr(module, name, None) is original:
                    self._patch(module, name, timed)
        for module_name, name, bucket in TIMED_METHODS:
            module = importlib.import_module(module_name)
            classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module_name]
            owners = [cls for cls in classes if name in vars(cls)]
            if not owners:
                raise RuntimeError(f"no class of {module_name} defines {name}: update TIMED_METHODS")
            for cls in owners:
                self._patch(cls, name, self._timed(vars(cls)[name], bucket))
        original_request = ArcticHttp.request
        probe = self

        def request(http, method, path, **kw):
            t0 = time.perf_counter()
            resp = original_request(http, method, path, **kw)
            _ = resp.content  # the body is read inside the round trip
            dt = time.perf_counter() - t0
            probe.t["http_round_trip"] += dt
            body = kw.get("data")
            sent = len(body) if body is not None else len(str(kw.get("json") or ""))
            probe.exchanges.append({"method": method.upper(), "path": path, "s": dt, "sent": sent,
                                    "received": len(resp.content), "body": bytes(body) if body is not None else None,
                                    "resp": resp, "params": dict(kw.get("params") or {})})
            return resp

        self._patch(ArcticHttp, "request", request)

    def _timed(self, fn: Any, bucket: str) -> Any:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[bucket] += time.perf_counter() - t0

        return timed

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def reset(self) -> None:
        self.t.clear()
        self.exchanges.clear()

    def close(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


def server_side_replay(exchanges: list[dict[str, Any]], vocab: int, rtt_json: float) -> dict[str, float]:
    """Server work outside compute, replayed on the same bytes, plus the compute the server reported."""
    from arctic_rl.server.http.idempotency import payload_hash
    from arctic_rl.server.http.validation import parse_batch_body

    out: dict[str, float] = defaultdict(float)
    for ex in exchanges:
        path, resp = ex["path"], ex["resp"]
        is_frame = resp.headers.get("Content-Type", "").startswith("application/octet-stream")
        answer = dssst1.loads(resp.content) if is_frame else resp.json()
        if ex["body"] is not None and path in (Paths.FORWARD, Paths.FORWARD_BACKWARD):
            t0 = time.perf_counter()
            parse_batch_body(dssst1.loads(ex["body"]), vocab_size=vocab, train=path == Paths.FORWARD_BACKWARD)
            out["server_decode_validate"] += time.perf_counter() - t0
        if ex["method"] == "POST" and path != Paths.FORWARD:  # idempotent routes hash the body
            t0 = time.perf_counter()
            payload_hash("POST", path, sorted(ex["params"].items()), ex["body"] or b"")
            out["server_hash"] += time.perf_counter() - t0
        if is_frame:
            t0 = time.perf_counter()
            dssst1.dumps(answer)
            out["server_encode"] += time.perf_counter() - t0
        seconds = (answer.get("metrics") or {}).get("seconds") if isinstance(answer, dict) else None
        if seconds is None and isinstance(answer, dict):
            seconds = answer.get("seconds")
        if path == Paths.STEP:
            seconds = max(0.0, ex["s"] - rtt_json)
            out["step_compute_estimated"] += seconds
        out["server_compute"] += float(seconds or 0.0)
    return out


# ---------------------------------------------------------------------------------------- part A

def grpo_batch(rows: int, n: int, p0: int, r0: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    uniq = [torch.randint(3, 99, (int(torch.randint(p0 - p0 // 8, p0 + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(rows // n)]
    prompts = [uniq[i % len(uniq)] for i in range(rows)]  # groups interleaved, as verl's balancing leaves them
    responses = [torch.randint(3, 99, (int(torch.randint(r0 - r0 // 4, r0 + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(rows)]
    return legacy_batch(prompts, responses, p0=p0, r0=r0)


def grpo_step(client: Any, data: Any, mini_rows: int) -> dict[str, Any]:
    """What verl's trainer asks of the actor worker in one GRPO step (advantages made up here)."""
    tu.assign_non_tensor(data, calculate_entropy=True)
    outs = {"compute_log_prob": client.compute_log_prob(data)}
    data["old_log_probs"] = no_padding_2_padding(outs["compute_log_prob"]["log_probs"], data).float()
    outs["compute_ref_log_prob"] = client.compute_ref_log_prob(data)
    data["ref_log_prob"] = no_padding_2_padding(outs["compute_ref_log_prob"]["log_probs"], data).float()
    tu.assign_non_tensor(data, global_batch_size=mini_rows, mini_batch_size=mini_rows, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, temperature=1.0)
    outs["update_actor"] = client.update_actor(data)
    client.update_weights()
    return outs


def ray_hop(data: Any, outs: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of a Ray actor round trip per worker call, carrying the real TensorDicts."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        @ray.remote(num_cpus=0)
        class Forwarder:
            def __init__(self, answers):
                self.answers = answers

            def call(self, name, td):
                return self.answers.get(name)  # update_weights answers nothing

        actor = Forwarder.remote(outs)
        ray.get(actor.call.remote("compute_log_prob", data))  # warm: actor up, serializers loaded
        res = {}
        for name in list(outs) + ["update_weights"]:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ray.get(actor.call.remote(name, data if name != "update_weights" else None))
                times.append(time.perf_counter() - t0)
            res[name] = statistics.median(times)
        return res
    finally:
        ray.shutdown()


def part_a(args, client, vocab: int) -> dict[str, Any]:
    rows, n = args.rows, args.n
    # baseline round trip of a trivial JSON call (for /step, whose compute the server does not report)
    from verl.workers.remote_client.arctic.arctic_config import RetryConfig, TimeoutsConfig
    from verl.workers.remote_client.arctic.http import ArcticHttp

    http = ArcticHttp(client.url, timeouts=TimeoutsConfig(), retry=RetryConfig())
    rtts = []
    try:
        for _ in range(20):
            t0 = time.perf_counter()
            http.get_json(Paths.HEALTH)
            rtts.append(time.perf_counter() - t0)
    finally:
        http.close()
    rtt_json = statistics.median(rtts)
    probe = Probe()
    steps = []
    try:
        for i in range(args.warmup + args.steps):
            data = grpo_batch(rows, n, args.prompt, args.response, seed=i)
            probe.reset()
            t0 = time.perf_counter()
            outs = grpo_step(client, data, rows)
            wall = time.perf_counter() - t0
            if i < args.warmup:
                print(f"# warm-up step {i}: {wall:.1f}s", flush=True)
                continue
            silent = [b for b in ("layout", "encode", "decode", "http_round_trip") if not probe.t.get(b)]
            if silent:  # the adapter no longer calls what the probe wraps: the split would be wrong
                raise RuntimeError(f"the probe timed nothing for {silent}: update TIMED_FUNCTIONS / TIMED_METHODS")
            record = {"wall": wall, **probe.t, **server_side_replay(probe.exchanges, vocab, rtt_json),
                      "bytes_sent": sum(e["sent"] for e in probe.exchanges),
                      "bytes_received": sum(e["received"] for e in probe.exchanges),
                      "calls": len(probe.exchanges), "tokens": int(data["input_ids"].offsets()[-1])}
            steps.append(record)
            print(f"# step {i - args.warmup}: {wall:.1f}s, server compute {record['server_compute']:.1f}s, "
                  f"load {loadavg()}", flush=True)
    finally:
        probe.close()
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    med["rtt_json"] = rtt_json
    if args.ray:
        med["ray"] = ray_hop(data, outs, repeats=5)
    return med


def print_part_a(med: dict[str, Any], args) -> list[str]:
    wall = med["wall"]
    srv = med["server_compute"]
    client_other = wall - med["http_round_trip"] - med.get("encode", 0) - med.get("decode", 0) - med.get("layout", 0)
    http_net = (med["http_round_trip"] - srv - med.get("server_decode_validate", 0) - med.get("server_hash", 0)
                - med.get("server_encode", 0))
    rows = [("server compute (engines' own seconds; /step: RTT - JSON RTT)", srv),
            ("client: layout (plan_layout, dense_batch, nested_from_server)", med.get("layout", 0.0)),
            ("client: DSSST1 encode", med.get("encode", 0.0)),
            ("client: DSSST1 decode", med.get("decode", 0.0)),
            ("client: other adapter work", client_other),
            ("server: DSSST1 decode + validation (replayed)", med.get("server_decode_validate", 0.0)),
            ("server: idempotency hash (replayed)", med.get("server_hash", 0.0)),
            ("server: DSSST1 encode of answers (replayed)", med.get("server_encode", 0.0)),
            ("HTTP: sockets, requests, uvicorn, FastAPI (residual)", http_net)]
    lines = [(f"Part A: GRPO step through ArcticRLClient, {args.rows} rows x ({args.prompt} + {args.response}) max, "
             f"n={args.n}, micro={args.micro}; {int(med['tokens'])} real tokens; {int(med['calls'])} HTTP calls; "
             f"median of {args.steps} step(s)"),
             f"{'component':66} {'ms/step':>10} {'% of step':>9}"]
    lines += [f"{name:66} {s * 1e3:>10.1f} {s / wall:>9.2%}" for name, s in rows]
    lines.append(f"{'step wall (adapter calls)':66} {wall * 1e3:>10.1f} {1:>9.0%}")
    over = wall - srv
    lines.append(f"{'NOT server compute (target <= 5%)':66} {over * 1e3:>10.1f} {over / wall:>9.2%}  "
                 f"{'PASS' if over / wall <= 0.05 else 'FAIL'}")
    lines.append(f"bytes on the wire per step: sent {med['bytes_sent'] / 1e6:.2f} MB, received "
                 f"{med['bytes_received'] / 1e6:.2f} MB (bodies; headers not counted); JSON RTT {med['rtt_json'] * 1e3:.2f} ms")
    if "ray" in med:
        ray_total = sum(med["ray"].values())
        lines.append("Ray actor hop (verl driver -> forwarder worker), TensorDicts of this step: "
                     + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med["ray"].items())
                     + f"; total {ray_total * 1e3:.1f} ms = {ray_total / (wall + ray_total):.2%} of step + hop")
        over_all = over + ray_total
        lines.append(f"{'NOT server compute incl. Ray hop (target <= 5%)':66} {over_all * 1e3:>10.1f} "
                     f"{over_all / (wall + ray_total):>9.2%}  {'PASS' if over_all / (wall + ray_total) <= 0.05 else 'FAIL'}")
    lines.append(f"break-even: the overhead stays <= 5% while server compute per step >= "
                 f"{19 * (over + sum(med.get('ray', {}).values())):.1f} s")
    return lines


# ---------------------------------------------------------------------------------------- part B

async def drive_rollout(server: Any, prompts: list[list[int]], params: dict[str, Any], concurrent: bool) -> float:
    t0 = time.perf_counter()
    if concurrent:
        outs = await asyncio.gather(*[server.generate(f"req{i}", p, dict(params)) for i, p in enumerate(prompts)])
    else:
        outs = [await server.generate(f"req{i}", p, dict(params)) for i, p in enumerate(prompts)]
    dt = time.perf_counter() - t0
    bad = [o for o in outs if o.stop_reason != "completed"]
    if bad:
        raise RuntimeError(f"{len(bad)} generate calls did not complete: {bad[0]}")
    return dt


def part_b(args, client, cfg) -> list[str]:
    from omegaconf import OmegaConf

    from verl.remote_backend.context import install_context
    from verl.workers.remote_client.arctic.replica import ArcticRLRolloutServer

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    ctx = install_context(cfg, name="arctic", handle=client.reconnect_handle())
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 99, (int(torch.randint(24, 65, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.gen_samples)]
    # verl's agent loop sends exactly these keys (plus max_tokens, fixed here to bound the run)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
              "max_tokens": args.gen_tokens, "ignore_eos": True}
    lines = [(f"Part B: rollout replica server, {args.gen_samples} samples x {args.gen_tokens} tokens "
             f"(prompts 24-64 tokens), max_batch_size={cfg.remote_backend.rollout.max_batch_size}, "
             f"max_wait_ms={cfg.remote_backend.rollout.max_wait_ms} (a server that batches continuously gets the "
             f"calls as they come)"),
             f"{'mode':34} {'wall_s':>8} {'req/s':>8} {'tok/s':>8} {'/generate calls':>15}  samples per call"]
    res = {}
    for mode in ("sequential", "concurrent", "sequential", "concurrent") if not args.quick else ("sequential",
                                                                                                 "concurrent"):
        server = ArcticRLRolloutServer(ctx.to_dict())
        dt = asyncio.run(drive_rollout(server, prompts, params, concurrent=mode == "concurrent"))
        sent = server.stats()  # /generate calls the server's dispatch sent, and the samples they asked for
        res.setdefault(mode, []).append(dt)
        lines.append(f"{mode:34} {dt:>8.2f} {len(prompts) / dt:>8.1f} {len(prompts) * args.gen_tokens / dt:>8.0f} "
                     f"{sent['batches']:>15}  {sent['samples'] / max(sent['batches'], 1):.1f}")
    seq, con = statistics.median(res["sequential"]), statistics.median(res["concurrent"])
    lines.append(f"concurrent vs sequential: {seq / con:.1f}x the requests/s (medians)")
    return lines


# ---------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 rows x (128+128), hidden 128, 2 layers, 1 step")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the script in seconds: 4 rows x (16+8), hidden 64, 1 layer, 1 step, no Ray")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="GRPO group size (rollout.n)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch (the server splits each /forward-backward into rows / micro)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gen-samples", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="sampling job's vllm_config.max_num_seqs")
    ap.add_argument("--no-ray", dest="ray", action="store_false")
    ap.add_argument("--skip", default="", help="a,b: parts to skip")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.prompt, args.response, args.micro = 16, 128, 128, 8
        args.hidden, args.layers, args.steps, args.gen_samples = 128, 2, 1, 64
    if args.smoke:
        args.rows, args.n, args.prompt, args.response, args.micro = 4, 2, 16, 8, 2
        args.hidden, args.layers, args.steps, args.warmup = 64, 1, 1, 0
        args.gen_samples, args.gen_tokens, args.ray, args.quick = 4, 4, False, True
    import verl.remote_backend.builtin  # noqa: F401 - registers "arctic"
    from verl.remote_backend import RemoteBackendRegistry

    print(f"# load average at start: {loadavg()}  ({os.cpu_count()} cores)", flush=True)
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as tmp:
        model = build_tiny_model(Path(tmp) / "model", "qwen3", hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=max(4, args.hidden // 64), num_kv_heads=max(2, args.hidden // 128),
                               max_position_embeddings=max(2 * (args.prompt + args.response), 128))
        with running_server(Path(tmp) / "srv") as srv:
            rollout = {"max_batch_size": 64, "max_wait_ms": 5}
            if args.max_num_seqs:
                rollout["vllm_config"] = {"max_num_seqs": args.max_num_seqs}
            cfg = verl_main_config({
                "data": {"train_batch_size": args.rows // args.n, "max_prompt_length": args.prompt,
                         "max_response_length": args.response},
                "actor_rollout_ref": {
                    "rollout": {"n": args.n, "temperature": 1.0},
                    "actor": {"ppo_mini_batch_size": args.rows // args.n, "ppo_micro_batch_size_per_gpu": args.micro,
                              "ppo_epochs": 1, "use_kl_loss": True, "kl_loss_coef": 0.01, "shuffle": False}},
                "remote_backend": {"server": {"url": srv.url}, "train": {"deepspeed": {"bf16": False}},
                                   "rollout": rollout}}, model_path=str(model))
            client = RemoteBackendRegistry.create("arctic", cfg)
            try:
                from transformers import AutoConfig

                vocab = AutoConfig.from_pretrained(model).vocab_size
                params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
                    model).parameters())
                print(f"# model: qwen3 hidden {args.hidden}, {args.layers} layers, {params / 1e6:.2f}M params, "
                      f"vocab {vocab}", flush=True)
                lines: list[str] = []
                if "a" not in args.skip:
                    lines += print_part_a(part_a(args, client, vocab), args)
                if "b" not in args.skip:
                    lines += [""] + part_b(args, client, cfg)
            finally:
                client.destroy()
    print(f"# load average at end: {loadavg()}", flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
