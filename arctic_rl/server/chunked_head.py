"""The LM head run chunk by chunk on hidden states: per-token values without the whole logits.

A causal LM's logits at ``N`` positions are ``[N, V]``: with Qwen3's 151,936-token vocabulary, 32K
response tokens are 9.3 GiB in bf16 (and twice that in fp32). :func:`head_stats` computes the
log-prob of the targets and the entropy from the ``[N, H]`` hidden states instead, running the LM
head over ``chunk_bytes`` worth of fp32 logits at a time; with gradients, each chunk runs under
``torch.utils.checkpoint``, so its logits are recomputed in the backward (one more LM-head matmul per
chunk) instead of being kept from the forward. The LM head is called as a module each time, so
DeepSpeed's ZeRO-3 hooks gather its weight as for any forward.

To get hidden states out of a Hugging Face causal LM without touching its code,
:func:`hidden_states_out` swaps its ``lm_head`` for an identity while the model runs (the forward
then returns ``lm_head``'s input at the kept positions as ``logits``). That is exact only where the
logits are the plain ``lm_head`` projection -- :func:`chunked_head_supported` lists those
architectures and refuses configs that soft-cap or scale the logits; the caller keeps the whole
logits for anything else.

What is not here: the log-softmax math (:mod:`arctic_rl.server.logprobs`), choosing when to chunk
(the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from arctic_rl.server import memory
from arctic_rl.server.zorro_attention import unwrap_model

__all__ = ["chunked_head_supported", "head_stats", "hidden_states_out", "logits_bytes"]

#: ``model_type``s whose causal-LM forward is ``lm_head(hidden_states[:, kept positions])`` and nothing more
_PLAIN_HEAD_MODELS = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo", "olmo2", "phi3", "smollm3",
})  # fmt: skip
#: config fields that post-process the logits (soft-capping, scaling): such a head is not a plain projection
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

TokenStats = Callable[[torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, "torch.Tensor | None"]]


def chunked_head_supported(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LM head may run chunk by chunk on its hidden states: a listed architecture (its
    logits are the ``lm_head`` projection of the last hidden states, nothing after it) whose config adds no
    soft-capping or scaling."""
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEAD_MODELS:
        return False
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_POSTPROCESSING):
        return False
    return isinstance(getattr(inner, "lm_head", None), torch.nn.Linear)


def _vocab(head: torch.nn.Module) -> int:
    return int(getattr(head, "out_features", 0) or 0)


def logits_bytes(model: torch.nn.Module, positions: int) -> int:
    """fp32 bytes of ``model``'s logits at ``positions`` positions (0 when its vocabulary is unknown)."""
    inner = unwrap_model(model)
    vocab = _vocab(getattr(inner, "lm_head", None)) or int(getattr(getattr(inner, "config", None), "vocab_size", 0))
    return int(positions) * vocab * 4


@contextmanager
def hidden_states_out(model: torch.nn.Module, enabled: bool) -> Iterator[torch.nn.Module | None]:
    """While the block runs, ``model``'s forward returns the hidden states at the kept positions as its
    ``logits`` (its LM head is an identity); yields the real LM head, or ``None`` when not ``enabled``."""
    if not enabled:
        yield None
        return
    inner = unwrap_model(model)
    head = inner.lm_head
    inner.lm_head = torch.nn.Identity()
    try:
        yield head
    finally:
        inner.lm_head = head


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
           want_entropy: bool, token_stats: TokenStats) -> tuple[torch.Tensor, torch.Tensor | None]:
    lp, entropy = token_stats(head(hidden).unsqueeze(0), targets.unsqueeze(0), temperature, want_entropy)
    return lp[0], (entropy[0] if entropy is not None else None)


def head_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    *,
    token_stats: TokenStats,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_stats(head(hidden), targets, ...)`` for ``hidden`` ``[N, K, H]`` and ``targets`` ``[N, K]``,
    one chunk of positions at a time (each chunk's fp32 logits within ``chunk_bytes``)."""
    n, k, width = hidden.shape
    if n == 0 or k == 0:
        empty = hidden.new_zeros((n, k), dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, (empty if want_entropy else None)
    step = max(1, int(chunk_bytes) // max(1, _vocab(head) * 4))
    memory.note_buffer("hidden_states", hidden.numel() * hidden.element_size())
    flat_hidden, flat_targets = hidden.reshape(n * k, width), targets.reshape(n * k).long()
    grad = torch.is_grad_enabled() and flat_hidden.requires_grad
    lps, ents = [], []
    for chunk, chunk_targets in zip(flat_hidden.split(step), flat_targets.split(step), strict=True):
        args = (head, chunk, chunk_targets, float(temperature), bool(want_entropy), token_stats)
        lp, entropy = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        lps.append(lp)
        if want_entropy:
            ents.append(entropy)
    lp = torch.cat(lps).reshape(n, k)
    return lp, (torch.cat(ents).reshape(n, k) if want_entropy else None)
