"""ZoRRO (Zero Redundancy Rollouts) for any Hugging Face causal LM with a standard KV cache.

GRPO samples every prompt ``rollout_n`` times, so most tokens of a training batch are copies of
the same prompts. ZoRRO runs each unique prompt once and all of its responses against it:

1. :func:`group_prompts` finds the ``U`` unique prompts of a ``[B, P+R]`` batch (rows whose prompt
   columns -- ids, attention mask and positions -- are byte-identical; rows need not be adjacent);
2. the ``[U, P]`` prompts run once with ``use_cache=True``, giving the KV cache and the logits at
   the last prompt position (which predict each row's first response token);
3. the cache's key/value tensors are expanded from ``U`` to ``B`` rows with a differentiable
   ``index_select`` (its backward sums the ``n`` copies, so a prompt gets its gradient once);
4. the ``[B, R]`` responses run against the expanded cache with the full ``[B, P+R]`` attention
   mask and the rows' own response positions.

This is mathematically the plain ``[B, P+R]`` pass (the prompt never attends to the response), so
log-probs and gradients agree to float precision -- ``tests/test_zorro_on_cpu.py`` checks that for
Qwen3, Qwen2 and Llama with eager and sdpa attention. Unlike the vendor's version it patches no
attention module: it only uses the model's public ``forward`` and ``transformers``' ``DynamicCache``.

What it needs from the model: a full-attention ``DynamicCache`` (no sliding-window or linear
attention layers, whose caches keep only part of the prompt) and no active gradient
checkpointing (``transformers`` drops the cache inside checkpointed layers).
:func:`zorro_unsupported_reason` says why a model cannot take this path; :func:`zorro_forward`
raises :class:`ZorroUnsupportedError` for such a model.

What is not here: turning logits into log-probs, entropy or losses (:mod:`arctic_rl.server.logprobs`,
:mod:`arctic_rl.server.losses`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

__all__ = [
    "ZorroOutput",
    "ZorroUnsupportedError",
    "causal_lm_logits",
    "group_prompts",
    "zorro_forward",
    "zorro_unsupported_reason",
]


class ZorroUnsupportedError(ValueError):
    """The model cannot run the shared-prompt forward (see :func:`zorro_unsupported_reason`)."""


@dataclass
class ZorroOutput:
    """Logits of the shared-prompt forward, unscaled (temperature is applied by the caller).

    ``first_logits[row_to_group[b]]`` predicts ``input_ids[b, P]`` (the first response token);
    ``rest_logits[b, j]`` predicts ``input_ids[b, P + 1 + j]``.
    """

    first_logits: torch.Tensor  # [U, V] logits at the last prompt position of each unique prompt
    rest_logits: torch.Tensor  # [B, R-1, V] logits at response positions 0 .. R-2
    unique_row_index: torch.Tensor  # [U] row of the batch that represents each unique prompt
    row_to_group: torch.Tensor  # [B] index into the U unique prompts
    tokens_computed: int  # U*P + B*R (B*R is skipped when R == 1)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``transformers`` model inside a DeepSpeed engine / DDP wrapper (``.module``)."""
    inner = model
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    return inner


def _check_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> None:
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids: expected a 2-D [B, P+R] tensor, got shape {tuple(input_ids.shape)}")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask: expected shape {tuple(input_ids.shape)} (that of input_ids), "
            f"got {tuple(attention_mask.shape)}"
        )
    if not 1 <= int(prompt_len) < input_ids.shape[1]:
        raise ValueError(
            f"prompt_len: expected 1 <= prompt_len < {input_ids.shape[1]} (input_ids width), got {prompt_len}"
        )


def group_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the rows of a ``[B, P+R]`` batch by byte-identical prompt columns.

    Two rows share a group when their first ``prompt_len`` columns of ``input_ids`` and
    ``attention_mask`` (and of ``position_ids``, when given) are equal. Rows need not be adjacent.

    Returns ``(unique_row_index [U], row_to_group [B])``: groups are numbered in order of their
    first row, ``unique_row_index[g]`` is that first row, and
    ``row_to_group[unique_row_index] == arange(U)``.
    """
    _check_batch(input_ids, attention_mask, prompt_len)
    p = int(prompt_len)
    parts = [input_ids[:, :p].long(), attention_mask[:, :p].long()]
    if position_ids is not None:
        if tuple(position_ids.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"position_ids: expected shape {tuple(input_ids.shape)} (that of input_ids), "
                f"got {tuple(position_ids.shape)}"
            )
        parts.append(position_ids[:, :p].long())
    keys = torch.cat(parts, dim=1).detach()
    # torch.unique sorts the groups; renumber them by first occurrence so the order is the batch's.
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    batch = keys.shape[0]
    rows = torch.arange(batch, device=keys.device)
    first = torch.full((int(inverse.max()) + 1 if batch else 0,), batch, dtype=torch.long, device=keys.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=keys.device)
    return first[order], rank[inverse]


_LOGITS_TO_KEEP: dict[type, bool] = {}


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    cls = type(model)
    if cls not in _LOGITS_TO_KEEP:
        _LOGITS_TO_KEEP[cls] = "logits_to_keep" in inspect.signature(model.forward).parameters
    return _LOGITS_TO_KEEP[cls]


def causal_lm_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: torch.Tensor,
    *,
    past_key_values=None,
) -> torch.Tensor:
    """Run a causal LM and return its logits ``[B, len(keep), V]`` at the positions ``keep`` only.

    ``keep`` indexes the columns of ``input_ids``. The LM head runs on those positions only (via
    ``logits_to_keep`` when the model takes it; otherwise every position's logits are computed and
    then selected). With ``past_key_values`` the cache is used and extended in place.
    """
    inner = _unwrap(model)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    if past_key_values is not None:
        kwargs.update(past_key_values=past_key_values, use_cache=True)
    else:
        kwargs.update(use_cache=False)
    keep = keep.to(device=input_ids.device, dtype=torch.long)
    if _accepts_logits_to_keep(inner):
        return model(**kwargs, logits_to_keep=keep).logits
    return model(**kwargs).logits[:, keep]


def zorro_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run :func:`zorro_forward`, or ``None`` when it can."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    if config is None:
        return f"{type(inner).__name__} has no `config`: not a transformers model"
    if inner.training and any(getattr(m, "gradient_checkpointing", False) for m in inner.modules()):
        return "gradient checkpointing is enabled in training mode (transformers drops the KV cache then)"
    cache = DynamicCache(config=config)
    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if odd:
        return f"the model's cache has non-full-attention layers {odd} (sliding window or linear attention)"
    return None


def zorro_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_len: int,
) -> ZorroOutput:
    """The shared-prompt forward of a ``[left-padded prompt | right-padded response]`` batch.

    Equal (to float precision) to the plain ``[B, P+R]`` forward at the response positions;
    differentiable (gradients reach each unique prompt once). Raises
    :class:`ZorroUnsupportedError` for a model that cannot take this path.
    """
    from transformers import DynamicCache

    _check_batch(input_ids, attention_mask, prompt_len)
    if tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"position_ids: expected shape {tuple(input_ids.shape)} (that of input_ids), "
            f"got {tuple(position_ids.shape)}"
        )
    reason = zorro_unsupported_reason(model)
    if reason is not None:
        raise ZorroUnsupportedError(f"ZoRRO cannot run on this model: {reason}")
    p = int(prompt_len)
    batch, total = input_ids.shape
    r = total - p
    # group on the host: one small copy now instead of device syncs between the two passes
    cpu = torch.device("cpu")
    unique_cpu, groups_cpu = group_prompts(
        input_ids.to(cpu), attention_mask.to(cpu), p, position_ids=position_ids.to(cpu)
    )
    num_unique = int(unique_cpu.numel())
    identity = num_unique == batch and bool(torch.equal(groups_cpu, torch.arange(batch)))
    device = input_ids.device
    unique_rows = unique_cpu.to(device, non_blocking=True)
    row_to_group = groups_cpu.to(device, non_blocking=True)

    cache = DynamicCache(config=_unwrap(model).config)
    first_logits = causal_lm_logits(
        model,
        input_ids[:, :p].index_select(0, unique_rows),
        attention_mask[:, :p].index_select(0, unique_rows),
        position_ids[:, :p].index_select(0, unique_rows),
        torch.tensor([p - 1], device=device),
        past_key_values=cache,
    )[:, 0]
    if cache.get_seq_length() != p:  # defence in depth: a model that silently dropped the cache
        raise ZorroUnsupportedError(
            f"ZoRRO cannot run on this model: after the prompt pass its KV cache holds "
            f"{cache.get_seq_length()} positions, expected prompt_len={p}"
        )
    if r == 1:  # the only response token is predicted by the prompt's last position
        rest = first_logits.new_zeros((batch, 0, first_logits.shape[-1]))
        return ZorroOutput(first_logits, rest, unique_rows, row_to_group, num_unique * p)

    if not identity:
        for layer in cache.layers:  # U -> B rows; index_select's backward sums the copies
            layer.keys = layer.keys.index_select(0, row_to_group)
            layer.values = layer.values.index_select(0, row_to_group)
    rest_logits = causal_lm_logits(
        model,
        input_ids[:, p:],
        attention_mask,
        position_ids[:, p:],
        torch.arange(r - 1, device=device),
        past_key_values=cache,
    )
    return ZorroOutput(first_logits, rest_logits, unique_rows, row_to_group, num_unique * p + batch * r)
