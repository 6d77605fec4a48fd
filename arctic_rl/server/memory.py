"""Where a job's memory goes: its parts by bytes, from the tensors it holds and, on CUDA, the allocator.

Each engine keeps a :class:`JobMemory`. Its :meth:`JobMemory.report` lists, in bytes:

* ``weights`` -- the model's parameters as the job holds them (under ZeRO-3, this process's partitions);
* ``gradients`` -- the ``.grad`` tensors of the model and of the optimizer's own (fp32) parameters, and
  DeepSpeed's flat gradient buffers;
* ``master_weights`` -- the optimizer's parameter copies that are not the model's (DeepSpeed's fp32
  master weights under bf16, ZeRO's flat partitions);
* ``optimizer_state`` -- the optimizer's state tensors (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``);
* ``largest_logits``, ``largest_logits_fp32_chunk``, ``largest_hidden_states`` -- the largest of these buffers any
  pass of the job has held at once: the LM head's output (rows x positions x vocab x dtype), the fp32 chunk
  the log-softmax upcasts, and the hidden states the chunked LM head runs on
  (:mod:`arctic_rl.server.compute.chunked_head`), as the passes report them through :func:`note_buffer`;
* on CUDA only: ``call_peak`` (the allocator's peak during the job's last call), ``call_transient`` (that
  peak minus what was allocated when the call began: the pass's activations, logits and temporaries) and,
  for the process, ``device_max_allocated``, ``device_allocated`` and ``device_reserved`` (the caching
  allocator's reserve), and ``device_in_use``: the device's memory in use by everything, as the driver counts it
  (CUDA contexts, memory no PyTorch allocator counts such as vLLM's sleep-mode pool, other processes);
  ``device_in_use`` minus ``device_reserved`` is what the allocator's figures do not see. On CPU these parts are
  absent, not zero: nothing measures them there.

Each byte is counted once (views of one flat buffer count the union of their spans), in the first part
that holds it, and a part no tensor backs is absent. Parts held on the
host (offloaded optimizer state or parameters) are counted with the rest and listed under ``offloaded``
too. The peaks are per process: calls of two jobs that run at the same time share them. A sampling job
reports ``weights`` (and, for the vLLM sampler, ``kv_cache``: the cache tensors its worker allocated, and
``startup_outside_allocator``: what vLLM's start left in use on the device outside PyTorch's allocator -- NCCL
communicators, CUDA graphs, modules, libraries' own buffers) plus the device figures.

What is not here: HTTP (``/status`` and the call metrics carry :meth:`JobMemory.report`), the engines.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "GIB", "JobMemory", "device_peak", "device_report", "job_memory", "memory_metrics", "note_buffer", "report_gib",
    "restore_device_peak", "tensor_bytes", "vllm_worker_parts",
]

GIB = float(1 << 30)
_LOCAL = threading.local()
_DEVICE_PEAK = {"bytes": 0}
_DEVICE_LOCK = threading.Lock()


def _span(t: torch.Tensor) -> tuple[tuple[str, int], int, int]:
    """``(storage key, first byte, end byte)`` of the memory ``t`` covers (offsets within its storage)."""
    size = t.numel() * t.element_size()
    try:
        base = int(t.untyped_storage().data_ptr())
        start = int(t.data_ptr()) - base
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, some wrappers)
        return (str(t.device), id(t)), 0, size
    return (str(t.device), base), start, start + size


def _covered(intervals: list[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """Bytes covered by the union of ``[start, end)`` intervals, and the merged intervals."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return sum(end - start for start, end in merged), merged


def tensor_bytes(tensors: Iterable[Any], seen: dict | None = None) -> tuple[int, int]:
    """``(bytes, bytes on the host)`` of the memory ``tensors`` cover, each byte once (views of one buffer --
    DeepSpeed's flat buffers and the parameters that are slices of them -- count the union of their spans;
    non-tensors are skipped). ``seen`` carries what earlier calls counted, which is not counted again."""
    seen = {} if seen is None else seen
    new: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            key, start, end = _span(t)
            new.setdefault(key, []).append((start, end))
    total = host = 0
    for key, spans in new.items():
        before, _ = _covered(seen.get(key, []))
        after, merged = _covered(seen.get(key, []) + spans)
        seen[key] = merged
        total += after - before
        host += (after - before) if key[0] == "cpu" else 0
    return total, host


def note_buffer(name: str, nbytes: int) -> None:
    """Record that a pass holds a ``name`` buffer of ``nbytes`` (kept as the job's largest; no-op outside a call)."""
    tracker = getattr(_LOCAL, "tracker", None)
    if tracker is not None:
        key = f"largest_{name}"
        tracker.buffers[key] = max(int(nbytes), tracker.buffers.get(key, 0))


def _cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda" and torch.cuda.is_available()


def device_peak() -> int:
    """The process's device peak the reports carry, in bytes (the highest :func:`device_report` has seen)."""
    with _DEVICE_LOCK:
        return _DEVICE_PEAK["bytes"]


def restore_device_peak(value: int) -> None:
    """Set the process's device peak back to ``value``: after work that must not count, such as a job's warm-up."""
    with _DEVICE_LOCK:
        _DEVICE_PEAK["bytes"] = int(value)


def device_report(device: torch.device | None) -> dict[str, int]:
    """The process's CUDA allocator figures for ``device`` (bytes); empty on CPU."""
    if not _cuda(device):
        return {}
    with _DEVICE_LOCK:
        _DEVICE_PEAK["bytes"] = max(_DEVICE_PEAK["bytes"], int(torch.cuda.max_memory_allocated(device)))
        free, total = torch.cuda.mem_get_info(device)
        return {
            "device_allocated": int(torch.cuda.memory_allocated(device)),
            "device_max_allocated": _DEVICE_PEAK["bytes"],
            "device_reserved": int(torch.cuda.memory_reserved(device)),
            "device_in_use": int(total - free),
        }


def _flat(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in list(value):
            yield from _flat(item)
    elif isinstance(value, dict):
        for item in list(value.values()):  # a copy: an optimizer step may add state meanwhile (/status's thread)
            yield from _flat(item)


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    seen = 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and seen < 4:
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


#: attributes of DeepSpeed's optimizer wrappers holding gradient buffers (bf16 and ZeRO 1-3 optimizers)
_DS_GRAD_ATTRS = ("fp32_groups_gradients_flat", "averaged_gradients", "ipg_buffer", "grads_in_partition",
                  "fp32_partitioned_groups_flat_grads", "all_grad_tensors", "grad_partitions_flat_buffer")


class JobMemory:
    """A job's memory report (module docstring): the model, its optimizer and the buffers of its passes."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.buffers: dict[str, int] = {}
        self.call: dict[str, int] = {}

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Around one call: buffers noted in this thread count for this job; on CUDA, the call's peak."""
        previous = getattr(_LOCAL, "tracker", None)
        _LOCAL.tracker = self
        cuda = _cuda(self.device)
        if cuda:
            device_report(self.device)  # keep the process's peak before resetting the counter
            start = int(torch.cuda.memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            _LOCAL.tracker = previous
            if cuda:
                peak = int(torch.cuda.max_memory_allocated(self.device))
                self.call = {"call_peak": peak, "call_transient": max(0, peak - start)}
                device_report(self.device)

    def report(self, model: torch.nn.Module | None, optimizer: Any = None) -> dict[str, int]:
        """The parts in bytes (absent where nothing backs them)."""
        seen: dict = {}
        parts: dict[str, int] = {}
        offloaded = 0

        def put(name: str, tensors: Iterable[Any]) -> None:
            nonlocal offloaded
            total, host = tensor_bytes(tensors, seen)
            if total:
                parts[name] = total
                offloaded += host if _cuda(self.device) else 0

        params = list(model.parameters()) if model is not None else []
        # ZeRO-3 keeps each parameter's partition in ``ds_tensor`` (the parameter itself is empty between passes)
        put("weights", [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p for p in params])
        inner = _inner_optimizer(optimizer)
        opt_params = [p for g in inner.param_groups for p in g["params"]] if inner is not None else []
        grads = [p.grad for p in params] + [p.grad for p in opt_params]
        if optimizer is not None:
            grads += [t for name in _DS_GRAD_ATTRS for t in _flat(getattr(optimizer, name, None))]
        put("gradients", grads)
        put("master_weights", opt_params)
        if inner is not None:
            put("optimizer_state", (t for state in list(inner.state.values()) for t in _flat(state)))
        parts.update(self.buffers)
        parts.update(self.call)
        parts.update(device_report(self.device))
        if offloaded:
            parts["offloaded"] = offloaded
        return parts


def report_gib(parts: dict[str, int], prefix: str) -> dict[str, float]:
    """``{<prefix><part>_gib: GiB}`` of a report."""
    return {f"{prefix}{name}_gib": round(value / GIB, 6) for name, value in parts.items()}


def vllm_worker_parts(worker: Any) -> dict[str, int]:
    """``weights`` and ``kv_cache`` bytes of a vLLM worker's model runner (its model's parameters and the KV
    cache tensors it allocated; vLLM frees their memory while it sleeps, the tensors stay)."""
    runner = worker.model_runner
    parts: dict[str, int] = {}
    for name, tensors in (("weights", runner.model.parameters()), ("kv_cache", _flat(getattr(runner, "kv_caches", None)))):
        total, _ = tensor_bytes(tensors)
        if total:
            parts[name] = total
    return parts


def job_memory(engine: Any) -> dict[str, int]:
    """A job's report: its engine's ``memory_report()`` (the engines' Protocol,
    :mod:`arctic_rl.server.engines.protocols`), or nothing if that fails: a report must not fail a call."""
    try:
        return dict(engine.memory_report())
    except Exception:  # noqa: BLE001 -- a report must never fail a call or /status
        return {}


def memory_metrics(jobs: Iterable[Any]) -> dict[str, float]:
    """``memory/<job type>/<part>_gib`` of every job with an engine (the names the adapter passes on to verl)."""
    out: dict[str, float] = {}
    for job in jobs:
        engine = getattr(job, "engine", None)
        if engine is not None:
            out.update(report_gib(job_memory(engine), f"memory/{job.job_type.value}/"))
    return out
