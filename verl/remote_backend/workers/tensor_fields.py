"""The forwarder worker's data dispatch: verl's own, with the batch narrowed to its tensor fields.

verl's trainer hands ``compute_log_prob``, ``compute_ref_log_prob`` and ``update_actor`` a ``KVBatchMeta`` that
names no fields, and verl's TransferQueue bridge in the worker then reads every field of every sample, the
non-tensor ones too (the raw prompt, the data source, the reward's extra info, ...). It rebuilds each of those
as a ``NonTensorStack`` sample by sample: at 64 prompts x 8 samples that was ~0.6 s of the bridge's ~0.7 s read
per call on a 2-core machine, and no backend reads them. A backend gets verl's tensors (token ids, masks,
advantages, log-probs, IS weights) and the call's extra info (temperature, mini-batch size, seed, ...), which
travels beside the fields and is kept.

:func:`tensor_fields_dispatch` is verl's ``make_nd_compute_dataproto_dispatch_fn(mesh)`` whose dispatch function
first names the tensor fields in every ``KVBatchMeta`` argument (one metadata read from TransferQueue on the
driver). verl's collect function, its bridge and its write-back of the outputs are unchanged. A meta that names
its fields already is passed on as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn
from verl.utils.transferqueue_utils import KVBatchMeta, kv_batch_meta2batch_meta

from verl.remote_backend.logs import module_logger

__all__ = ["tensor_fields", "tensor_fields_dispatch", "with_tensor_fields"]

logger = module_logger(__name__)
_said: set[tuple[str, ...]] = set()  # the left-out sets already logged (once each)


def tensor_fields(field_schema: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The names of a TransferQueue field schema's tensor fields, in its order."""
    return [name for name, meta in field_schema.items() if not meta.get("is_non_tensor", False)]


def with_tensor_fields(meta: Any, schema_of: Callable[[KVBatchMeta], Mapping[str, Mapping[str, Any]]]) -> Any:
    """``meta`` naming its tensor fields only, where it is a ``KVBatchMeta`` that names none and has non-tensor
    fields; anything else unchanged. ``schema_of`` reads a meta's field schema (from TransferQueue)."""
    if not isinstance(meta, KVBatchMeta) or meta.fields is not None or len(meta) == 0:
        return meta
    schema = schema_of(meta)
    keep = tensor_fields(schema)
    if len(keep) == len(schema):
        return meta
    left_out = tuple(sorted(set(schema) - set(keep)))
    if left_out not in _said:
        _said.add(left_out)
        logger.info("forwarder calls read the batch's %d tensor fields %s; left out (not tensors): %s",
                    len(keep), sorted(keep), list(left_out))
    return dataclasses.replace(meta, fields=keep)


def _schema_from_queue(meta: KVBatchMeta) -> Mapping[str, Mapping[str, Any]]:
    return kv_batch_meta2batch_meta(meta).field_schema


def _dispatch(dispatch_fn: Callable[..., Any], worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    args = tuple(with_tensor_fields(a, _schema_from_queue) for a in args)
    kwargs = {k: with_tensor_fields(v, _schema_from_queue) for k, v in kwargs.items()}
    return dispatch_fn(worker_group, *args, **kwargs)


def tensor_fields_dispatch(mesh_name: str) -> dict[str, Callable[..., Any]]:
    """verl's dispatch mode of a compute method on ``mesh_name``, reading the batch's tensor fields only."""
    verl_mode = make_nd_compute_dataproto_dispatch_fn(mesh_name)
    return {"dispatch_fn": partial(_dispatch, verl_mode["dispatch_fn"]), "collect_fn": verl_mode["collect_fn"]}
