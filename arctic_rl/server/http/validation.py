"""Validation of ``/forward`` and ``/forward-backward`` bodies: ``{batch, meta, processing}``.

Everything a client can get wrong is checked here, before any compute, and answered with a 400
naming the field, the allowed values and the value received: missing tensors
(:data:`~arctic_rl.protocol.REQUIRED_FORWARD_TENSORS`, :data:`~arctic_rl.protocol.REQUIRED_TRAIN_TENSORS`),
non-tensors, wrong rank or dtype (``position_ids`` and ``responses`` are optional, as at the vendor:
rebuilt from ``attention_mask`` and ``input_ids[:, P:]``), mismatched batch sizes or widths, ``input_ids`` that disagree
with ``prompts | responses``, token ids outside the vocabulary, non-0/1 masks, NaN/inf in the
float RL tensors, unknown loss or post-processor names, and invalid ``meta``/``processing.config``.

The result, :class:`~arctic_rl.server.engines.batch.ParsedBatch`, holds ``[B, P+R]`` model inputs as int64 and the RL tensors
*response-sliced* to ``[B, R]`` (a body may send them left-padded to ``P+R`` or already ``[B, R]``).
What is not here: running the model or the loss.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ValidationError

from arctic_rl.protocol import (
    LOSS_NAMES,
    OPTIONAL_FORWARD_TENSORS,
    POST_PROCESSORS,
    REQUIRED_FORWARD_TENSORS,
    REQUIRED_TRAIN_TENSORS,
    SFT_LOSS_NAMES,
    FieldError,
    LossConfig,
    Processing,
    validate_meta,
)
from arctic_rl.server.engines.batch import ParsedBatch
from arctic_rl.server.errors import BadRequest, from_validation_error

__all__ = ["parse_batch_body"]

_ID_TENSORS = ("input_ids", "prompts", "responses")
_MASKS = ("response_mask", "loss_mask")
_FLOAT_TENSORS = ("advantages", "old_log_probs", "ref_log_prob")
#: read from ``meta`` only, as the vendor's loss does (sent in the batch they would be ignored there)
_META_ONLY = ("rollout_is_weights",)


def _scalar_meta(raw: dict) -> dict:
    """``meta`` with one-element tensors made numbers (the vendor's client sends ``batch_num_tokens``
    as ``response_mask.sum()``, a 0-d tensor); ``rollout_is_weights`` is left as sent."""
    out = dict(raw)
    for key, value in raw.items():
        if key not in _META_ONLY and isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.item()
    return out


def _meta_weights(value: Any, rows: int, total: int, resp: int) -> torch.Tensor | None:
    """``meta.rollout_is_weights`` as a response-sliced ``[B, R]`` float tensor (``None``: absent).

    Accepted: a number or one-element tensor (every token), or a tensor shaped like the call's
    batch, ``[B, P+R]`` (left-padded) or ``[B, R]``; its rows follow the rows of the call when the
    server splits it into micro-batches."""
    field_name = "meta.rollout_is_weights"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise BadRequest(f"{field_name}: expected a number or a float tensor", field=field_name,
                         allowed=["number", f"[{rows}, {total}]", f"[{rows}, {resp}]"],
                         received=type(value).__name__)
    tensor = torch.as_tensor(value, dtype=torch.float32) if not isinstance(value, torch.Tensor) else value
    if not (tensor.is_floating_point() or isinstance(value, (int, float))):
        raise BadRequest(f"{field_name}: expected a floating-point dtype", field=field_name,
                         allowed=["float32", "float64", "bfloat16", "float16"],
                         received=str(tensor.dtype).replace("torch.", ""))
    tensor = tensor.float()
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise BadRequest(f"{field_name}: {bad} non-finite value(s) (NaN/inf)", field=field_name,
                         received=f"{bad} non-finite")
    if tensor.numel() == 1:
        return tensor.reshape(()).expand(rows, resp).clone()
    if tensor.ndim != 2 or tensor.shape[0] != rows or tensor.shape[1] not in (total, resp):
        raise BadRequest(f"{field_name}: expected a number or a tensor shaped like the batch", field=field_name,
                         allowed=["number", f"[{rows}, {total}]", f"[{rows}, {resp}]"], received=list(tensor.shape))
    return tensor[:, tensor.shape[1] - resp :]


def _section(obj: dict, key: str) -> dict:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{key}: expected an object", field=key, received=type(value).__name__)
    return value


def _tensor(batch: dict, name: str, required: bool) -> torch.Tensor | None:
    value = batch.get(name)
    if value is None:
        if required:
            raise BadRequest(f"batch.{name}: required tensor is missing", field=f"batch.{name}", received=None)
        return None
    if not isinstance(value, torch.Tensor):
        raise BadRequest(f"batch.{name}: expected a tensor", field=f"batch.{name}", received=type(value).__name__)
    if value.ndim != 2:
        raise BadRequest(
            f"batch.{name}: expected a 2-D [B, ...] tensor", field=f"batch.{name}", received=list(value.shape)
        )
    if value.is_complex():
        raise BadRequest(
            f"batch.{name}: complex dtypes are not accepted", field=f"batch.{name}", received=str(value.dtype)
        )
    return value


def _as_ids(value: torch.Tensor, name: str) -> torch.Tensor:
    if value.is_floating_point() or value.dtype == torch.bool:
        raise BadRequest(
            f"batch.{name}: expected an integer dtype",
            field=f"batch.{name}",
            allowed=["int64", "int32", "int16", "int8", "uint8"],
            received=str(value.dtype).replace("torch.", ""),
        )
    return value.to(torch.int64)


def _as_mask(value: torch.Tensor, name: str) -> torch.Tensor:
    if value.dtype != torch.bool and value.numel() and not bool(((value == 0) | (value == 1)).all()):
        raise BadRequest(f"batch.{name}: expected 0/1 values", field=f"batch.{name}", allowed=[0, 1])
    return value != 0


def _check_rows(name: str, value: torch.Tensor, rows: int) -> None:
    if value.shape[0] != rows:
        raise BadRequest(
            f"batch.{name}: batch size {value.shape[0]} differs from input_ids' {rows}",
            field=f"batch.{name}",
            allowed=rows,
            received=int(value.shape[0]),
        )


def _response_slice(name: str, value: torch.Tensor, total: int, resp: int) -> torch.Tensor:
    width = value.shape[1]
    if width == total:
        return value[:, total - resp :]
    if width == resp:
        return value
    raise BadRequest(
        f"batch.{name}: width {width} is neither P+R={total} (left-padded) nor R={resp}",
        field=f"batch.{name}",
        allowed=[total, resp],
        received=int(width),
    )


def _parse_processing(raw: dict, *, train: bool) -> tuple[Processing, str | None, LossConfig | None]:
    try:
        processing = Processing.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix="processing") from None
    posts = processing.post
    for post in [posts] if isinstance(posts, str) else list(posts or []):
        if post not in POST_PROCESSORS:
            raise BadRequest(
                f"processing.post: unknown post-processor {post!r}",
                field="processing.post",
                allowed=list(POST_PROCESSORS),
                received=post,
            )
    from arctic_rl.server.compute.losses import DEFAULT_LOSS, LossNameError, resolve_loss

    try:  # also where no loss runs (forward): a name off the allow-list is an error
        resolve_loss(processing.loss_fn)
    except LossNameError as exc:
        raise BadRequest(
            str(exc), field="processing.loss_fn", allowed=list(LOSS_NAMES), received=exc.received
        ) from None
    if not train:
        return processing, None, None
    return processing, processing.loss_fn or DEFAULT_LOSS, processing.config or LossConfig()


def parse_batch_body(obj: Any, *, vocab_size: int, train: bool) -> ParsedBatch:
    """Validate a decoded ``{batch, meta, processing}`` body (see the module docstring)."""
    if not isinstance(obj, dict):
        raise BadRequest(
            "body: expected an object {batch, meta, processing}",
            field="body",
            allowed=["batch", "meta", "processing"],
            received=type(obj).__name__,
        )
    if obj.get("batch") is None:
        raise BadRequest("batch: required", field="batch", received=None)
    batch = _section(obj, "batch")
    raw_meta = _scalar_meta(_section(obj, "meta"))
    try:
        meta = validate_meta(raw_meta)
    except FieldError as exc:  # an unknown key: named, with the allowed keys
        raise BadRequest(exc.args[0], field=exc.field, allowed=exc.allowed, received=exc.received) from None
    except ValidationError as exc:
        raise from_validation_error(exc, prefix="meta") from None
    processing, loss_name, loss_config = _parse_processing(_section(obj, "processing"), train=train)

    sft = loss_name in SFT_LOSS_NAMES
    required = REQUIRED_TRAIN_TENSORS if train and not sft else REQUIRED_FORWARD_TENSORS
    missing = [name for name in required if batch.get(name) is None]
    if missing:
        raise BadRequest(
            f"batch.{missing[0]}: required tensor is missing (missing: {missing})",
            field=f"batch.{missing[0]}",
            allowed=list(required),
            received=sorted(batch.keys()),
        )
    for name in _META_ONLY:
        if batch.get(name) is not None:
            raise BadRequest(
                f"batch.{name}: read from meta only (the vendor's loss ignores it in the batch); "
                f"send it as meta.{name}",
                field=f"batch.{name}",
                allowed=f"meta.{name}",
                received=f"batch.{name}",
            )
    optional = set(OPTIONAL_FORWARD_TENSORS) | set(_MASKS) | set(_FLOAT_TENSORS)
    tensors = {name: _tensor(batch, name, required=False) for name in set(required) | optional}

    input_ids = _as_ids(tensors["input_ids"], "input_ids")
    rows, total = input_ids.shape
    if rows < 1:
        raise BadRequest(
            "batch.input_ids: expected at least one row", field="batch.input_ids", received=list(input_ids.shape)
        )
    for name, value in tensors.items():
        if value is not None:
            _check_rows(name, value, rows)
    prompts = _as_ids(tensors["prompts"], "prompts")
    p = prompts.shape[1]
    if tensors["responses"] is not None:  # optional, as at the vendor: input_ids[:, P:] otherwise
        responses = _as_ids(tensors["responses"], "responses")
        r = responses.shape[1]
        if p < 1 or r < 1 or p + r != total:
            raise BadRequest(
                f"batch: prompts width P={p} + responses width R={r} must equal input_ids width {total} (P, R >= 1)",
                field="batch.responses",
                allowed=total,
                received=p + r,
            )
    else:
        r = total - p
        if p < 1 or r < 1:
            raise BadRequest(
                f"batch.prompts: width P={p} must leave at least one response column in input_ids width {total}",
                field="batch.prompts",
                allowed=f"[1, {total - 1}]",
                received=p,
            )
        responses = input_ids[:, p:]
    for name in ("attention_mask", "position_ids"):
        if tensors[name] is not None and tuple(tensors[name].shape) != (rows, total):
            raise BadRequest(
                f"batch.{name}: expected shape {[rows, total]} (that of input_ids)",
                field=f"batch.{name}",
                allowed=[rows, total],
                received=list(tensors[name].shape),
            )
    attention_mask = _as_mask(tensors["attention_mask"], "attention_mask").to(torch.int64)
    real = attention_mask != 0  # padding may hold any id (clients pad prompts and input_ids differently)
    if bool(((input_ids != torch.cat([prompts, responses], 1)) & real).any()):
        raise BadRequest(
            "batch.input_ids: expected input_ids == cat(prompts, responses) along dim 1 (at attended tokens)",
            field="batch.input_ids",
        )
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise BadRequest(
            f"batch.input_ids: token ids must lie in [0, {vocab_size})",
            field="batch.input_ids",
            allowed=f"[0, {vocab_size})",
            received=lo if lo < 0 else hi,
        )
    if tensors["position_ids"] is None:  # the vendor's clients drop them by default: rebuild from the mask
        position_ids = (attention_mask.cumsum(1) - 1).clamp_min(0)
    else:
        position_ids = _as_ids(tensors["position_ids"], "position_ids")
    if int(position_ids.min()) < 0:
        raise BadRequest("batch.position_ids: expected non-negative positions", field="batch.position_ids")

    rl: dict[str, torch.Tensor] = {}
    for name in _MASKS:
        if tensors[name] is not None:
            rl[name] = _as_mask(_response_slice(name, tensors[name], total, r), name)
    for name in _FLOAT_TENSORS:
        value = tensors[name]
        if value is None:
            continue
        if not value.is_floating_point():
            raise BadRequest(
                f"batch.{name}: expected a floating-point dtype",
                field=f"batch.{name}",
                allowed=["float32", "float64", "bfloat16", "float16"],
                received=str(value.dtype).replace("torch.", ""),
            )
        bad = int((~torch.isfinite(value)).sum())  # anywhere, padding included
        if bad:
            raise BadRequest(
                f"batch.{name}: {bad} non-finite value(s) (NaN/inf)",
                field=f"batch.{name}",
                received=f"{bad} non-finite",
            )
        rl[name] = _response_slice(name, value, total, r).float()
    weights = _meta_weights(raw_meta.get("rollout_is_weights"), rows, total, r)
    if weights is not None:
        rl["rollout_is_weights"] = weights
    if train:
        if "response_mask" not in rl and "loss_mask" not in rl:
            rl["response_mask"] = attention_mask[:, p:] != 0  # SFT bodies may rely on the attention mask
        rl.setdefault("loss_mask", rl.get("response_mask"))
        rl.setdefault("response_mask", rl["loss_mask"])
        if loss_config is not None and loss_config.use_kl_loss and not sft and "ref_log_prob" not in rl:
            raise BadRequest(
                "batch.ref_log_prob: required when processing.config.use_kl_loss is true",
                field="batch.ref_log_prob",
            )
    return ParsedBatch(
        input_ids, attention_mask, position_ids, p, meta, frozenset(raw_meta), processing, loss_name, loss_config, rl
    )
