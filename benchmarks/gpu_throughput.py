"""GPU throughput of the reference server's own engines: training MFU, ZoRRO speed-up, sampling tok/s.

    python benchmarks/gpu_throughput.py [--out DIR] [--budget-s 480] [--plans shipped,eager,...]  # one GPU, bf16
    python benchmarks/gpu_throughput.py --device cpu --tiny              # CPU dry run (fp32, tiny)

What runs, all in ONE process and one run so that every ratio compares like with like:

1. ``peak``: a dense 8192^3 bf16 matmul (``--tiny``: 1024^3 fp32), median of CUDA-event timings:
   the ceiling MFU is quoted against (measured here, not a datasheet number).
2. A randomly initialised Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 q / 8 kv heads of
   128, MLP 3072, tied embeddings, vocab 151,936 -- Qwen3's real vocabulary, so the LM head is as
   heavy as in a real run), saved to a local directory and loaded by the server's own
   :class:`arctic_rl.server.engines.training.TrainingEngine` (DeepSpeed, bf16, AdamW), once per
   *plan* (:data:`PLANS`): ``shipped`` (what a job gets by default: the client's ``zero_stage: 0``,
   which the server runs as ZeRO-1 with bf16, and the server's ``--torch-compile auto``, i.e. whole
   compiled decoder layers on CUDA), ``eager`` (the same without compilation) and
   ``compile_modules`` (only norms and MLPs compiled). ``torch._dynamo.reset()`` before each plan.
3. ``train`` cases: bodies built like the adapter's ``/forward-backward`` bodies (verl GRPO loss,
   ``post=[apply_temperature, compute_entropy_and_logprobs]``), validated by the server's own
   ``parse_batch_body`` and run through ``TrainingEngine.forward_backward`` + ``step`` -- the exact
   code a ``/forward-backward`` + ``/step`` pair runs, minus HTTP. Rows are full (no padding).
   ``hf_labels`` is the earlier baseline in the same engine: ``model(input_ids, labels=input_ids)``
   (full-vocabulary fp32 logits at every position).
4. ``profile``: ``torch.profiler`` over two steps of the main plain case and of the ZoRRO case
   (top kernels, time by kernel family, kernel time vs wall time), and over one optimizer step.
5. ``generate``: the server's :class:`~arctic_rl.server.engines.sampling.SamplingEngine`
   (``transformers`` model, its own sampling loop) on 64 prompts, at batch 32 and 64 (server default since the batch-32 run: 64)
   and 64, against ``model.generate`` on the same prompts; and a host-side profile of both.

FLOPs (``flops_needed``), counted as the work the loss needs and nothing else, fwd + bwd = 3 x fwd:

* linear layers: ``2 * N_layers * tokens_through_the_model`` forward, where ``N_layers`` are the
  parameters of the decoder layers + final norm (no embedding, no LM head);
* attention: ``4 * L * (heads * head_dim)`` per (query, key) pair a causal mask allows, i.e.
  ``T(T+1)/2`` pairs for a row of ``T`` tokens; ZoRRO: ``P(P+1)/2`` per unique prompt plus
  ``R*P + R(R+1)/2`` per response row;
* LM head: ``2 * hidden * V`` per position whose logits the loss uses -- ``R`` per row for the plain
  pass (the response positions), ``U + B(R-1)`` for ZoRRO; ``T-1`` per row for ``hf_labels``;
* not counted: norms, rotary, softmax/log-softmax, the optimizer (all memory-bound), padding.

MFU = flops_needed / time / peak. ``tok/s`` is batch tokens ``B*(P+R)`` per second of fwd+bwd+step
(the same numerator with and without ZoRRO, so their ratio is the speed-up). Results go to
``OUT/gpu_results.json`` (every number), ``OUT/gpu_tables.txt`` and ``OUT/profile_*.txt``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

QWEN3_06B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}
TINY = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


# ----------------------------------------------------------------------------------- set-up

def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "transformers": transformers.__version__}
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception as exc:  # noqa: BLE001 - reported, the engine import will fail loudly
        env["deepspeed"] = f"not importable: {exc!r}"[:200]
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30,
                                                check=False).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = repr(exc)
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, tiny: bool, repeats: int = 20) -> float:
    """FLOP/s of a dense square matmul (bf16 8192^3 on GPU; fp32 on CPU), median of ``repeats``."""
    n, dtype = (1024, torch.float32) if tiny or device.type == "cpu" else (8192, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    pairs = [(torch.randn(n, n, device=device, dtype=dtype, generator=gen),
              torch.randn(n, n, device=device, dtype=dtype, generator=gen)) for _ in range(2)]
    for a, b in pairs * 2:
        a @ b
    times = []
    for i in range(repeats):
        a, b = pairs[i % 2]  # alternate inputs: not one buffer hot in L2
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def build_model_dir(path: Path, spec: dict[str, int], device: torch.device) -> Path:
    """A random-init Qwen3 of ``spec`` + a word-level tokenizer covering its vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = spec["vocab_size"]
    cfg = Qwen3Config(**spec, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=1e6,
                      eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(dtype).save_pretrained(str(path))
    del model
    words = {"<|endoftext|>": 0, "<|im_end|>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<|endoftext|>"))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(str(path))
    return path


# ----------------------------------------------------------------------------------- FLOPs

def model_dims(model: torch.nn.Module) -> dict[str, int]:
    cfg = model.config
    inner = model.model
    n_layers = sum(p.numel() for p in inner.layers.parameters()) + sum(p.numel() for p in inner.norm.parameters())
    return {"n_layer_params": n_layers, "n_params": sum(p.numel() for p in model.parameters()),
            "L": cfg.num_hidden_layers, "d_attn": cfg.num_attention_heads * cfg.head_dim,
            "hidden": cfg.hidden_size, "vocab": cfg.vocab_size}


def flops_needed(dims: dict[str, int], *, rows: int, p: int, r: int, n: int, zorro: bool,
                 logits_positions: int | None = None) -> float:
    """fwd+bwd FLOPs the loss needs (see the module docstring)."""
    lin, att, head = 2 * dims["n_layer_params"], 4 * dims["L"] * dims["d_attn"], 2 * dims["hidden"] * dims["vocab"]
    if zorro:
        u = rows // n
        tokens = u * p + rows * r
        pairs = u * p * (p + 1) / 2 + rows * (r * p + r * (r + 1) / 2)
        positions = u + rows * (r - 1)
    else:
        t = p + r
        tokens, pairs = rows * t, rows * t * (t + 1) / 2
        positions = rows * r if logits_positions is None else logits_positions
    return 3.0 * (lin * tokens + att * pairs + head * positions)


# ----------------------------------------------------------------------------------- training

def train_body(rows: int, p: int, r: int, n: int, vocab: int, *, zorro: bool, entropy: bool, seed: int) -> dict:
    """A ``/forward-backward`` body like the adapter's: ``rows // n`` prompts x ``n`` responses."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab, (rows // n, p), generator=g).repeat_interleave(n, dim=0)
    responses = torch.randint(2, vocab, (rows, r), generator=g)
    ids = torch.cat([prompts, responses], 1)
    ones = torch.ones_like(ids)
    lp0 = -float(torch.log(torch.tensor(float(vocab))))  # a random model's log-prob: ratios near 1
    batch = {"input_ids": ids, "attention_mask": ones, "position_ids": torch.arange(p + r).expand(rows, -1).clone(),
             "prompts": prompts, "responses": responses, "response_mask": torch.ones(rows, r, dtype=torch.long),
             "advantages": torch.randn(rows, r, generator=g), "old_log_probs": torch.full((rows, r), lp0)}
    post = ["apply_temperature", "compute_entropy_and_logprobs"] if entropy else ["apply_temperature"]
    meta = {"zorro_train_enable": zorro, "rollout_n": n, "temperature": 1.0, "calculate_entropy": entropy,
            "max_prompt_len": p, "max_response_len": r, "global_batch_size": rows}
    return {"batch": batch, "meta": meta,
            "processing": {"loss_fn": "verl_grpo", "post": post, "config": {"clip_ratio": 0.2}}}


def make_training_engine(model_dir: Path, device: torch.device, work: Path, zero_stage: int = 0,
                         data_types: dict | None = None, torch_compile: str = "auto", **knobs: Any):
    from arctic_rl.protocol import JobConfig, JobType
    from arctic_rl.server.engines.training import TrainingEngine
    from arctic_rl.server.settings import ServerSettings

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "bf16": {"enabled": device.type == "cuda"}, "zero_optimization": {"stage": zero_stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-7, "weight_decay": 0.0}}}
    if data_types is not None:
        ds["data_types"] = data_types
    config = JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING, ds_config=ds, ds_worker_config=knobs)
    # zorro_min_saving=0: a ZoRRO case measures ZoRRO's own pass, whatever the server's rule would pick
    settings = ServerSettings(device=device.type, checkpoint_root=work / "ckpt", torch_compile=torch_compile,
                              zorro_min_saving=0.0)
    (work / "job").mkdir(parents=True, exist_ok=True)
    return TrainingEngine(config, settings, work / "job")


def time_case(engine, device: torch.device, case: dict, vocab: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Median fwd+bwd and step seconds of one case (alternating nothing: one engine, one case)."""
    from arctic_rl.server.http.validation import parse_batch_body

    rows, p, r, n = case["rows"], case["p"], case["r"], case["n"]
    if case.get("hf_labels"):
        ids = torch.randint(2, vocab, (rows, p + r), generator=torch.Generator().manual_seed(1)).to(device)
        ds = engine.engine

        def fb():
            loss = ds(lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss)
            ds.backward(loss)
            return float(loss.detach())

        def step():
            ds.step()
            return {}
    else:
        body = train_body(rows, p, r, n, vocab, zorro=case["zorro"], entropy=case.get("entropy", True), seed=1)
        batch = parse_batch_body(body, vocab_size=vocab, train=True)

        def fb():
            return engine.forward_backward(batch)["metrics"]

        def step():
            return engine.step()["metrics"]
    fb_s, step_s, info, first_s = [], [], {}, None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for i in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fb()
        sync(device)
        t1 = time.perf_counter()
        stepped = step()
        sync(device)
        t2 = time.perf_counter()
        if i == 0:
            first_s = t2 - t0  # includes compilation under torch.compile
        if i >= warmup:
            fb_s.append(t1 - t0)
            step_s.append(t2 - t1)
        if isinstance(out, dict):
            info = {k: out[k] for k in ("tokens_computed", "unique_prompts", "loss") if k in out}
        info["grad_norm"] = (stepped or {}).get("grad_norm")
    res = {"fb_s": statistics.median(fb_s), "step_s": statistics.median(step_s), "fb_all_s": fb_s,
           "first_step_s": first_s, **info}
    if device.type == "cuda":
        res["peak_mem_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return res


def train_cases(tiny: bool) -> list[dict[str, Any]]:
    if tiny:
        return [{"name": "hf_labels", "rows": 4, "p": 1, "r": 47, "n": 1, "zorro": False, "hf_labels": True},
                {"name": "plain_main", "rows": 4, "p": 24, "r": 24, "n": 1, "zorro": False},
                {"name": "plain_main_noent", "rows": 4, "p": 24, "r": 24, "n": 1, "zorro": False, "entropy": False},
                {"name": "zorro_shape_plain", "rows": 8, "p": 32, "r": 8, "n": 8, "zorro": False},
                {"name": "zorro_shape_zorro", "rows": 8, "p": 32, "r": 8, "n": 8, "zorro": True}]
    return [
        {"name": "hf_labels_B8_T2048", "rows": 8, "p": 1, "r": 2047, "n": 1, "zorro": False, "hf_labels": True},
        {"name": "plain_B8_P1_R2047", "rows": 8, "p": 1, "r": 2047, "n": 1, "zorro": False},
        {"name": "plain_B8_P1024_R1024", "rows": 8, "p": 1024, "r": 1024, "n": 1, "zorro": False},
        {"name": "plain_B8_P1024_R1024_noent", "rows": 8, "p": 1024, "r": 1024, "n": 1, "zorro": False, "entropy": False},
        {"name": "plain_B16_P1024_R1024", "rows": 16, "p": 1024, "r": 1024, "n": 1, "zorro": False},
        {"name": "zorro_shape_B8_plain", "rows": 8, "p": 2048, "r": 512, "n": 8, "zorro": False},
        {"name": "zorro_shape_B8_zorro", "rows": 8, "p": 2048, "r": 512, "n": 8, "zorro": True},
        {"name": "zorro_shape_B16_plain", "rows": 16, "p": 2048, "r": 512, "n": 8, "zorro": False},
        {"name": "zorro_shape_B16_zorro", "rows": 16, "p": 2048, "r": 512, "n": 8, "zorro": True},
        {"name": "zorro_shape_B32_zorro", "rows": 32, "p": 2048, "r": 512, "n": 8, "zorro": True},
        {"name": "zorro_shape_B32_plain", "rows": 32, "p": 2048, "r": 512, "n": 8, "zorro": False},
        {"name": "zorro_shape_B64_zorro", "rows": 64, "p": 2048, "r": 512, "n": 8, "zorro": True},
    ]


# ----------------------------------------------------------------------------------- profile

_FAMILIES = (("attention", ("flash", "fmha", "attention", "efficient", "sdpa")),
             ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")),
             ("copy/memset", ("memcpy", "memset", "copy_", "cat", "index")),
             ("reduce/softmax", ("reduce", "softmax", "logsumexp", "norm", "sum")))


def profile_case(engine, device: torch.device, case: dict, vocab: int, steps: int = 2) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    time_case(engine, device, case, vocab, warmup=1, repeats=0 + 1)  # warm
    with profile(activities=acts) as prof:
        sync(device)
        t0 = time.perf_counter()
        time_case(engine, device, case, vocab, warmup=0, repeats=steps)
        sync(device)
        wall = time.perf_counter() - t0
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    avgs = prof.key_averages()
    try:
        table = avgs.table(sort_by=key, row_limit=25)
    except (AttributeError, KeyError, ValueError):
        table = avgs.table(sort_by="self_cuda_time_total", row_limit=25)
    is_kernel = (lambda e: e.device_type == torch.autograd.DeviceType.CUDA) if device.type == "cuda" else (lambda e: True)
    kernels = [e for e in avgs if getattr(e, key, 0) > 0 and is_kernel(e)]
    total_us = sum(getattr(e, key) for e in kernels)
    families: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        fam = next((f for f, pats in _FAMILIES if any(s in name for s in pats)), "elementwise/other")
        families[fam] = families.get(fam, 0.0) + getattr(e, key) / 1e6
    top = sorted(kernels, key=lambda e: -getattr(e, key))[:12]
    return {"wall_s": wall, "kernel_s": total_us / 1e6, "busy": total_us / 1e6 / wall if wall else 0.0,
            "families_s": families, "top": [(e.key[:90], getattr(e, key) / 1e6, e.count) for e in top],
            "table": table}


# ----------------------------------------------------------------------------------- generation

def generation(model_dir: Path, device: torch.device, tiny: bool, max_tokens: int,
               batches: list[int]) -> list[dict[str, Any]]:
    from arctic_rl.protocol import GenerateRequest, JobConfig, JobType, SamplingParams
    from arctic_rl.server.engines.sampling import SamplingEngine
    from arctic_rl.server.settings import ServerSettings

    prompts_n, prompt_len = (8, 16) if tiny else (64, 256)
    eng = SamplingEngine(JobConfig(model_name=str(model_dir), job_type=JobType.SAMPLING),
                         ServerSettings(device=device.type))
    vocab = eng.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(2, vocab, (prompts_n, prompt_len), generator=g)
    request = GenerateRequest(prompts=prompts.tolist())
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=0)
    rows = []
    eng.batch_size = prompts_n  # warm-up (kernels, allocator)
    eng.generate(GenerateRequest(prompts=prompts[:2].tolist()), SamplingParams(max_tokens=4, ignore_eos=True))
    shape = f"{prompts_n} prompts x {prompt_len} tok, {max_tokens} new"
    for bs in batches:
        bs = min(bs, prompts_n) if not tiny else max(1, min(bs, 64) * prompts_n // 64)  # tiny: same fractions
        label = f"server SamplingEngine, batch {bs}" + (" (server default)" if bs == 64 else "")
        eng.batch_size = bs
        sync(device)
        t0 = time.perf_counter()
        out = eng.generate(request, params)
        sync(device)
        dt = time.perf_counter() - t0
        toks = sum(len(o["token_ids"]) for o in out)
        rows.append({"what": label, "shape": shape, "batch": bs, "tokens": toks, "s": dt, "tok_s": toks / dt,
                     "ms_per_step": dt / (max_tokens * -(-prompts_n // bs)) * 1e3})
    ids = prompts.to(device)
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        gen = eng.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
        sync(device)
        dt = time.perf_counter() - t0
    toks = (gen.shape[1] - prompt_len) * prompts_n
    rows.append({"what": "transformers model.generate", "shape": shape, "batch": prompts_n, "tokens": toks, "s": dt, "tok_s": toks / dt,
                 "ms_per_step": dt / max_tokens * 1e3})
    eng.close()
    return rows


# ----------------------------------------------------------------------------------- plans

#: name -> (engine kwargs, cases); ``--plans`` picks them (tiny runs use the tiny case names).
#: ``shipped`` is what a job gets by default: the client's ``zero_stage: 0`` (which the server runs as
#: ZeRO-1 with bf16) and the server's ``--torch-compile auto`` (whole decoder layers on CUDA).
PLANS = {
    "shipped": ({}, ["plain_B8_P1024_R1024", "zorro_shape_B16_plain", "zorro_shape_B16_zorro",
                     "zorro_shape_B32_zorro", "zorro_shape_B32_plain", "zorro_shape_B64_zorro",
                     "plain_B8_P1024_R1024_noent",
                     "zorro_shape_B8_plain", "zorro_shape_B8_zorro", "plain_B16_P1024_R1024", "plain_B8_P1_R2047",
                     "hf_labels_B8_T2048"]),
    "eager": ({"torch_compile": "off"}, ["plain_B8_P1024_R1024", "zorro_shape_B16_plain", "zorro_shape_B16_zorro",
                                        "zorro_shape_B32_zorro", "zorro_shape_B64_zorro"]),
    "compile_modules": ({"torch_compile": "modules"},
                        ["plain_B8_P1024_R1024", "zorro_shape_B16_plain", "zorro_shape_B16_zorro",
                         "zorro_shape_B32_zorro"]),
    "tiny_compile": ({"torch_compile": "layers"}, ["plain_B8_P1024_R1024", "zorro_shape_B8_plain",
                                                  "zorro_shape_B8_zorro"]),
}
TINY_CASES = {"hf_labels_B8_T2048": "hf_labels", "plain_B8_P1024_R1024": "plain_main",
              "plain_B8_P1024_R1024_noent": "plain_main_noent", "zorro_shape_B8_plain": "zorro_shape_plain",
              "zorro_shape_B8_zorro": "zorro_shape_zorro"}
PROFILED = ("plain_B8_P1024_R1024", "zorro_shape_B32_zorro", "plain_main", "zorro_shape_zorro")


def profile_step(engine, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    case = {"name": "s", "rows": 2, "p": 8, "r": 8, "n": 1, "zorro": False}
    time_case(engine, device, case, engine.vocab_size, warmup=1, repeats=1)
    from arctic_rl.server.http.validation import parse_batch_body

    engine.forward_backward(parse_batch_body(train_body(2, 8, 8, 1, engine.vocab_size, zorro=False, entropy=True,
                                                        seed=2), vocab_size=engine.vocab_size, train=True))
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        wall = time.perf_counter() - t0
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return f"step wall {wall * 1e3:.1f} ms (under the profiler)\n" + prof.key_averages().table(sort_by=key, row_limit=15)


def run_plan(label: str, engine_kwargs: dict, names: list[str], *, model_dir: Path,
             device: torch.device, work: Path, args, peak: float, results: dict, lines: list[str], left,
             out_dir: Path) -> None:
    by_name = {c["name"]: c for c in train_cases(args.tiny)}
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    if args.tiny:
        names = [TINY_CASES[n] for n in names if n in TINY_CASES]
    torch._dynamo.reset()  # each plan compiles from scratch, as a fresh server process would
    engine = make_training_engine(model_dir, device, work / label.replace(" ", "_"), **engine_kwargs)
    plan = results.setdefault("plans", {}).setdefault(label, {"engine": engine_kwargs, "ds_config": engine.ds_config,
                                                              "cases": {}})
    dims = model_dims(engine.model)
    results["dims"], results["attn_implementation"] = dims, getattr(engine.model.config, "_attn_implementation", None)
    hdr = (f"{'case':30} {'B':>3} {'P':>5} {'R':>5} {'n':>2} {'fb_ms':>8} {'step_ms':>8} {'tok/s':>9} "
           f"{'MFU_fb':>7} {'MFU_all':>7} {'mem_GiB':>7} {'1st_s':>6}")
    lines += ["", (f"== {label}: ds zero stage {engine.ds_config['zero_optimization']['stage']}, optimizer "
              f"{type(engine.engine.optimizer).__name__}, torch_compile={engine.torch_compile}"), hdr]
    print("\n".join(lines[-3:]), flush=True)
    for name in names:
        case = by_name[name]
        if left() < 45:
            print(f"# budget: skipping {name}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            res = time_case(engine, device, case, dims["vocab"], args.warmup, args.repeats)
        except torch.OutOfMemoryError as exc:
            res = {"error": f"OOM: {exc}"[:200]}
        except Exception as exc:  # noqa: BLE001 - an experiment may fail; the run goes on
            res = {"error": repr(exc)[:300]}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        res["case_wall_s"] = time.perf_counter() - t0
        if "error" in res:
            plan["cases"][name] = {**case, **res}
            lines.append(f"{name:30} {res['error'][:100]}")
            print(lines[-1], flush=True)
            continue
        logits_pos = case["rows"] * (case["p"] + case["r"] - 1) if case.get("hf_labels") else None
        fl = flops_needed(dims, rows=case["rows"], p=case["p"], r=case["r"], n=case["n"], zorro=case["zorro"],
                          logits_positions=logits_pos)
        all_s = res["fb_s"] + res["step_s"]
        res.update(flops=fl, tok_s=case["rows"] * (case["p"] + case["r"]) / all_s, mfu_fb=fl / res["fb_s"] / peak,
                   mfu_all=fl / all_s / peak)
        plan["cases"][name] = {**case, **res}
        lines.append(f"{name:30} {case['rows']:>3} {case['p']:>5} {case['r']:>5} {case['n']:>2} "
                     f"{res['fb_s'] * 1e3:>8.1f} {res['step_s'] * 1e3:>8.1f} {res['tok_s']:>9.0f} "
                     f"{res['mfu_fb']:>7.1%} {res['mfu_all']:>7.1%} {res.get('peak_mem_gib', float('nan')):>7.1f}"
                     f" {res['first_step_s']:>6.1f}")
        print(lines[-1], flush=True)
    cases = plan["cases"]
    best_plain = max((c["tok_s"] for k, c in cases.items() if "zorro_shape" in k and not c["zorro"] and "tok_s" in c),
                     default=None)
    for k, c in cases.items():
        if "zorro_shape" in k and c.get("zorro") and "tok_s" in c:
            same = cases.get(k.replace("_zorro", "_plain"), {})
            if "tok_s" in same:
                lines.append(f"ZoRRO speed-up {k}: {c['tok_s'] / same['tok_s']:.2f}x vs plain at the same B "
                             f"(FLOP reduction {same['flops'] / c['flops']:.2f}x)")
            if best_plain:
                lines.append(f"ZoRRO speed-up {k}: {c['tok_s'] / best_plain:.2f}x vs the best plain micro-batch "
                             f"of this plan ({best_plain:.0f} tok/s)")
    print("\n".join(l for l in lines if l.startswith("ZoRRO") and l not in results.get("_printed", [])), flush=True)
    results.setdefault("_printed", []).extend(l for l in lines if l.startswith("ZoRRO"))
    if not args.no_profile and left() > 60:
        for name in names:
            if name in PROFILED and name in cases and "tok_s" in cases[name] and left() > 60:
                prof = profile_case(engine, device, by_name[name], dims["vocab"])
                with open(out_dir / f"profile_{name}.txt", "a") as f:
                    f.write(f"\n===== {label}: {name}\n{prof.pop('table')}")
                plan.setdefault("profile", {})[name] = prof
                fams = ", ".join(f"{k} {v:.3f}s" for k, v in sorted(prof["families_s"].items(), key=lambda x: -x[1]))
                lines.append(f"profile {name}: kernels {prof['kernel_s']:.3f}s in {prof['wall_s']:.3f}s wall "
                             f"(2 steps, profiler on); {fams}")
                lines += [f"    {s_ * 1e3:9.1f} ms  x{c_:<5} {k_}" for k_, s_, c_ in prof["top"][:8]]
                print("\n".join(lines[-9:]), flush=True)
        with open(out_dir / "profile_step.txt", "a") as f:
            f.write(f"\n===== {label}\n{profile_step(engine, device)}")
    engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_generation(model_dir: Path, device: torch.device, tiny: bool) -> str:
    """CPU-side top operators of 8 decode steps: the server's loop vs ``model.generate``."""
    from torch.profiler import ProfilerActivity, profile

    from arctic_rl.protocol import GenerateRequest, JobConfig, JobType, SamplingParams
    from arctic_rl.server.engines.sampling import SamplingEngine
    from arctic_rl.server.settings import ServerSettings

    eng = SamplingEngine(JobConfig(model_name=str(model_dir), job_type=JobType.SAMPLING), ServerSettings(device=device.type))
    n, plen = (8, 16) if tiny else (64, 256)
    prompts = torch.randint(2, eng.vocab_size, (n, plen), generator=torch.Generator().manual_seed(4))
    eng.batch_size = n
    req, params = GenerateRequest(prompts=prompts.tolist()), SamplingParams(max_tokens=8, ignore_eos=True, seed=0)
    eng.generate(req, params)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    text = ""
    ids = prompts.to(device)
    for label, fn in (("server SamplingEngine.generate, 8 new tokens", lambda: eng.generate(req, params)),
                      ("model.generate, 8 new tokens", lambda: eng.model.generate(
                          ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=True,
                          top_k=0, pad_token_id=0))):
        with torch.no_grad(), profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            sync(device)
            wall = time.perf_counter() - t0
        text += f"\n===== {label}: {wall * 1e3:.1f} ms under the profiler\n"
        text += prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    eng.close()
    return text


# ----------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and shapes (CPU dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_throughput", help="output folder ($OUT on the device)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip remaining work after this many seconds")
    ap.add_argument("--max-tokens", type=int, default=128, help="sampled tokens per prompt in the generation test")
    ap.add_argument("--gen-batches", default="32,64", help="SamplingEngine batch sizes to time")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--plans", default="shipped", help=f"comma-separated, from {list(PLANS)}")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: train,generate")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("profile_*.txt"):
        old.unlink()
    skip = set(filter(None, args.skip.split(",")))
    results: dict[str, Any] = {"args": vars(args), "env": environment(device)}

    def save() -> None:
        (out_dir / "gpu_results.json").write_text(json.dumps(results, indent=1, default=str))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    peak = matmul_peak(device, args.tiny)
    results["peak_flops"] = peak
    head = [(f"# {results['env'].get('gpu', 'cpu')}  torch {torch.__version__}  transformers "
            f"{results['env']['transformers']}  deepspeed {results['env']['deepspeed']}"),
            f"# dense matmul peak (measured here, now): {peak / 1e12:.2f} TFLOP/s"]
    print("\n".join(head), flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_tp_"))
    lines: list[str] = head[:]
    try:
        t0 = time.perf_counter()
        model_dir = build_model_dir(work / "model", TINY if args.tiny else QWEN3_06B, device)
        results["build_model_s"] = time.perf_counter() - t0
        if "train" not in skip:
            for label in args.plans.split(","):
                kwargs, names = PLANS[label]
                if left() < 60:
                    print(f"# budget: skipping plan {label}", flush=True)
                    continue
                try:
                    run_plan(label, kwargs, names, model_dir=model_dir, device=device, work=work, args=args,
                             peak=peak, results=results, lines=lines, left=left, out_dir=out_dir)
                except Exception as exc:  # noqa: BLE001 - recorded; the next plan still runs
                    results.setdefault("plan_errors", {})[label] = repr(exc)[:500]
                    lines.append(f"== {label}: FAILED {exc!r}"[:300])
                    print(lines[-1], flush=True)
                save()
            d = results.get("dims", {})
            lines.append(f"model: {d.get('n_params', 0) / 1e6:.1f}M params ({d.get('n_layer_params', 0) / 1e6:.1f}M in "
                         f"decoder layers), vocab {d.get('vocab')}, attn={results.get('attn_implementation')}")
        if "generate" not in skip:
            if left() < 60 + (0 if args.tiny else args.max_tokens * 0.25):
                print("# budget: skipping generation", flush=True)
            else:
                gen = generation(model_dir, device, args.tiny, args.max_tokens,
                                 [int(b) for b in args.gen_batches.split(",") if b])
                results["generate"] = gen
                lines += ["", (f"{'generation, ' + gen[0]['shape']:46} {'batch':>5} {'tokens':>7} {'s':>7} "
                              f"{'tok/s':>8} {'ms/step':>8}")]
                lines += [f"{g['what']:46} {g['batch']:>5} {g['tokens']:>7} {g['s']:>7.2f} {g['tok_s']:>8.0f} "
                          f"{g['ms_per_step']:>8.1f}" for g in gen]
                print("\n".join(lines[-len(gen) - 1:]), flush=True)
                if not args.no_profile and left() > 30:
                    (out_dir / "profile_generate.txt").write_text(profile_generation(model_dir, device, args.tiny))
    finally:
        results.pop("_printed", None)
        results["elapsed_s"] = time.perf_counter() - start
        save()
        (out_dir / "gpu_tables.txt").write_text("\n".join(lines) + f"\nelapsed {results['elapsed_s']:.0f}s\n")
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
