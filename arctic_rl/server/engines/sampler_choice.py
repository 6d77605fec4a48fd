"""Which sampling engine a server runs: ``--sampler auto|vllm|transformers``.

* ``transformers``: :class:`~.sampling.SamplingEngine` (any device; on CUDA its fast path of
  :mod:`.fast_generation`).
* ``vllm``: :class:`~.vllm_sampler.VllmSamplingEngine`, vLLM's engine inside the server process.
  It needs ``--device cuda``, a visible CUDA device and an importable ``vllm``; where one is
  missing the server refuses to start (:class:`SamplerUnavailable` names it).
* ``auto`` (the default): ``vllm`` when all three are there, else ``transformers``; the choice
  and the reason are logged.

The choice is made once per process (importing vLLM takes seconds) and cached.
"""

from __future__ import annotations

import functools
import logging

from arctic_rl.server.settings import SAMPLERS

__all__ = ["SAMPLERS", "SamplerUnavailable", "resolve_sampler", "vllm_missing"]

logger = logging.getLogger("arctic_rl.server")


class SamplerUnavailable(RuntimeError):
    """``--sampler vllm`` where vLLM cannot run; the message names what is missing."""


def vllm_missing(device: str) -> str | None:
    """``None`` when the vLLM engine can run on ``device``, else a sentence naming what is missing."""
    if device != "cuda":
        return f"--device cuda (vLLM runs on a CUDA device; this server computes on {device!r})"
    import torch

    if not torch.cuda.is_available():
        return "a visible CUDA device (torch.cuda.is_available() is False)"
    try:
        import vllm  # noqa: F401 - only whether it imports
    except Exception as exc:  # noqa: BLE001 - a broken install is as missing as an absent one
        return f"the vllm package (import vllm failed: {type(exc).__name__}: {exc})"
    return None


@functools.cache
def resolve_sampler(requested: str, device: str) -> str:
    """``"vllm"`` or ``"transformers"`` for ``--sampler requested`` on ``device`` (see the module docstring)."""
    if requested not in SAMPLERS:
        raise ValueError(f"sampler: expected one of {list(SAMPLERS)}, got {requested!r}")
    if requested == "transformers":
        return "transformers"
    missing = vllm_missing(device)
    if requested == "vllm":
        if missing is not None:
            raise SamplerUnavailable(f"--sampler vllm: this server cannot run vLLM; it needs {missing}")
        logger.info("sampler: vllm (asked for)")
        return "vllm"
    if missing is None:
        logger.info("sampler: auto chose vllm (CUDA device and vllm are available)")
        return "vllm"
    logger.info("sampler: auto chose transformers; vLLM would need %s", missing)
    return "transformers"
