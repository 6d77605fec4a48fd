"""Per-token log-probs (and entropy) of a forward/backward batch, plain or with ZoRRO.

A batch is dense ``[B, P+R]``: ``[left-padded prompt (width P) | right-padded response (width R)]``.
:func:`response_logprobs` returns *response-aligned* values ``[B, R]`` (``lp[:, j] =
log p(responses[:, j] | prompt, responses[:, :j])``) of the temperature-scaled distribution, either
from the plain ``[B, P+R]`` pass or from ZoRRO's shared-prompt pass (:mod:`arctic_rl.server.zorro`);
both agree to float precision. :func:`shifted_logprobs` gives the protocol's *shifted* ``[B, P+R]``
layout of a plain pass and :func:`to_shifted` moves response-aligned values into it.

Memory: the LM head runs only at the positions whose logits are needed (``R`` per row, or one per
unique prompt plus ``R-1`` per row with ZoRRO), and the fp32 log-softmax is computed a few rows at
a time. Everything is differentiable when grad is enabled and works under ``torch.no_grad()``.

What is not here: losses (:mod:`arctic_rl.server.losses`), HTTP or engines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from arctic_rl.server.zorro import causal_lm_logits, zorro_forward, zorro_unsupported_reason

__all__ = ["TokenLogprobs", "response_logprobs", "shifted_logprobs", "to_shifted"]

logger = logging.getLogger(__name__)

#: fp32 bytes of logits upcast at once when turning logits into log-probs (per chunk of rows)
_FP32_CHUNK_BYTES = 256 * 1024 * 1024


@dataclass
class TokenLogprobs:
    """Response-aligned per-token values of a batch (see the module docstring)."""

    logprobs: torch.Tensor  # [B, R] fp32
    entropy: torch.Tensor | None  # [B, R] fp32, entropy of the temperature-scaled distribution
    tokens_computed: int  # tokens pushed through the model (ZoRRO: U*P + B*R; plain: B*(P+R))
    unique_prompts: int  # U (== B for the plain path)


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


def _token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and entropy under ``softmax(logits / temperature)`` in fp32.

    ``logits``: ``[N, K, V]`` (any float dtype), ``targets``: ``[N, K]``. Rows are upcast in chunks
    so no more than ~``_FP32_CHUNK_BYTES`` of fp32 logits exist at once (outside autograd's saves).
    """
    n, k, v = logits.shape
    per_row = max(1, k * v * 4)
    step = max(1, _FP32_CHUNK_BYTES // per_row)
    lps, ents = [], []
    for s in range(0, n, step):
        z = logits[s : s + step].float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        lps.append(z.gather(-1, targets[s : s + step].long().unsqueeze(-1)).squeeze(-1) - lse)
        if want_entropy:
            ents.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
    if not lps:  # N == 0
        empty = logits.new_zeros((0, k), dtype=torch.float32)
        return empty, (empty if want_entropy else None)
    return torch.cat(lps, 0), (torch.cat(ents, 0) if want_entropy else None)


def _zorro_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    p: int,
    temperature: float,
    want_entropy: bool,
) -> TokenLogprobs:
    out = zorro_forward(model, input_ids, attention_mask, position_ids, p)
    targets = input_ids[:, p:].long()
    groups = out.row_to_group
    # the first response token: its distribution is the (shared) one at the prompt's last position
    z0 = out.first_logits.float()
    if temperature != 1.0:
        z0 = z0 / temperature
    lse0 = torch.logsumexp(z0, dim=-1)  # [U]
    lp0 = z0[groups, targets[:, 0]] - lse0[groups]  # [B]
    rest_lp, rest_ent = _token_stats(out.rest_logits, targets[:, 1:], temperature, want_entropy)
    logprobs = torch.cat([lp0.unsqueeze(1), rest_lp], dim=1)
    entropy = None
    if want_entropy:
        ent0 = lse0 - (torch.softmax(z0, dim=-1) * z0).sum(-1)  # [U]
        entropy = torch.cat([ent0[groups].unsqueeze(1), rest_ent], dim=1)
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

    ``zorro=True`` runs each unique prompt once (:func:`arctic_rl.server.zorro.zorro_forward`).
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
    logits = causal_lm_logits(
        model, input_ids, attention_mask, position_ids, torch.arange(p - 1, total - 1, device=input_ids.device)
    )
    logprobs, entropy = _token_stats(logits, targets, temperature, calculate_entropy)
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
    logits = causal_lm_logits(
        model, input_ids, attention_mask, position_ids, torch.arange(total - 1, device=input_ids.device)
    )
    lp, ent = _token_stats(logits, input_ids[:, 1:], temperature, calculate_entropy)
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
