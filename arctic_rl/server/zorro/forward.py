"""ZoRRO (Zero Redundancy Rollouts) for Hugging Face causal LMs with full attention.

GRPO samples every prompt ``rollout_n`` times, so most tokens of a training batch are copies of
the same prompts. ZoRRO runs each unique prompt once and all of its responses against it:

1. :func:`group_prompts` finds the ``U`` unique prompts of a ``[B, P+R]`` batch (rows whose prompt
   columns -- ids, attention mask and positions -- are byte-identical; rows need not be adjacent);
2. the ``[U, P]`` prompts run once, giving the logits at the last prompt position (which predict
   each row's first response token) while every attention layer hands its post-rotary keys and
   values to ZoRRO;
3. those keys and values are expanded from ``U`` to ``B`` rows with a differentiable
   ``index_select`` (its backward sums the ``n`` copies, so a prompt gets its gradient once);
4. the ``[B, R]`` responses run with each layer attending to ``[its prompt's keys | the response's
   own keys]`` under a ``[B, 1, R, P+R]`` mask built once from the batch's attention mask.

This is mathematically the plain ``[B, P+R]`` pass (the prompt never attends to the response), so
log-probs and gradients agree to float precision -- ``tests/arctic_rl/server/zorro/test_forward_on_cpu.py`` checks that for
Qwen3, Qwen2 and Llama with eager and sdpa attention. Unlike the vendor's version it patches no
attention module and no model code: steps 2 and 4 go through ``transformers``' public attention
registry (``AttentionInterface``). While :func:`zorro_forward` runs, the model's ``sdpa`` or
``eager`` attention is swapped for a wrapper of the same function (:mod:`arctic_rl.server.zorro.attention`),
which behaves exactly like it outside ZoRRO's passes; afterwards the model's own implementation is
back, so the plain pass runs as it would without ZoRRO (under ``torch.compile``, without the
wrapper's graph breaks).

Step 3-4 have two forms (:func:`arctic_rl.server.zorro.flex.set_response_attention`). ``expand`` --
the default, any device, any kernel -- copies each prompt's keys and values to its rows as described.
``flex`` -- what the reference server uses on a GPU with ``torch.compile``; its kernel, probe and
block mask are in :mod:`arctic_rl.server.zorro.flex` -- copies nothing: the rows, sorted by prompt, form
groups of ``n`` (the greatest common divisor of the prompts' row counts: a GRPO batch's ``rollout_n``,
also when two of its groups drew the same prompt), and each group's ``n*R`` response queries attend to
``[its prompt's P keys | the group's own n*R keys]`` through a compiled FlexAttention kernel with a
block mask that skips the blocks no query may see (a prompt of several groups lends them its keys
through an ``index_select``, which sums their gradients). On an H200 this made ZoRRO 1.60x -> 1.97x
the plain pass at 32 rows (``benchmarks/RESULTS.md``). Should FlexAttention fail to build a kernel, the
pass falls back to ``expand`` (with a warning) for the rest of the process.

Why not ``transformers``' ``DynamicCache``: a cache update reads each attention module's
``layer_idx``, so a ``torch.compile``-d decoder layer specialises on it and recompiles once per
layer (past Dynamo's recompile limit, the rest runs eager). The wrapper is opaque to Dynamo
(``torch.compiler.disable``) and reads ``layer_idx`` outside the compiled graphs, so one compiled
layer serves every layer on both of ZoRRO's passes.

What it needs from the model: attention that goes through ``transformers``' attention interface
with the ``sdpa`` or ``eager`` implementation, only full-attention layers (no sliding-window or
linear attention, whose caches keep only part of the prompt) and no active gradient checkpointing
(checkpointed layers re-run their forward, which ZoRRO's hand-over of keys cannot follow).
:func:`zorro_unsupported_reason` says why a model cannot take this path; :func:`zorro_forward`
raises :class:`ZorroUnsupportedError` for such a model.

What is not here: turning logits into log-probs, entropy or losses (:mod:`arctic_rl.server.compute.token_logprobs`,
:mod:`arctic_rl.server.compute.losses`).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass

import torch

from arctic_rl.server.zorro import flex as zorro_flex
from arctic_rl.server.zorro.attention import (
    PassState,
    ZorroUnsupportedError,
    attention_base,
    install_zorro_attention,
    routed_through_wrapper,
    running_pass,
    unwrap_model,
    zorro_unsupported_reason,
)

__all__ = [
    "ZorroOutput",
    "ZorroUnsupportedError",
    "causal_lm_logits",
    "group_prompts",
    "install_zorro_attention",
    "zorro_forward",
    "zorro_unsupported_reason",
]


logger = logging.getLogger(__name__)


@dataclass
class ZorroOutput:
    """Logits of the shared-prompt forward, unscaled (temperature is applied by the caller).

    ``first_logits[row_to_group[b]]`` predicts ``input_ids[b, P]`` (the first response token);
    ``rest_logits[i, j]`` predicts ``input_ids[rest_rows[i], P + 1 + j]`` (``rest_rows`` is ``None``
    when the rows are in batch order: then ``i`` is the batch row). The grouped response pass leaves
    its rows sorted by prompt: reordering ``[B, R-1, V]`` logits would cost more than reordering the
    targets and the per-token results, which the caller does.
    """

    first_logits: torch.Tensor  # [U, V] logits at the last prompt position of each unique prompt
    rest_logits: torch.Tensor  # [B, R-1, V] logits at response positions 0 .. R-2
    unique_row_index: torch.Tensor  # [U] row of the batch that represents each unique prompt
    row_to_group: torch.Tensor  # [B] index into the U unique prompts
    tokens_computed: int  # U*P + B*R (B*R is skipped when R == 1)
    rest_rows: torch.Tensor | None = None  # [B] batch row of each row of rest_logits, or None (batch order)


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
) -> torch.Tensor:
    """Run a causal LM and return its logits ``[B, len(keep), V]`` at the positions ``keep`` only.

    ``keep`` indexes the columns of ``input_ids``. The LM head runs on those positions only (via
    ``logits_to_keep`` when the model takes it; otherwise every position's logits are computed and
    then selected). No KV cache is kept.
    """
    inner = unwrap_model(model)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
    keep = keep.to(device=input_ids.device, dtype=torch.long)
    if _accepts_logits_to_keep(inner):
        return model(**kwargs, logits_to_keep=keep).logits
    return model(**kwargs).logits[:, keep]


def _response_mask(attention_mask: torch.Tensor, p: int, dtype: torch.dtype, eager: bool) -> torch.Tensor:
    """``[B, 1, R, P+R]``: response query ``i`` sees key ``j`` iff ``j <= P + i`` and key ``j`` is not padding.

    Boolean (True = attend) for sdpa; additive (0 / dtype min) for eager attention, as
    ``transformers`` builds them for those implementations.
    """
    total = attention_mask.shape[1]
    r = total - p
    device = attention_mask.device
    causal = torch.arange(total, device=device)[None, :] <= (p + torch.arange(r, device=device))[:, None]
    allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _response_pass(model, state: PassState, ids, mask, positions, r: int) -> torch.Tensor:
    with running_pass(state):
        return causal_lm_logits(model, ids, mask, positions, torch.arange(r - 1, device=ids.device))


def zorro_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_len: int,
) -> ZorroOutput:
    """The shared-prompt forward of a ``[left-padded prompt | right-padded response]`` batch.

    Equal (to float precision) to the plain ``[B, P+R]`` forward at the response positions;
    differentiable (gradients reach each unique prompt once). The model's attention goes through
    ZoRRO's wrapper while the passes run and through its own implementation again afterwards (the
    backward needs neither), so plain passes stay free of the wrapper's graph breaks. Raises
    :class:`ZorroUnsupportedError` for a model that cannot take this path.
    """
    _check_batch(input_ids, attention_mask, prompt_len)
    if tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"position_ids: expected shape {tuple(input_ids.shape)} (that of input_ids), "
            f"got {tuple(position_ids.shape)}"
        )
    reason = zorro_unsupported_reason(model)
    if reason is not None:
        raise ZorroUnsupportedError(f"ZoRRO cannot run on this model: {reason}")
    with routed_through_wrapper(model):
        return _zorro_passes(model, input_ids, attention_mask, position_ids, int(prompt_len))


def _zorro_passes(model, input_ids, attention_mask, position_ids, p: int) -> ZorroOutput:
    """:func:`zorro_forward`'s two passes, the batch checked and the attention routed through the wrapper."""
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

    with running_pass(PassState()) as prompt:
        first_logits = causal_lm_logits(
            model,
            input_ids[:, :p].index_select(0, unique_rows),
            attention_mask[:, :p].index_select(0, unique_rows),
            position_ids[:, :p].index_select(0, unique_rows),
            torch.tensor([p - 1], device=device),
        )[:, 0]
    layers = int(getattr(unwrap_model(model).config, "num_hidden_layers", len(prompt.collected)))
    if len(prompt.collected) != layers:  # a model whose attention bypasses the attention interface
        raise ZorroUnsupportedError(
            f"ZoRRO cannot run on this model: the prompt pass saw keys of {len(prompt.collected)} of its "
            f"{layers} layers (its attention does not go through transformers' attention interface)"
        )
    if r == 1:  # the only response token is predicted by the prompt's last position
        rest = first_logits.new_zeros((batch, 0, first_logits.shape[-1]))
        return ZorroOutput(first_logits, rest, unique_rows, row_to_group, num_unique * p)

    eager = attention_base(model) == "eager"
    some_key = next(iter(prompt.collected.values()))[0]
    counts = torch.bincount(groups_cpu, minlength=num_unique)
    # rows per group of the grouped pass: a prompt with k*n rows (one that several GRPO groups drew) is k groups
    n = math.gcd(*counts.tolist()) if num_unique else 0
    # FlexAttention has no CPU backward: on CPU the grouped path runs only without gradients
    kind, compiled = zorro_flex.response_attention()
    grouped = kind == "flex" and n > 0 and (device.type != "cpu" or not torch.is_grad_enabled())
    if grouped and compiled:
        config = unwrap_model(model).config
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        grouped = zorro_flex.flex_failure(device, some_key.dtype, heads, kv_heads, head_dim) is None
    order = None
    if grouped:
        # rows sorted by prompt (stable), so that each prompt's rows are adjacent, in group order
        order_cpu = torch.argsort(groups_cpu, stable=True)
        ids, mask2d, positions = input_ids, attention_mask, position_ids
        if not torch.equal(order_cpu, torch.arange(batch)):  # (GRPO batches usually come sorted)
            order = order_cpu.to(device, non_blocking=True)
            ids, mask2d, positions = (t.index_select(0, order) for t in (input_ids, attention_mask, position_ids))
        prompt_valid = attention_mask[:, :p].index_select(0, unique_rows).bool()
        group_prompt = None  # group -> unique prompt, where a prompt has several groups
        if bool((counts != n).any()):
            group_prompt = torch.repeat_interleave(torch.arange(num_unique), counts // n).to(device, non_blocking=True)
            prompt_valid = prompt_valid.index_select(0, group_prompt)
        state = PassState(prompt_kv=prompt.collected, group_size=n, group_prompt=group_prompt)
        try:
            state.block_mask = zorro_flex.group_block_mask(
                prompt_valid,
                mask2d[:, p:].bool().reshape(batch // n, n * r),
                p,
                r,
                compiled=compiled,
            )
            # the model's own mask is not used by the grouped attention
            rest_logits = _response_pass(model, state, ids[:, p:], mask2d[:, p:], positions[:, p:], r)
            return ZorroOutput(first_logits, rest_logits, unique_rows, row_to_group, num_unique * p + batch * r, order)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a kernel that cannot be built for this shape or device
            zorro_flex.set_response_attention("expand")
            logger.warning(
                "ZoRRO: FlexAttention response pass failed (%s); using the expanding response pass from now on",
                zorro_flex.failure_text(exc),
            )
    mask = _response_mask(attention_mask, p, some_key.dtype, eager)
    state = PassState(prompt_kv=prompt.collected, rows=None if identity else row_to_group)
    rest_logits = _response_pass(model, state, input_ids[:, p:], mask, position_ids[:, p:], r)
    return ZorroOutput(first_logits, rest_logits, unique_rows, row_to_group, num_unique * p + batch * r)
