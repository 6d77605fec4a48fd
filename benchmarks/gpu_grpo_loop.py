"""A GRPO loop driven through the adapter against the reference server, phase by phase, next to bare components.

    # on a GPU (vLLM in the server; Qwen3-0.6B shape with random bf16 weights, built locally):
    python benchmarks/gpu_grpo_loop.py --out DIR --zorro off            # writes DIR/loop_zorro_off.json
    python benchmarks/gpu_grpo_loop.py --out DIR --zorro on --bare      # + DIR/bare.json
    python benchmarks/gpu_grpo_loop.py --report A/loop_zorro_off.json B/loop_zorro_on.json B/bare.json
    # on a CPU, to check the script (tiny model, transformers sampler, small sizes):
    python benchmarks/gpu_grpo_loop.py --out DIR --cpu-smoke --zorro off,on --bare

What one run does:

1. ``ArcticRLClient.from_config`` -- the real adapter, configured like a verl GRPO recipe
   (``remote_backend=arctic``, ``server.url: null``) -- starts ``python -m arctic_rl.server`` itself
   (``server.local.device``/``sampler``: ``cuda``/``vllm`` here) and creates the sampling, log_prob
   and training jobs (ZoRRO off or on in the training job);
2. ``--warmup`` + ``--steps`` GRPO steps, each ``--prompts`` new prompts of ``--prompt-len`` random
   token ids, ``n`` samples each, every response exactly ``--response-len`` tokens (``ignore_eos``, so
   every step and the bare run do the same work), and per step the wall time of each phase:
   ``generate`` (``client.generate``: one ``/generate`` with ``n``), ``old_log_prob``
   (``client.compute_log_prob``: ``/forward`` on the training job), ``update``
   (``client.update_actor``: one ``/forward-backward`` of the whole mini-batch, split by the server
   into ``rows / --micro`` micro-batches, and one ``/step``), ``weight_sync``
   (``client.update_weights``: ``/weight-sync`` training -> sampler, GPU to GPU), plus ``batch``
   (building verl's TensorDict from the samples here, verl's own ``left_right_2_no_padding``);
3. with ``--bare``, after the server is gone, :mod:`grpo_bare` in this process: bare
   ``vllm.LLM.generate`` of the same shapes (same engine options) and a bare DeepSpeed forward and
   forward-backward + optimizer step of the same rows (see there).

``--report`` prints the table: per phase the median seconds of the timed steps, the total per step,
the bare sum, and the overhead of the loop over the bare components (the issue's goal: <= 25%).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

PHASES = ("generate", "batch", "old_log_prob", "update", "weight_sync")
# the engine options of the sampling job, also used for the bare vLLM engine
VLLM_CONFIG = {"gpu_memory_utilization": 0.4, "max_num_seqs": 512}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for the JSON results and the server log")
    p.add_argument("--report", nargs="+", type=Path, help="print the table of these JSON files and exit")
    p.add_argument("--zorro", default="off", help="off, on, off,on (one server per setting) or none (--bare only)")
    p.add_argument("--bare", action="store_true", help="also time the bare components (after the loop)")
    p.add_argument("--steps", type=int, default=8, help="timed GRPO steps (default 8)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (compilation; default 1)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (default 64)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--response-len", type=int, default=512, help="response tokens (default 512)")
    p.add_argument("--micro", type=int, default=32, help="rows per micro-batch of the update (default 32)")
    p.add_argument("--bare-repeats", type=int, default=2, help="timed calls of each bare component (default 2)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU check: tiny model, transformers sampler, 4 prompts x n=2, 16 + 16 tokens, 2 steps")
    args = p.parse_args(argv)
    if args.report:
        return args
    if args.out is None:
        p.error("--out is required (or --report)")
    if args.cpu_smoke:
        args.prompts, args.n, args.prompt_len, args.response_len, args.micro = 4, 2, 16, 16, 4
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    args.device, args.sampler = ("cpu", "transformers") if args.cpu_smoke else ("cuda", "vllm")
    args.zorro_modes = [z.strip() for z in args.zorro.split(",") if z.strip() and z.strip() != "none"]
    bad = [z for z in args.zorro_modes if z not in ("off", "on")]
    if bad or not (args.zorro_modes or args.bare):
        p.error(f"--zorro: expected off, on, off,on or none (with --bare), got {args.zorro!r}")
    for name in ("steps", "prompts", "n", "prompt_len", "response_len", "micro", "bare_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup: must be >= 0, got {args.warmup}")
    if (args.prompts * args.n) % args.micro:
        p.error(f"--micro {args.micro} must divide the rows per step ({args.prompts} x {args.n})")
    if args.zorro_modes.count("on") and args.micro % args.n:
        p.error(f"--micro {args.micro}: with ZoRRO a micro-batch holds whole groups (a multiple of n={args.n})")
    return args


def build_model(args: argparse.Namespace, root: Path) -> Path:
    """The model directory: Qwen3-0.6B shape (bf16, random) on a GPU, a tiny Qwen3 for --cpu-smoke."""
    if args.cpu_smoke:
        from arctic_rl.tiny_models import build_tiny_model

        out = root / "tiny"
        if (out / "config.json").exists():
            return out
        return build_tiny_model(out, "qwen3", seed=0, hidden_size=64, num_layers=2, max_position_embeddings=256)
    from gen_throughput import build_model as build_06b  # Qwen3-0.6B shape, the project's char tokenizer

    return build_06b(root / "qwen3_06b")


def main_config(args: argparse.Namespace, model: Path, zorro: bool, workdir: Path) -> Any:
    """verl 0.9.1's PPO config with ``remote_backend=arctic`` set up for this benchmark."""
    from tests.support.arctic import verl_main_config

    return verl_main_config({
        "data": {"train_batch_size": args.prompts, "max_prompt_length": args.prompt_len,
                 "max_response_length": args.response_len},
        "actor_rollout_ref": {
            "model": {"enable_gradient_checkpointing": False},
            "actor": {"ppo_mini_batch_size": args.prompts, "ppo_micro_batch_size_per_gpu": args.micro,
                      "use_kl_loss": False, "ppo_max_token_len_per_gpu": args.micro * (args.prompt_len + args.response_len)},
            "rollout": {"n": args.n, "log_prob_max_token_len_per_gpu": args.micro * (args.prompt_len + args.response_len)},
        },
        "remote_backend": {
            "server": {"url": None, "local": {"device": args.device, "sampler": args.sampler,
                                              "threads": 1 if args.cpu_smoke else 8,
                                              "checkpoint_root": str(workdir / "ckpt"), "log_dir": str(workdir)}},
            "train": {"micro_batch_size": args.micro, "attn_implementation": "sdpa",
                      "zorro_train": {"enable": zorro}},
            "rollout": {"vllm_config": dict(args.vllm_config)},
        },
    }, model_path=str(model))


def step_prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 99) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"n": args.n, "max_tokens": args.response_len, "temperature": 1.0, "ignore_eos": True}


def grpo_step(client: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One GRPO step through the adapter; returns the seconds of each phase."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from tests.support.arctic import legacy_batch

    t: dict[str, float] = {}
    prompts = step_prompts(args, seed)
    t0 = time.perf_counter()
    results = client.generate(prompts, sampling_params(args))
    t["generate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = [prompts[r.prompt_index] for r in results]
    responses = [list(r.token_ids) for r in results]
    data = legacy_batch(rows, responses, p0=args.prompt_len, r0=args.response_len)
    # GRPO advantages: a random score per sample, normalised within its prompt's group
    scores = torch.rand(len(rows), generator=torch.Generator().manual_seed(seed)).view(args.prompts, args.n)
    adv = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    data["advantages"] = adv * data["response_mask"].float()  # padded [rows, response_len], as verl's
    tu.assign_non_tensor(data, calculate_entropy=True)
    t["batch"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = client.compute_log_prob(data)
    t["old_log_prob"] = time.perf_counter() - t0
    data["old_log_probs"] = no_padding_2_padding(out["log_probs"], data).float()
    tu.assign_non_tensor(data, global_batch_size=len(rows), mini_batch_size=len(rows), epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, temperature=1.0)
    t0 = time.perf_counter()
    answer = client.update_actor(data)
    t["update"] = time.perf_counter() - t0
    metrics = tu.get(answer, "metrics", None) or {}
    for name in ("arctic/zorro_applied", "arctic/zorro_token_saving", "arctic/passes", "arctic/tokens_computed"):
        if metrics.get(name):  # what the server's ZoRRO rule chose for the update (absent: ZoRRO not asked for)
            t[name] = float(metrics[name][0])
    t0 = time.perf_counter()
    client.update_weights()
    t["weight_sync"] = time.perf_counter() - t0
    t["tokens_generated"] = float(sum(len(r) for r in responses))
    return t


def run_loop(args: argparse.Namespace, model: Path, zorro: bool, workdir: Path, record: dict[str, Any]) -> None:
    """The loop of one ZoRRO setting; ``record`` is filled and written to ``--out`` after every step."""
    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

    path = args.out / f"loop_zorro_{'on' if zorro else 'off'}.json"
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    client = ArcticRLClient.from_config(main_config(args, model, zorro, workdir))
    record.update(zorro=zorro, start_s=time.perf_counter() - t0, steps=[], warmup=[])
    print(f"# zorro={'on' if zorro else 'off'}: server and jobs up in {record['start_s']:.1f}s", flush=True)
    try:
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            t = grpo_step(client, args, seed=1000 * int(zorro) + i)
            t["total"] = time.perf_counter() - t0
            (record["warmup"] if i < args.warmup else record["steps"]).append(t)
            print(f"# step {i}{' (warm-up)' if i < args.warmup else ''}: "
                  + " ".join(f"{k} {t[k]:.2f}s" for k in (*PHASES, "total")), flush=True)
            if args.cuda_mem:
                record.setdefault("gpu_used_gib", []).append(args.cuda_mem())
            path.write_text(json.dumps(record, indent=2))
    finally:
        client.destroy()
        for log in workdir.glob("*.log"):
            (args.out / f"server_zorro_{'on' if zorro else 'off'}.log").write_text(log.read_text()[-300_000:])


def gpu_used_gib() -> float:
    """GiB in use on GPU 0 by every process (the server's too), from the driver."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return (total - free) / 2**30


def shape(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("prompts", "n", "prompt_len", "response_len", "micro", "steps", "warmup",
                                           "device", "sampler")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        from grpo_report import print_report

        print_report(args.report)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="grpo-loop-"))
    args.cuda_mem = None if args.cpu_smoke else gpu_used_gib
    args.vllm_config = {} if args.cpu_smoke else dict(VLLM_CONFIG)
    model = build_model(args, work)
    for mode in args.zorro_modes:
        record = {"shape": shape(args), "vllm_config": VLLM_CONFIG, "zorro": mode == "on",
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        try:
            run_loop(args, model, mode == "on", work / f"zorro_{mode}", record)
        except Exception as exc:  # noqa: BLE001 - keep what ran, go on to the next setting
            record["error"] = repr(exc)[:3000]
            print(f"# zorro={mode} failed: {record['error']}", flush=True)
        (args.out / f"loop_zorro_{mode}.json").write_text(json.dumps(record, indent=2))
    if args.bare:
        from grpo_bare import run_bare

        bare = {"shape": shape(args), "vllm_config": VLLM_CONFIG}
        try:
            bare.update(run_bare(args, model, step_prompts(args, seed=0), sampling_params(args),
                                 main_config(args, model, False, work / "bare")))
        except Exception as exc:  # noqa: BLE001 - the loop's results stand without it
            bare["error"] = repr(exc)[:3000]
            print(f"# bare failed: {bare['error']}", flush=True)
        (args.out / "bare.json").write_text(json.dumps(bare, indent=2))
    from grpo_report import print_report

    print_report(sorted(args.out.glob("*.json")))


if __name__ == "__main__":
    main()
