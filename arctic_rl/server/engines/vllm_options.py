"""The vLLM sampler's options: the job's ``vllm_config`` checked key by key, and the per-prompt seeds of a call.

Plain Python (no vLLM import): :func:`engine_options` turns ``vllm_config`` into ``vllm.LLM`` keyword arguments
(400 naming a bad key or value), :func:`prompt_seeds` gives each prompt of a seeded call its own vLLM seed.
"""

from __future__ import annotations

import logging
from typing import Any

from arctic_rl.server.errors import BadRequest

__all__ = ["DEFAULT_GPU_MEMORY_UTILIZATION", "MAX_LOGPROBS", "VLLM_OPTIONS", "engine_options", "prompt_seeds"]

logger = logging.getLogger("arctic_rl.server")

#: vLLM's share of the GPU when the job does not say (the rest is left to training and log-probs)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.4
#: the most top tokens per generated token a request may ask for (``sampling_params.logprobs``)
MAX_LOGPROBS = 20
#: ``vllm_config`` keys passed to ``vllm.LLM`` and their types
VLLM_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "gpu_memory_utilization": (float, int),
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "enforce_eager": bool,
    "enable_chunked_prefill": bool,
    "enable_prefix_caching": bool,
    "quantization": str,
    "kv_cache_dtype": str,
    # a fixed KV-cache size instead of the share left after vLLM's memory profiling: several engines can then
    # start side by side on one GPU (profiling assumes no other process frees memory meanwhile)
    "kv_cache_memory_bytes": int,
}
#: ``vllm_config`` keys that are accepted and not used (one GPU, one engine)
_IGNORED_OPTIONS = ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size")


def engine_options(vllm_config: dict[str, Any] | None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from a job's ``vllm_config`` (400 naming a bad key or value)."""
    options: dict[str, Any] = {"gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION}
    for key, value in (vllm_config or {}).items():
        field = f"vllm_config.{key}"
        if key in _IGNORED_OPTIONS:
            if value not in (None, 1):
                raise BadRequest(f"{field}: this server runs one vLLM engine on one GPU", field=field,
                                 allowed=[1], received=value)
            continue
        if key not in VLLM_OPTIONS:
            logger.info("vllm_config.%s is not used by this server's vLLM engine", key)
            continue
        if value is None:
            continue
        kind = VLLM_OPTIONS[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise BadRequest(f"{field}: wrong type", field=field, allowed=str(kind), received=value)
        options[key] = value
    share = options["gpu_memory_utilization"]
    if not 0 < share <= 1:
        raise BadRequest("vllm_config.gpu_memory_utilization: the share of GPU memory vLLM may take",
                         field="vllm_config.gpu_memory_utilization", allowed="(0, 1]", received=share)
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
        if key in options and options[key] < 1:
            raise BadRequest(f"vllm_config.{key}: must be positive", field=f"vllm_config.{key}", allowed=">= 1",
                             received=options[key])
    return options


def prompt_seeds(seed: int | None, n_prompts: int, n: int) -> list[int | None]:
    """vLLM seeds for the prompts of one ``/generate`` call.

    A seed in vLLM is per request: two requests with the same prompt and the same seed sample the same
    tokens. A call carries many prompts -- verl's ``n`` samples of a prompt usually arrive as ``n`` copies
    of it, batched into one call by the rollout server -- so one seed for the whole call would make every
    copy identical and every GRPO group's advantages zero. Without a seed each prompt draws from the
    engine's generator (the samples of a group differ, as in stock verl); with one, prompt ``i`` gets
    ``seed + i * n`` (vLLM gives its sample ``j`` that plus ``j``), so the call is reproducible and no two
    samples share a seed.
    """
    if seed is None:
        return [None] * n_prompts
    return [(int(seed) + i * n) % (2**62) for i in range(n_prompts)]
