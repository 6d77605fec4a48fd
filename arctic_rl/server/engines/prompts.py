"""A ``/generate`` call checked against a sampler's model: prompt token ids, the context, stop ids.

Both samplers (:mod:`.sampling`, :mod:`.vllm_sampler`) take prompts as text or token ids; each failure is a
400 naming its field (``prompts.<i>``, ``sampling_params.max_tokens``, ``sampling_params.stop_token_ids``).
"""

from __future__ import annotations

from typing import Any

from arctic_rl.protocol import SamplingParams
from arctic_rl.server.errors import BadRequest

__all__ = ["check_context", "prompt_token_ids", "stop_token_ids"]


def prompt_token_ids(tokenizer: Any, prompts: list, vocab_size: int) -> list[list[int]]:
    """Each prompt as token ids: a text tokenized, a list of ids checked to lie in ``[0, vocab_size)``."""
    ids: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            tokens = list(tokenizer(prompt)["input_ids"])
        else:
            tokens = [int(t) for t in prompt]
            bad = [t for t in tokens if t < 0 or t >= vocab_size]
            if bad:
                raise BadRequest(f"prompts[{i}]: token ids must lie in [0, {vocab_size})",
                                 field=f"prompts.{i}", allowed=f"[0, {vocab_size})", received=bad[0])
        if not tokens:
            raise BadRequest(f"prompts[{i}]: empty prompt", field=f"prompts.{i}", received=prompt)
        ids.append(tokens)
    return ids


def check_context(prompts: list[list[int]], params: SamplingParams, limit: int, what: str) -> None:
    """A 400 unless the longest prompt plus ``max_tokens`` fits in ``limit`` tokens (``what`` names the limit:
    "the model's context", "the engine's max_model_len"); ``limit=0`` means not known (no check)."""
    longest = max(len(p) for p in prompts)
    if limit and longest + params.max_tokens > limit:
        raise BadRequest(
            f"sampling_params.max_tokens: prompt length {longest} + max_tokens {params.max_tokens} exceeds "
            f"{what} of {limit}",
            field="sampling_params.max_tokens",
            allowed=max(1, limit - longest),
            received=params.max_tokens,
        )


def stop_token_ids(params: SamplingParams, vocab_size: int, eos_ids: set[int]) -> set[int]:
    """The ids that end a row: ``stop_token_ids`` (checked to lie in ``[0, vocab_size)``) and, unless
    ``ignore_eos``, the model's EOS ids."""
    bad = [t for t in params.stop_token_ids or [] if t < 0 or t >= vocab_size]
    if bad:
        raise BadRequest(f"sampling_params.stop_token_ids: ids must lie in [0, {vocab_size})",
                         field="sampling_params.stop_token_ids", received=bad[0])
    stop_ids = set(params.stop_token_ids or [])
    return stop_ids if params.ignore_eos else stop_ids | eos_ids
