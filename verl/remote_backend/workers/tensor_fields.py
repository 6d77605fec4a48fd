"""The forwarder worker's data dispatch: verl's own, with the batch narrowed to its tensor fields.

verl's trainer hands ``compute_log_prob``, ``compute_ref_log_prob`` and ``update_actor`` a ``KVBatchMeta`` that
names no fields, and verl's TransferQueue bridge in the worker then reads every field of every sample, the
non-tensor ones too (the raw prompt, the data source, the reward's extra info, ...). It rebuilds each of those
as a ``NonTensorStack`` sample by sample: at 64 prompts x 8 samples that was ~0.6 s of the bridge's ~0.7 s read
per call on a 2-core machine, and no backend reads them. A backend gets verl's tensors (token ids, masks,
advantages, log-probs, IS weights) and the call's extra info (temperature, mini-batch size, seed, ...), which
travels beside the fields and is kept.

A backend whose class declares the fields each compute method reads
(:class:`~verl.remote_backend.protocols.ReadsTensorFields`, taken by :func:`declare_fields_read` in the driver)
narrows it further, to those: the bridge's read grows with the fields it fetches (``benchmarks/
transfer_queue_fields.py``, 512 samples and 14 verl-shaped tensor fields on a 2-core machine: 0.13 s for all of them,
0.06 s for the 7 the Arctic adapter's update reads), and by an ``update_actor`` a batch holds every field the step
has written.

:func:`tensor_fields_dispatch` is verl's ``make_nd_compute_dataproto_dispatch_fn(mesh)`` whose dispatch function
first names the tensor fields in every ``KVBatchMeta`` argument (one metadata read from TransferQueue on the
driver). verl's collect function, its bridge and its write-back of the outputs are unchanged. A meta that names
its fields already is narrowed among those: the one verl hands ``update_actor`` names every field its samples hold
(the meta its last TransferQueue write returned), non-tensor ones included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from functools import partial
from typing import Any

from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn
from verl.utils.transferqueue_utils import KVBatchMeta, kv_batch_meta2batch_meta

from verl.remote_backend.logs import module_logger
from verl.remote_backend.protocols import COMPUTE_METHODS, fields_read_by

__all__ = ["declare_fields_read", "tensor_fields", "tensor_fields_dispatch", "with_tensor_fields"]

logger = module_logger(__name__)
_said: set[tuple[str, tuple[str, ...], tuple[str, ...]]] = set()  # (method, left-out sets) already logged

#: method -> the tensor fields the backend declared it reads, for the dispatches of this process
_read_by_method: dict[str, frozenset[str]] = {}


def declare_fields_read(backend_cls: type) -> dict[str, frozenset[str]]:
    """From now on, in this process, dispatch each compute method with the tensor fields ``backend_cls`` declares
    it reads (:func:`~verl.remote_backend.protocols.fields_read_by`); a method it answers ``None`` for, or a class
    that declares nothing, gets every tensor field. Returns what was taken."""
    declared = fields_read_by(backend_cls)
    _read_by_method.clear()
    _read_by_method.update(declared)
    return declared


def tensor_fields(field_schema: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The names of a TransferQueue field schema's tensor fields, in its order."""
    return [name for name, meta in field_schema.items() if not meta.get("is_non_tensor", False)]


def with_tensor_fields(meta: Any, schema_of: Callable[[KVBatchMeta], Mapping[str, Mapping[str, Any]]],
                       read: Collection[str] | None = None, method: str = "") -> Any:
    """``meta`` naming its tensor fields only -- of those, the ones in ``read`` where given -- where it is a
    non-empty ``KVBatchMeta``; anything else unchanged. A meta that names its fields already (verl's trainer hands
    ``update_actor`` the meta its last write returned, which names every field the samples hold) keeps those of
    its names that pass. ``schema_of`` reads a meta's field schema (from TransferQueue; for a meta that names
    fields, theirs); ``method`` names the call in the log line."""
    if not isinstance(meta, KVBatchMeta) or len(meta) == 0:
        return meta
    schema = schema_of(meta)
    named = list(schema) if meta.fields is None else [meta.fields] if isinstance(meta.fields, str) else list(meta.fields)
    tensors = set(tensor_fields(schema))
    keep = [name for name in named if name in tensors and (read is None or name in read)]
    if keep == named:  # nothing to leave out
        return meta
    not_tensors = sorted(set(named) - tensors)
    not_read = sorted(set(named) & tensors - set(keep))
    said = (method, tuple(not_tensors), tuple(not_read))
    if said not in _said:
        _said.add(said)
        logger.info("forwarder %s reads the batch's %d tensor fields %s; left out: %d not read by the backend %s, "
                    "%d not tensors %s", method or "call", len(keep), sorted(keep), len(not_read), not_read,
                    len(not_tensors), not_tensors)
    return dataclasses.replace(meta, fields=keep)


def _schema_from_queue(meta: KVBatchMeta) -> Mapping[str, Mapping[str, Any]]:
    return kv_batch_meta2batch_meta(meta).field_schema


def _dispatch(dispatch_fn: Callable[..., Any], method: str, worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    read = _read_by_method.get(method)
    args = tuple(with_tensor_fields(a, _schema_from_queue, read, method) for a in args)
    kwargs = {k: with_tensor_fields(v, _schema_from_queue, read, method) for k, v in kwargs.items()}
    return dispatch_fn(worker_group, *args, **kwargs)


def tensor_fields_dispatch(mesh_name: str, method: str) -> dict[str, Callable[..., Any]]:
    """verl's dispatch mode of the compute method ``method`` on ``mesh_name``, reading the batch's tensor fields
    only, and of those the ones the backend declared ``method`` reads (:func:`declare_fields_read`)."""
    if method not in COMPUTE_METHODS:
        raise ValueError(f"tensor_fields_dispatch: method must be one of {COMPUTE_METHODS}, got {method!r}")
    verl_mode = make_nd_compute_dataproto_dispatch_fn(mesh_name)
    return {"dispatch_fn": partial(_dispatch, verl_mode["dispatch_fn"], method), "collect_fn": verl_mode["collect_fn"]}
