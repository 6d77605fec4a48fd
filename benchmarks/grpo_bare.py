"""The bare components of a GRPO step, for ``gpu_grpo_loop.py``: no server, no HTTP, no adapter.

* ``generate``: ``vllm.LLM.generate`` in this process on the loop's prompts with the loop's sampling
  parameters (``n`` samples, ``ignore_eos``, same ``max_tokens``), the engine built with the options
  the server's sampling job gets (``skip_tokenizer_init``, sleep mode, ``processed_logprobs``, the
  benchmark's ``vllm_config`` and ``max_model_len`` = prompt + response). On a CPU (``--cpu-smoke``)
  ``transformers``' ``generate`` stands in, so the script can be checked without vLLM.
* ``forward`` and ``fwd_bwd_step``: one DeepSpeed engine with the DeepSpeed config the adapter sends
  for the loop's training job, passed through the server's own ``build_training_ds_config`` (ZeRO-1 +
  bf16 on CUDA, ``torch.optim.AdamW``), decoder layers compiled as the server compiles them on CUDA,
  ``sdpa`` attention. The batch is the loop's rows (prompt + response, full length): ``forward`` =
  the response tokens' log-probs of all rows under ``no_grad`` in micro-batches (the old log-prob
  pass), ``fwd_bwd_step`` = the micro-batches' forward + backward of a clipped-ratio policy loss
  (log-softmax of fp32 logits, token mean) then one optimizer step.

Each component: one untimed call (engine warm-up, compilation), then ``--bare-repeats`` timed calls;
the median is reported.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_bare"]


def _median_time(fn, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"s": statistics.median(times), "times_s": times, "first_s": first}


def bare_generate(args: Any, model: Path, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
    """Median seconds of generating ``n`` samples of each prompt, bare."""
    if args.cpu_smoke:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        ids = torch.tensor(prompts)

        def gen():
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                            max_new_tokens=params["max_tokens"], min_new_tokens=params["max_tokens"],
                            num_return_sequences=params["n"], pad_token_id=0)

        res = _median_time(gen, args.bare_repeats)
        res["engine"] = "transformers generate (cpu smoke stand-in)"
        return res

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from arctic_rl.server.engines.vllm_sampler import MAX_LOGPROBS

    t0 = time.perf_counter()
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_sleep_mode=True,
              logprobs_mode="processed_logprobs", max_logprobs=MAX_LOGPROBS,
              max_model_len=args.prompt_len + args.response_len, **args.vllm_config)
    init_s = time.perf_counter() - t0
    # the loop's client sends no seed either (the server then draws one per request)
    sp = SamplingParams(n=params["n"], max_tokens=params["max_tokens"], temperature=params["temperature"],
                        ignore_eos=params["ignore_eos"], seed=params.get("seed"), detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    tokens = []

    def gen():
        out = llm.generate(batch, sp, use_tqdm=False)
        tokens.append(sum(len(c.token_ids) for o in out for c in o.outputs))

    try:
        res = _median_time(gen, args.bare_repeats)
    finally:
        llm.llm_engine.engine_core.shutdown()
        llm = None  # free the engine before DeepSpeed starts
        gc.collect()
        torch.cuda.empty_cache()
    res.update(engine="vllm.LLM.generate", init_s=init_s, tokens=tokens[-1])
    return res


def _rows(args: Any, prompts: list[list[int]]) -> tuple[torch.Tensor, int]:
    rng = random.Random(1)
    rows = [p + [rng.randrange(3, 99) for _ in range(args.response_len)] for p in prompts for _ in range(args.n)]
    return torch.tensor(rows), args.prompt_len


def _response_logprobs(model: torch.nn.Module, ids: torch.Tensor, p0: int) -> torch.Tensor:
    """log p(response token | prefix) of each row, fp32, ``[rows, response_len]``."""
    logits = model(input_ids=ids, use_cache=False).logits[:, p0 - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, p0:, None]).squeeze(-1)


def bare_train(args: Any, model_dir: Path, prompts: list[list[int]], loop_config: Any) -> dict[str, Any]:
    """Median seconds of the bare old-log-prob forward and of the bare forward-backward + optimizer step."""
    from arctic_rl.server.engines.common import compile_model, ensure_process_group, load_model
    from arctic_rl.server.engines.config import build_training_ds_config
    from arctic_rl.server.engines.training import _import_deepspeed
    from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
    from verl.workers.remote_client.arctic.builders import build_ds_config
    from verl.workers.remote_client.common.verl_settings import VerlSettings

    device = torch.device("cuda", torch.cuda.current_device()) if not args.cpu_smoke else torch.device("cpu")
    client_ds = build_ds_config(VerlSettings.from_main_config(loop_config), ArcticConfig.from_main_config(loop_config))
    ds_config, _ = build_training_ds_config(client_ds, device=device.type, bf16_supported=device.type == "cuda")
    deepspeed = _import_deepspeed(device)
    ensure_process_group(device)
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
    model = load_model(str(model_dir), device=device, dtype=dtype, attn_implementation="sdpa")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=ds_config)
    if device.type == "cuda":
        compile_model(engine.module, "layers")
    ids, p0 = _rows(args, prompts)
    ids = ids.to(device)
    micro = args.micro
    chunks = list(torch.split(ids, micro))
    adv = torch.randn(ids.shape[0], 1, device=device)

    def forward():
        engine.eval()
        with torch.no_grad():
            for c in chunks:
                _response_logprobs(engine.module, c, p0)
        engine.train()

    def fwd_bwd_step():
        for i, c in enumerate(chunks):
            lp = _response_logprobs(engine.module, c, p0)
            ratio = torch.exp(lp - lp.detach())
            a = adv[i * micro:(i + 1) * micro]
            loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a).mean()
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the gradient-accumulation boundary
        if device.type == "cuda":
            torch.cuda.synchronize()

    if ds_config["gradient_accumulation_steps"] != len(chunks):
        raise ValueError(f"the adapter's DeepSpeed config accumulates {ds_config['gradient_accumulation_steps']} "
                         f"micro-batches, the bare batch has {len(chunks)}")
    res = {"forward": _median_time(forward, args.bare_repeats), "fwd_bwd_step": _median_time(fwd_bwd_step,
                                                                                             args.bare_repeats)}
    res["ds_config"] = {k: ds_config[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                  "bf16", "zero_optimization") if k in ds_config}
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def run_bare(args: Any, model: Path, prompts: list[list[int]], params: dict[str, Any], loop_config: Any) -> dict:
    """Both bare components, generation first (its engine is shut down before DeepSpeed starts)."""
    out: dict[str, Any] = {"generate": bare_generate(args, model, prompts, params)}
    print(f"# bare generate: {out['generate']['s']:.2f}s", flush=True)
    out.update(bare_train(args, model, prompts, loop_config))
    print(f"# bare forward {out['forward']['s']:.2f}s, fwd-bwd + step {out['fwd_bwd_step']['s']:.2f}s", flush=True)
    return out
