"""Weights handed to a vLLM engine core in another process, through one shared CUDA buffer.

With ``--vllm-engine-process own`` the vLLM sampler's engine core (scheduler, model, KV cache) runs in a process of
its own, so a ``/weight-sync`` can no longer hand the training job's live tensors to the model (:mod:`.weights` does
that in one process). Instead:

* the server keeps one device buffer (``uint8``, as large as the largest bucket, made on the first sync and kept);
* the weights are laid out in buckets of at most :data:`BUCKET_BYTES` (a tensor larger than that gets a bucket of its
  own), each tensor at a 256-byte aligned offset, floating-point tensors cast to the sampler's dtype;
* per bucket: the tensors are copied into the buffer, the server's stream is synchronised, and the engine core is
  called (``collective_rpc("arctic_load_shared", ...)``, :mod:`.vllm_worker_ext`) with the buffer's CUDA IPC handle
  and the bucket's layout; the worker opens the buffer once (cached by handle), views each tensor at its offset and
  hands them to its model's ``load_weights``; it synchronises before it answers, so the buffer is free to refill.

A device-to-device copy of each tensor plus one call per bucket; no host round trip, and the buffer bounds the extra
memory (:data:`BUCKET_BYTES`, or the largest tensor). The handle travels as plain data (:func:`describe_shared`: ints
and bytes), which vLLM's message encoding carries without pickling; :func:`open_shared` rebuilds the tensor from it with
PyTorch's own IPC rebuild. The layout's records are lists of plain values too (:class:`Entry`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALIGN", "BUCKET_BYTES", "Entry", "IpcWeightSender", "describe_shared", "open_shared", "plan_buckets",
           "views"]

#: the most bytes one bucket (one engine-core call) carries, unless a single tensor is larger
BUCKET_BYTES = 512 << 20
#: every tensor starts at a multiple of this many bytes in the buffer
ALIGN = 256

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in the shared buffer: ``name``, ``dtype`` (PyTorch's name without ``torch.``),
    ``shape`` and byte ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize

    def to_wire(self) -> list[Any]:
        """The record the engine core gets: ``[name, dtype, shape, offset]``."""
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_wire(cls, record: list[Any]) -> Entry:
        name, dtype, shape, offset = record
        _dtype(dtype)
        return cls(str(name), str(dtype), tuple(int(d) for d in shape), int(offset))


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: a tensor dtype in the shared weight buffer (allowed: {sorted(_DTYPES)}, "
                         f"received {name!r})") from None


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def plan_buckets(tensors: list[tuple[str, str, tuple[int, ...]]], cap: int = BUCKET_BYTES) -> list[list[Entry]]:
    """Split ``(name, dtype, shape)`` records, in order, into buckets of at most ``cap`` bytes (aligned offsets from 0
    in each); a tensor larger than ``cap`` is a bucket of its own."""
    buckets: list[list[Entry]] = []
    current: list[Entry] = []
    end = 0
    for name, dtype, shape in tensors:
        entry = Entry(name, dtype, tuple(shape), _aligned(end) if current else 0)
        if current and entry.offset + entry.nbytes > cap:
            buckets.append(current)
            current, entry = [], Entry(name, dtype, tuple(shape), 0)
        current.append(entry)
        end = entry.offset + entry.nbytes
    if current:
        buckets.append(current)
    return buckets


def bucket_bytes(bucket: list[Entry]) -> int:
    """Bytes of buffer a bucket needs."""
    return max((e.offset + e.nbytes for e in bucket), default=0)


def views(buffer: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each entry: a view of the ``uint8`` ``buffer`` at its offset, dtype and shape."""
    out = []
    for e in entries:
        if e.offset < 0 or e.offset + e.nbytes > buffer.numel():
            raise ValueError(f"entries: tensor {e.name} lies at bytes {e.offset}..{e.offset + e.nbytes}, outside the "
                             f"shared buffer's {buffer.numel()} bytes")
        out.append((e.name, buffer[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)))
    return out


def describe_shared(buffer: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of a contiguous CUDA ``uint8`` buffer as plain values (what :func:`open_shared` takes in
    another process). PyTorch keeps the buffer's memory shareable while the buffer lives."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"buffer: a 1-d uint8 CUDA tensor (received {buffer.dtype} of {buffer.dim()} dims on "
                         f"{buffer.device})")
    _, args = reduce_tensor(buffer)
    (_cls, _size, _stride, tensor_offset, _storage_cls, _buffer_dtype, device, handle, storage_size, storage_offset,
     _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return {"numel": int(buffer.numel()), "tensor_offset": int(tensor_offset), "device": int(device),
            "handle": bytes(handle), "storage_size": int(storage_size), "storage_offset": int(storage_offset),
            "ref_counter_handle": bytes(ref_handle), "ref_counter_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle is not None else None,
            "event_sync_required": bool(event_sync)}


def open_shared(desc: Mapping[str, Any], device_index: int) -> torch.Tensor:
    """The buffer :func:`describe_shared` described, opened on this process's ``device_index``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, (int(desc["numel"]),), (1,), int(desc["tensor_offset"]), torch.UntypedStorage, torch.uint8,
        device_index, desc["handle"], int(desc["storage_size"]), int(desc["storage_offset"]), False,
        desc["ref_counter_handle"], int(desc["ref_counter_offset"]), desc["event_handle"],
        bool(desc["event_sync_required"]))


class IpcWeightSender:
    """The server's side: lays weights out in the shared buffer bucket by bucket and calls ``load`` for each."""

    def __init__(self, device: torch.device, dtype: torch.dtype, cap: int = BUCKET_BYTES,
                 describe: Callable[[torch.Tensor], dict[str, Any]] = describe_shared) -> None:
        self.device = device
        self.dtype = dtype  #: what floating-point tensors are cast to (the sampler's dtype)
        self.cap = cap
        self.describe = describe  #: the buffer -> what the engine core opens it by (its CUDA IPC handle)
        self.allocations = 0  #: how many buffers were made (one, unless a larger bucket came)
        self._buffer: torch.Tensor | None = None
        self._desc: dict[str, Any] | None = None

    def _target(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if tensor.is_floating_point() else tensor.dtype

    def _buffer_for(self, nbytes: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = self._desc = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._desc = self.describe(self._buffer)
            self.allocations += 1
        assert self._desc is not None
        return self._buffer, self._desc

    def send(self, weights: Mapping[str, torch.Tensor],
             load: Callable[[dict[str, Any], list[list[Any]]], int]) -> int:
        """Copy ``weights`` into the buffer bucket by bucket, calling ``load(handle, layout)`` after each; the
        number of tensors the loads report."""
        records = [(name, str(self._target(t)).removeprefix("torch."), tuple(t.shape)) for name, t in weights.items()]
        buckets = plan_buckets(records, self.cap)
        buffer, desc = self._buffer_for(max((bucket_bytes(b) for b in buckets), default=ALIGN))
        loaded = 0
        with torch.no_grad():
            for bucket in buckets:
                for (name, view) in views(buffer, bucket):
                    view.copy_(weights[name].detach())
                if buffer.is_cuda:  # the copies are done before the engine core reads them
                    torch.cuda.current_stream(self.device).synchronize()
                loaded += int(load(desc, [e.to_wire() for e in bucket]))
        return loaded

    def close(self) -> None:
        """Drop the buffer (after the engine core that opened it has gone)."""
        self._buffer = self._desc = None
