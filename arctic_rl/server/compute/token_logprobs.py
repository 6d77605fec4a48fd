"""Per-token log-probs (and entropy) of a forward/backward batch, plain or with ZoRRO.

A batch is dense ``[B, P+R]``: ``[left-padded prompt (width P) | right-padded response (width R)]``.
:func:`response_logprobs` returns *response-aligned* values ``[B, R]`` (``lp[:, j] =
log p(responses[:, j] | prompt, responses[:, :j])``) of the temperature-scaled distribution, either
from the plain ``[B, P+R]`` pass or from ZoRRO's shared-prompt pass (:mod:`arctic_rl.server.zorro.forward`);
both agree to float precision. :func:`shifted_logprobs` gives the protocol's *shifted* ``[B, P+R]``
layout of a plain pass and :func:`to_shifted` moves response-aligned values into it.

Memory: the LM head runs only at the positions whose logits are needed (``R`` per row, or one per
unique prompt plus ``R-1`` per row with ZoRRO), and the fp32 log-softmax is computed a few rows at
a time, forward and backward, by a small autograd function that keeps no fp32 copy of the logits
for the backward (it recomputes the softmax there). Where those logits would take more than one
chunk (``_HEAD_CHUNK_BYTES`` in fp32) and the model's LM head is a plain projection of its last
hidden states (:func:`chunked_head_supported`), the model returns its hidden states instead (its LM
head is swapped for an identity while it runs) and the head runs chunk by chunk: never the whole
``[positions, V]`` logits at once, and in the backward each chunk's logits are recomputed from the
hidden states (one more LM-head matmul per chunk) instead of being kept from the forward. Values
and gradients equal the unchunked computation's to float precision. Everything is differentiable
when grad is enabled and works under ``torch.no_grad()``. The largest logits buffer of a pass is
reported to :mod:`arctic_rl.server.memory`.

What is not here: losses (:mod:`arctic_rl.server.compute.losses`), HTTP or engines.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from arctic_rl.server import memory
from arctic_rl.server.compute.chunked_head import chunked_head_supported, head_stats, hidden_states_out, logits_bytes
from arctic_rl.server.zorro.forward import causal_lm_logits, zorro_forward, zorro_unsupported_reason

__all__ = [
    "TokenLogprobs",
    "chunked_head_supported",
    "compile_chunk_fn",
    "compiled_token_stats_on",
    "head_chunk_budget",
    "response_logprobs",
    "set_compiled_token_stats",
    "shifted_logprobs",
    "to_shifted",
]

logger = logging.getLogger(__name__)

#: fp32 bytes of logits upcast at once when turning logits into log-probs (per chunk of rows)
_FP32_CHUNK_BYTES = 256 * 1024 * 1024
#: fp32 bytes of the logits one chunk of the LM head computes on hidden states (and the logits above which the
#: head runs chunk by chunk: :mod:`arctic_rl.server.compute.chunked_head`)
_HEAD_CHUNK_BYTES = 256 * 1024 * 1024


@dataclass
class TokenLogprobs:
    """Response-aligned per-token values of a batch (see the module docstring)."""

    logprobs: torch.Tensor  # [B, R] fp32 (fp64 for an fp64 model)
    entropy: torch.Tensor | None  # [B, R] likewise, entropy of the temperature-scaled distribution
    tokens_computed: int  # tokens pushed through the model (ZoRRO: U*P + B*R; plain: B*(P+R))
    unique_prompts: int  # U (== B for the plain path)

    def row_range(self, start: int, stop: int) -> TokenLogprobs:
        """Rows ``[start, stop)`` of the per-token values (a loss over part of a pass); the pass's
        ``tokens_computed`` and ``unique_prompts`` are not split and stay the whole pass's."""
        entropy = self.entropy[start:stop] if self.entropy is not None else None
        return TokenLogprobs(self.logprobs[start:stop], entropy, self.tokens_computed, self.unique_prompts)


def _check_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, temperature: float
) -> None:
    if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"input_ids: expected a 2-D int64/int32 [B, T] tensor, got shape {tuple(input_ids.shape)} "
            f"dtype {input_ids.dtype}"
        )
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if tuple(t.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"{name}: expected shape {tuple(input_ids.shape)} (that of input_ids), got {tuple(t.shape)}"
            )
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature: expected a value > 0, got {temperature!r}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 logits."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(chunk: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool):
    """Log-prob of ``targets``, log-sum-exp and (optionally) entropy of ``softmax(chunk / T)`` for a row chunk."""
    z = chunk.to(_compute_dtype(chunk.dtype))
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if want_entropy else None
    return lp, lse, entropy


def _chunk_grad(chunk, targets, lse, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """Gradient of a row chunk's logits (in their dtype) from those of its log-probs and entropy."""
    z = chunk.to(_compute_dtype(chunk.dtype))
    if temperature != 1.0:
        z = z / temperature
    logp = z - lse.unsqueeze(-1)
    probs = logp.exp()
    grad_z = probs * (-g_lp.unsqueeze(-1))
    if g_ent is not None:
        grad_z -= probs * (logp + entropy.unsqueeze(-1)) * g_ent.unsqueeze(-1)
    grad_z.scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1))
    if temperature != 1.0:
        grad_z /= temperature
    return grad_z.to(chunk.dtype)


#: the chunk functions _TokenStats runs: eager, or compiled (set_compiled_token_stats)
_CHUNK_FNS = {"stats": _chunk_stats, "grad": _chunk_grad}
_COMPILED_CHUNK_FNS: dict = {}


def set_compiled_token_stats(enabled: bool) -> None:
    """Run the log-prob / entropy chunk math through ``torch.compile`` (process-wide) or eagerly.

    Compiled, each chunk's cast, temperature, log-sum-exp, gather and entropy -- and in the backward
    the softmax gradient -- become a few fused kernels instead of about ten passes over fp32
    ``[rows, V]`` tensors. The reference server turns this on with its compiled training model
    (``--torch-compile`` resolving to ``layers`` or ``modules``).
    """
    if enabled:
        if not _COMPILED_CHUNK_FNS:  # one compiled wrapper per process, however many engines ask
            _COMPILED_CHUNK_FNS.update(stats=compile_chunk_fn(_chunk_stats), grad=compile_chunk_fn(_chunk_grad))
        _CHUNK_FNS.update(_COMPILED_CHUNK_FNS)
    else:
        _CHUNK_FNS.update(stats=_chunk_stats, grad=_chunk_grad)


def compile_chunk_fn(fn: Callable, **compile_kwargs: Any) -> Callable:
    """``torch.compile(fn, dynamic=True)`` for the chunk functions, fed so that one graph serves every pass.

    A pass splits its logits (or hidden states) into chunks of rows: the chunk functions get views whose rows
    may equal those of the tensor they view (a pass of one chunk) or not (several chunks), and that require grad
    or not (``/forward-backward`` or ``/forward``). Dynamo guards on all of it: duck sizing gives equal sizes one
    symbol, a view's base is guarded, ``requires_grad`` is guarded -- each a recompile in verl's step 1 after the
    warm-up (on an H200, 14 s each for the first ``/forward`` and ``/forward-backward``). So the functions are
    traced without duck sizing and get detached aliases of their tensors (no copy: the same memory, no base, no
    grad; they run inside autograd Functions, which compute the gradients themselves)."""
    import torch.fx.experimental._config as fx_config

    compiled = torch.compile(fn, dynamic=True, **compile_kwargs)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        with fx_config.patch(use_duck_shape=False):
            return compiled(*plain)

    return call


@contextlib.contextmanager
def head_chunk_budget(nbytes: int) -> Iterator[None]:
    """Within: the fp32 logits bytes of one LM-head chunk, and the logits above which the head runs chunk by chunk
    (default ``_HEAD_CHUNK_BYTES``). The warm-up's way to run the chunked head -- the path of real passes whose
    logits exceed the default -- on a small batch (:mod:`arctic_rl.server.engines.warmup`). Process-wide: no other
    pass may run meanwhile."""
    global _HEAD_CHUNK_BYTES
    if int(nbytes) < 1:
        raise ValueError(f"nbytes: expected a byte count >= 1, got {nbytes!r}")
    saved, _HEAD_CHUNK_BYTES = _HEAD_CHUNK_BYTES, int(nbytes)
    try:
        yield
    finally:
        _HEAD_CHUNK_BYTES = saved


def compiled_token_stats_on() -> bool:
    """Whether the chunk math runs compiled in this process (:func:`set_compiled_token_stats`)."""
    return _CHUNK_FNS["stats"] is not _chunk_stats


class _TokenStats(torch.autograd.Function):
    """Log-prob of the targets and entropy of ``softmax(logits / T)``, fp32, row chunk by row chunk.

    Autograd would keep an fp32 copy of every logit for the backward; this saves only the logits
    as they are (the model's output, alive anyway) and two fp32 numbers per position, and
    recomputes the softmax chunk by chunk in the backward. Gradients, with ``z = logits / T``,
    ``p = softmax(z)``: ``d lp / d z = onehot(target) - p``; ``d H / d z = -p * (log p + H)``.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, want_entropy: bool, step: int):
        lps, lses, ents = [], [], []
        stats = _CHUNK_FNS["stats"]
        for chunk, chunk_targets in zip(logits.split(step), targets.split(step), strict=True):
            lp, lse, ent = stats(chunk, chunk_targets, temperature, want_entropy)
            lps.append(lp)
            lses.append(lse)
            if want_entropy:
                ents.append(ent)
        lp = torch.cat(lps)
        entropy = torch.cat(ents) if want_entropy else lp.new_zeros(lp.shape)
        ctx.save_for_backward(logits, targets, torch.cat(lses), entropy)
        ctx.temperature, ctx.want_entropy, ctx.step = temperature, want_entropy, step
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lp, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, step = ctx.temperature, ctx.step
        use_entropy = ctx.want_entropy and grad_entropy is not None
        if grad_lp is None:
            grad_lp = torch.zeros_like(lse)
        grad = _CHUNK_FNS["grad"]
        parts = zip(
            logits.split(step), targets.split(step), lse.split(step), entropy.split(step), grad_lp.split(step),
            grad_entropy.split(step) if use_entropy else [None] * len(lse.split(step)),
            strict=True,
        )  # fmt: skip
        grads = [
            grad(chunk, chunk_targets, chunk_lse, chunk_ent, g_lp, g_ent, temperature)
            for chunk, chunk_targets, chunk_lse, chunk_ent, g_lp, g_ent in parts
        ]
        return torch.cat(grads), None, None, None, None


def _token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and entropy under ``softmax(logits / temperature)``, in fp32.

    ``logits``: ``[N, K, V]`` (any float dtype), ``targets``: ``[N, K]``. No more than about
    ``_FP32_CHUNK_BYTES`` of fp32 logits exist at once, forward or backward.
    """
    n, k, v = logits.shape
    if n == 0 or k == 0:
        empty = logits.new_zeros((n, k), dtype=_compute_dtype(logits.dtype))
        return empty, (empty if want_entropy else None)
    step = max(1, _FP32_CHUNK_BYTES // max(1, k * v * 4))
    memory.note_buffer("logits", logits.numel() * logits.element_size())
    memory.note_buffer("logits_fp32_chunk", min(n, step) * k * v * 4)
    lp, entropy = _TokenStats.apply(logits, targets.long(), float(temperature), bool(want_entropy), step)
    return lp, (entropy if want_entropy else None)

def _chunked(model: torch.nn.Module, positions: int) -> bool:
    """The hidden-state path: where the ``positions`` logits would take more than one fp32 chunk."""
    return logits_bytes(model, positions) > _HEAD_CHUNK_BYTES and chunked_head_supported(model)


def _stats(head: torch.nn.Module | None, values: torch.Tensor, targets: torch.Tensor, temperature: float,
           want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token values from logits (``head`` is ``None``) or from hidden states and the LM head."""
    if head is None:
        return _token_stats(values, targets, temperature, want_entropy)
    return head_stats(head, values, targets, temperature, want_entropy, token_stats=_token_stats,
                      chunk_bytes=_HEAD_CHUNK_BYTES, chunk_fns=_CHUNK_FNS)


def _zorro_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    p: int,
    temperature: float,
    want_entropy: bool,
) -> TokenLogprobs:
    batch, total = input_ids.shape
    with hidden_states_out(model, _chunked(model, batch * (total - p))) as head:
        out = zorro_forward(model, input_ids, attention_mask, position_ids, p)
    targets = input_ids[:, p:]
    # the first response token: every row of a group shares the prompt's last-position logits
    # ([B, V] rows picked from [U, V]; the backward of index_select sums them per prompt)
    first_lp, first_ent = _stats(
        head, out.first_logits.index_select(0, out.row_to_group).unsqueeze(1), targets[:, :1], temperature,
        want_entropy,
    )
    rest_targets = targets[:, 1:]
    if out.rest_rows is not None:  # rest_logits' rows are sorted by prompt: reorder the targets, then the results
        rest_targets = rest_targets.index_select(0, out.rest_rows)
    rest_lp, rest_ent = _stats(head, out.rest_logits, rest_targets, temperature, want_entropy)
    if out.rest_rows is not None:
        inverse = torch.empty_like(out.rest_rows)
        inverse[out.rest_rows] = torch.arange(out.rest_rows.numel(), device=inverse.device)
        rest_lp = rest_lp.index_select(0, inverse)
        rest_ent = rest_ent.index_select(0, inverse) if want_entropy else None
    logprobs = torch.cat([first_lp, rest_lp], dim=1)
    entropy = torch.cat([first_ent, rest_ent], dim=1) if want_entropy else None
    return TokenLogprobs(logprobs, entropy, out.tokens_computed, int(out.unique_row_index.numel()))


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_len: int,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    zorro: bool = False,
) -> TokenLogprobs:
    """Response-aligned ``[B, R]`` log-probs (and entropy) of a ``[B, P+R]`` batch.

    ``zorro=True`` runs each unique prompt once (:func:`arctic_rl.server.zorro.forward.zorro_forward`).
    For a model that cannot take that path (gradient checkpointing while training, sliding-window
    or linear-attention caches) it logs a warning and runs the plain pass, which gives the same
    values; ``unique_prompts`` and ``tokens_computed`` then report the plain pass.
    """
    _check_inputs(input_ids, attention_mask, position_ids, temperature)
    p = int(prompt_len)
    batch, total = input_ids.shape
    if not 1 <= p < total:
        raise ValueError(f"prompt_len: expected 1 <= prompt_len < {total} (input_ids width), got {prompt_len}")
    targets = input_ids[:, p:]
    if zorro:
        reason = zorro_unsupported_reason(model)
        if reason is None:
            return _zorro_logprobs(model, input_ids, attention_mask, position_ids, p, temperature, calculate_entropy)
        logger.warning("ZoRRO requested but not possible (%s); running the plain forward", reason)
    with hidden_states_out(model, _chunked(model, batch * (total - p))) as head:
        values = causal_lm_logits(
            model, input_ids, attention_mask, position_ids, torch.arange(p - 1, total - 1, device=input_ids.device)
        )
    logprobs, entropy = _stats(head, values, targets, temperature, calculate_entropy)
    return TokenLogprobs(logprobs, entropy, batch * total, batch)


def shifted_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shifted ``[B, T]`` log-probs: ``lp[:, i] = log p(input_ids[:, i+1] | input_ids[:, :i+1])``.

    The last column is 0 (nothing to predict). Entropy, when asked, uses the same layout.
    """
    _check_inputs(input_ids, attention_mask, position_ids, temperature)
    total = input_ids.shape[1]
    if total < 2:
        raise ValueError(f"input_ids: expected at least 2 columns to predict a token, got {total}")
    with hidden_states_out(model, _chunked(model, input_ids.shape[0] * (total - 1))) as head:
        values = causal_lm_logits(
            model, input_ids, attention_mask, position_ids, torch.arange(total - 1, device=input_ids.device)
        )
    lp, ent = _stats(head, values, input_ids[:, 1:], temperature, calculate_entropy)
    return F.pad(lp, (0, 1)), (F.pad(ent, (0, 1)) if ent is not None else None)


def to_shifted(resp_lp: torch.Tensor, prompt_len: int, total_len: int) -> torch.Tensor:
    """Place response-aligned ``[B, R]`` values into the shifted ``[B, total_len]`` layout.

    Response column ``j`` goes to column ``prompt_len - 1 + j``; every other column is 0.
    Differentiable.
    """
    if resp_lp.ndim != 2:
        raise ValueError(f"resp_lp: expected a 2-D [B, R] tensor, got shape {tuple(resp_lp.shape)}")
    p, t, r = int(prompt_len), int(total_len), resp_lp.shape[1]
    if p < 1 or p + r != t:
        raise ValueError(
            f"prompt_len/total_len: expected prompt_len >= 1 and prompt_len + R == total_len "
            f"(R={r}), got prompt_len={prompt_len}, total_len={total_len}"
        )
    return F.pad(resp_lp, (p - 1, t - (p - 1) - r))
