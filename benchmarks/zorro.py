"""ZoRRO benchmark: forward+backward time and peak memory with and without prompt deduplication.

For each architecture (Qwen3, Qwen2, Llama; small fp32 models), each ``rollout_n`` and each
prompt:response length ratio, one batch of ``num_prompts`` prompts x ``rollout_n`` responses in the
protocol's layout (left-padded prompts of 50-100% of ``P``, right-padded responses of 50-100% of
``R``) runs ``response_logprobs`` + the GRPO loss + ``backward`` through the plain ``[B, P+R]``
pass and through ZoRRO's shared-prompt pass (:mod:`arctic_rl.server.zorro.forward`). Reported:

* ``plain_ms`` / ``zorro_ms``: median wall time of ``--repeats`` timed runs (after one warm-up);
  the two paths alternate so machine noise hits both alike.
* ``tok_red``: theoretical token reduction ``B*(P+R) / (U*P + B*R)``; ``speedup``: measured
  ``plain_ms / zorro_ms`` (medians); ``best_sp``: the ratio of the fastest run of each path
  (other processes on a shared machine only ever add time, so the minimum is the steadier
  estimate); ``eff`` = best_sp / tok_red.
* ``plain_MB`` / ``zorro_MB``: peak resident memory *above the pre-call baseline* during one
  forward+backward, read from Linux's ``VmHWM`` after resetting it (``/proc/self/clear_refs``).
  Measured in a separate process (same model, same batches) started with
  ``MALLOC_MMAP_THRESHOLD_=131072`` so glibc hands every large tensor back to the OS when it is
  freed: the number is the peak of live tensors (+ small allocator overhead), not allocator
  caching. Timings run in the main process with the default allocator, because that setting
  costs page faults. ``n/a`` where /proc is not available.
* ``lp_err`` / ``grad_err``: max relative error (``max|a-b| / max|b|``) of the log-probs and of all
  parameter gradients, ZoRRO vs plain.

Both paths get the same optimisations: the LM head runs only where logits are needed
(``logits_to_keep``), and the fp32 log-softmax runs by row chunks without an fp32 copy of the
logits kept for the backward.

With ``--device cuda`` the same table is measured on a GPU: times are synchronised wall times,
memory is ``torch.cuda.max_memory_allocated`` above the pre-call allocation, and ``--dtype bf16``
runs the model in bfloat16 (the error check then only reports: bf16 rounding differs by path).

Run: ``python benchmarks/zorro.py`` (3-4 minutes on one core of a quiet machine), ``--quick`` for
a smoke run. The check "speed-up >= 0.7 x token reduction at n=8, 4:1" is printed as PASS/FAIL per
architecture, judged on ``best_sp`` (the median-based speed-up is printed beside it); that
configuration is timed at least 7 times. The load average is printed before and after: on a
loaded machine every timing here is mostly noise. The exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def _memory_in_subprocess(argv: list[str], threads: int) -> dict[tuple, dict]:
    """Peak-memory numbers of every configuration, measured in a child process (see the docstring)."""
    import subprocess

    env = dict(os.environ, **{_MMAP_ENV: "131072", "OMP_NUM_THREADS": str(threads)})
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv, "--memory-only"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        print(f"# memory measurement failed: {proc.stderr.strip()[-500:]}", flush=True)
        return {}
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return {(x["arch"], x["n"], x["ratio"]): x for x in rows}


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_batch(num_prompts: int, n: int, p: int, r: int, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    b = num_prompts * n
    ids = torch.zeros(b, p + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for u in range(num_prompts):
        plen = int(torch.randint(p // 2, p + 1, (1,), generator=g))
        prompt = torch.randint(3, vocab, (plen,), generator=g)
        for k in range(n):
            row = u * n + k
            rlen = int(torch.randint(max(1, r // 2), r + 1, (1,), generator=g))
            ids[row, p - plen : p] = prompt
            ids[row, p : p + rlen] = torch.randint(3, vocab, (rlen,), generator=g)
            mask[row, p - plen : p + rlen] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def fwd_bwd(model, batch, p: int, zorro: bool):
    import torch

    from arctic_rl.protocol import LossConfig
    from arctic_rl.server.compute.losses import compute_loss
    from arctic_rl.server.compute.token_logprobs import response_logprobs

    ids, mask, pos = batch
    model.zero_grad(set_to_none=True)
    out = response_logprobs(model, ids, mask, pos, p, zorro=zorro)
    lp = out.logprobs.detach()
    rl = {
        "response_mask": mask[:, p:],
        "old_log_probs": lp + 0.1,
        "advantages": torch.linspace(-1, 1, ids.shape[0], device=lp.device).unsqueeze(1).expand_as(lp).contiguous(),
    }
    loss, _ = compute_loss("grpo", out, rl, LossConfig())
    loss.backward()
    return lp, out


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _grads(model):
    import torch

    return torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])


def check_and_time(model, batch, p: int, repeats: int) -> dict:
    """Correctness (ZoRRO vs plain) on the warm-up run, then the median of ``repeats`` timed runs."""
    lp_plain, plain_out = fwd_bwd(model, batch, p, False)
    g_plain = _grads(model)
    lp_zorro, zorro_out = fwd_bwd(model, batch, p, True)
    result = {
        "B": batch[0].shape[0],
        "U": zorro_out.unique_prompts,
        "lp_err": _rel(lp_zorro, lp_plain),
        "grad_err": _rel(_grads(model), g_plain),
        "tokens_plain": plain_out.tokens_computed,
        "tokens_zorro": zorro_out.tokens_computed,
    }
    del lp_plain, lp_zorro, g_plain, plain_out, zorro_out
    model.zero_grad(set_to_none=True)
    wall: dict[str, list[float]] = {"plain": [], "zorro": []}
    for _ in range(repeats):  # alternate the paths so machine noise hits both alike
        for name, zorro in (("plain", False), ("zorro", True)):
            _sync()
            start = time.perf_counter()
            fwd_bwd(model, batch, p, zorro)
            _sync()
            wall[name].append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    for name in ("plain", "zorro"):
        result[f"{name}_ms"] = 1000 * statistics.median(wall[name])
        result[f"{name}_best_ms"] = 1000 * min(wall[name])
    return result


def measure_memory(model, batch, p: int) -> dict:
    """Peak resident memory above the baseline during one fwd+bwd of each path (MiB)."""
    fwd_bwd(model, batch, p, True)  # warm-up (the cheap path): one-time allocations are not part of the peak
    result = {}
    for name, zorro in (("plain", False), ("zorro", True)):
        model.zero_grad(set_to_none=True)
        base = _status_kib("VmRSS:")
        ok = base is not None and _reset_peak_rss()
        fwd_bwd(model, batch, p, zorro)
        peak = _status_kib("VmHWM:") if ok else None
        result[f"{name}_MB"] = (peak - base) / 1024 if ok and peak is not None else None
    model.zero_grad(set_to_none=True)
    return result


def measure_cuda_memory(model, batch, p: int) -> dict:
    """Peak CUDA memory allocated above the pre-call allocation during one fwd+bwd (MiB)."""
    import torch

    result = {}
    for name, zorro in (("plain", False), ("zorro", True)):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(model, batch, p, zorro)
        torch.cuda.synchronize()
        result[f"{name}_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    model.zero_grad(set_to_none=True)
    return result


def configurations(args):
    """(arch, model-builder, [(n, ratio, P, R, batch), ...]) in table order."""
    import torch
    from transformers import AutoModelForCausalLM

    from arctic_rl.tiny_models import tiny_config

    for arch in args.archs:
        config = tiny_config(
            arch, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
            num_heads=args.heads, num_kv_heads=args.kv_heads,
        )  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
        model = model.to(device=args.device, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32).train()
        for n in args.rollout_n:
            for ratio in args.ratios:
                r = args.response_len
                p = ratio * r
                yield (
                    arch,
                    model,
                    n,
                    ratio,
                    p,
                    r,
                    tuple(
                        t.to(args.device)
                        for t in make_batch(args.num_prompts, n, p, r, args.vocab, seed=n * 100 + ratio)
                    ),
                )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", nargs="+", default=["qwen3", "qwen2", "llama"])
    parser.add_argument("--rollout-n", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--ratios", nargs="+", type=int, default=[1, 4, 8], help="prompt:response = ratio:1")
    parser.add_argument("--response-len", type=int, default=32, help="R; P = ratio * R")
    parser.add_argument("--num-prompts", type=int, default=2, help="unique prompts U per batch")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocess")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: one arch, n=8, ratio 4, R=8")
    args = parser.parse_args(argv)
    if args.quick:
        args.archs, args.rollout_n, args.ratios = args.archs[:1], [8], [4]
        args.response_len, args.repeats, args.hidden, args.vocab = 8, 1, 64, 128
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    torch.set_num_threads(args.threads)
    if args.memory_only:
        rows = []
        for arch, model, n, ratio, p, _, batch in configurations(args):
            rows.append({"arch": arch, "n": n, "ratio": ratio, **measure_memory(model, batch, p)})
        print(json.dumps(rows))
        return 0

    print(
        f"# ZoRRO benchmark: hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} "
        f"vocab={args.vocab} attn={args.attn} {args.dtype} {args.device} threads={args.threads} U={args.num_prompts} "
        f"R={args.response_len} repeats={args.repeats} torch={torch.__version__} load average {_loadavg()}",
        flush=True,
    )
    started = time.perf_counter()
    memory = {}
    if not args.no_memory and args.device == "cpu":
        print("# measuring peak memory in a subprocess ...", flush=True)
        memory = _memory_in_subprocess([a for a in argv if a != "--memory-only"], args.threads)
    header = (
        f"{'arch':6} {'n':>3} {'P:R':>5} {'B':>4} {'U':>3} {'tok_red':>7} {'plain_ms':>9} {'zorro_ms':>9} "
        f"{'speedup':>7} {'best_sp':>7} {'eff':>5} {'plain_MB':>8} {'zorro_MB':>8} {'lp_err':>8} {'grad_err':>8}"
    )
    print(header, flush=True)
    rows = []
    for arch, model, n, ratio, p, r, batch in configurations(args):
        judged = n == 8 and ratio == 4  # the configuration of the speed check gets more samples
        repeats = max(args.repeats, 7) if judged and not args.quick else args.repeats
        res = check_and_time(model, batch, p, repeats)
        res["repeats"] = repeats
        res.update(memory.get((arch, n, ratio), {"plain_MB": None, "zorro_MB": None}))
        if args.device == "cuda" and not args.no_memory:
            res.update(measure_cuda_memory(model, batch, p))
        b, u = res["B"], res["U"]
        tok_red = b * (p + r) / (u * p + b * r)
        speedup = res["plain_ms"] / res["zorro_ms"]
        best = res["plain_best_ms"] / res["zorro_best_ms"]
        res.update(arch=arch, n=n, P=p, R=r, ratio=ratio, tok_red=tok_red, speedup=speedup, best_speedup=best)
        rows.append(res)

        def mb(v):
            return f"{v:8.1f}" if v is not None else f"{'n/a':>8}"

        print(
            f"{arch:6} {n:>3} {f'{ratio}:1':>5} {b:>4} {u:>3} {tok_red:>7.2f} {res['plain_ms']:>9.1f} "
            f"{res['zorro_ms']:>9.1f} {speedup:>7.2f} {best:>7.2f} {best / tok_red:>5.2f} "
            f"{mb(res['plain_MB'])} {mb(res['zorro_MB'])} {res['lp_err']:>8.1e} {res['grad_err']:>8.1e}",
            flush=True,
        )
    print(f"# total {time.perf_counter() - started:.0f} s; load average now {_loadavg()}")

    ok = True
    for arch in args.archs:
        for x in (x for x in rows if x["arch"] == arch and x["n"] == 8 and x["ratio"] == 4):
            passed = x["best_speedup"] >= 0.7 * x["tok_red"]
            verdict = "PASS" if passed else "FAIL"
            if args.quick:  # a toy model is all overhead: the target is judged on the full run only
                verdict = f"{verdict} (not judged with --quick)"
            else:
                ok &= passed
            print(
                f"CHECK {arch}: speed-up {x['best_speedup']:.2f} (best of {x['repeats']}; median "
                f"{x['speedup']:.2f}) >= 0.7 x token reduction {x['tok_red']:.2f} = {0.7 * x['tok_red']:.2f} "
                f"at n=8, 4:1: {verdict}"
            )
    worst = max((max(x["lp_err"], x["grad_err"]) for x in rows), default=0.0)
    if args.dtype == "fp32":
        print(f"CHECK max relative error ZoRRO vs plain (log-probs, gradients): {worst:.1e} <= 1e-5: "
              f"{'PASS' if worst <= 1e-5 else 'FAIL'}")  # fmt: skip
        ok &= worst <= 1e-5
    else:
        print(f"INFO max relative error ZoRRO vs plain in {args.dtype}: {worst:.1e} (not judged)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
