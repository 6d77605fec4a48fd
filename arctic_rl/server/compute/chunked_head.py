"""The LM head run chunk by chunk on hidden states: per-token values without the whole logits.

A causal LM's logits at ``N`` positions are ``[N, V]``: with Qwen3's 151,936-token vocabulary, 32K
response tokens are 9.3 GiB in bf16 (and twice that in fp32). :func:`head_stats` computes the
log-prob of the targets and the entropy from the ``[N, H]`` hidden states instead, running the LM
head over ``chunk_bytes`` worth of fp32 logits at a time; in the backward each chunk's logits are
recomputed from the hidden states (one more LM-head matmul per chunk) instead of being kept from the
forward. A plain bias-free ``Linear`` head runs in one autograd function that keeps only the hidden
states and two numbers per position; a ZeRO-3-partitioned head is called as a module under
``torch.utils.checkpoint`` instead, so DeepSpeed's hooks gather its weight for each chunk. On one H200
(bf16, Qwen3's 151,936-token vocabulary, 16 x 1024 response tokens, 2 layers of width 1024 so that the
head dominates) the checkpointed form cut the pass's peak from 16.6 to 4.6 GiB, at 207 ms against 139 ms
for forward+backward.

To get hidden states out of a Hugging Face causal LM without touching its code,
:func:`hidden_states_out` swaps its ``lm_head`` for an identity while the model runs (the forward
then returns ``lm_head``'s input at the kept positions as ``logits``). That is exact only where the
logits are the plain ``lm_head`` projection -- :func:`chunked_head_supported` lists those
architectures and refuses configs that soft-cap or scale the logits; the caller keeps the whole
logits for anything else.

What is not here: the log-softmax math (:mod:`arctic_rl.server.compute.token_logprobs`), choosing when to chunk
(the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from arctic_rl.server import memory
from arctic_rl.server.zorro.attention import unwrap_model

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


class _LinearHeadStats(torch.autograd.Function):
    """Log-prob and entropy of ``softmax(hidden @ weight.T / T)``, chunk by chunk, for a plain ``weight``.

    The forward keeps the hidden states, the weight and two numbers per position (log-sum-exp, entropy); the
    backward recomputes each chunk's logits (one matmul) and runs the log-softmax gradient
    (``chunk_grad``) and the two matmuls of the LM head's backward on it -- one matmul more than keeping the
    logits, nothing of the log-softmax forward again (which :func:`torch.utils.checkpoint` would redo)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, want_entropy: bool, step: int, fns: dict):
        lps, lses, ents = [], [], []
        for chunk, chunk_targets in zip(hidden.split(step), targets.split(step), strict=True):
            logits = torch.nn.functional.linear(chunk, weight)
            memory.note_buffer("logits", logits.numel() * logits.element_size())
            lp, lse, entropy = fns["stats"](logits, chunk_targets, temperature, want_entropy)
            lps.append(lp)
            lses.append(lse)
            ents.append(entropy if want_entropy else torch.zeros_like(lse))
        lp, entropy = torch.cat(lps), torch.cat(ents)
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lses), entropy)
        ctx.temperature, ctx.want_entropy, ctx.step, ctx.fns = temperature, want_entropy, step, fns
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        step, temperature = ctx.step, ctx.temperature
        if grad_lp is None:
            grad_lp = torch.zeros_like(lse)
        use_entropy = ctx.want_entropy and grad_entropy is not None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            chunk = hidden[rows]
            logits = torch.nn.functional.linear(chunk, weight)
            g_ent = grad_entropy[rows] if use_entropy else None
            grad_z = ctx.fns["grad"](logits, targets[rows], lse[rows], entropy[rows], grad_lp[rows], g_ent,
                                     temperature)
            if grad_hidden is not None:
                torch.mm(grad_z, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(grad_z.t(), chunk)
        return grad_hidden, grad_weight, None, None, None, None, None


def _plain_linear(head: torch.nn.Module) -> bool:
    """A ``Linear`` without bias whose weight is a whole tensor (not a ZeRO-3 partition, which only the
    module's own forward hooks gather)."""
    weight = getattr(head, "weight", None)
    return (isinstance(head, torch.nn.Linear) and head.bias is None and isinstance(weight, torch.Tensor)
            and not hasattr(weight, "ds_id") and weight.dim() == 2)


def head_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    *,
    token_stats: TokenStats,
    chunk_bytes: int,
    chunk_fns: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_stats(head(hidden), targets, ...)`` for ``hidden`` ``[N, K, H]`` and ``targets`` ``[N, K]``,
    one chunk of positions at a time (each chunk's fp32 logits within ``chunk_bytes``). A plain linear head
    with ``chunk_fns`` (the log-softmax chunk and its gradient) runs :class:`_LinearHeadStats`; any other
    head (a ZeRO-3 partition, a bias) is called as a module under ``torch.utils.checkpoint``."""
    n, k, width = hidden.shape
    if n == 0 or k == 0:
        empty = hidden.new_zeros((n, k), dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, (empty if want_entropy else None)
    step = max(1, int(chunk_bytes) // max(1, _vocab(head) * 4))
    memory.note_buffer("hidden_states", hidden.numel() * hidden.element_size())
    memory.note_buffer("logits_fp32_chunk", min(step, n * k) * _vocab(head) * 4)
    flat_hidden, flat_targets = hidden.reshape(n * k, width), targets.reshape(n * k).long()
    if chunk_fns is not None and _plain_linear(head):
        lp, entropy = _LinearHeadStats.apply(flat_hidden, head.weight, flat_targets, float(temperature),
                                             bool(want_entropy), step, chunk_fns)
        return lp.reshape(n, k), (entropy.reshape(n, k) if want_entropy else None)
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
