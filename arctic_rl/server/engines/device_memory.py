"""The device-memory functions the samplers' sleep and wake use, and the caching allocator's unused blocks.

Between a training phase and the next generation, PyTorch's caching allocator keeps the blocks the training
passes freed: reserved, not allocated (on the SmolLM2 recipe on an H200 the server reported 9.9 GiB reserved
against 7.5 GiB allocated between calls). A sampler's KV cache woken on top of that reserve makes the generation
phase peak at both. :meth:`DeviceMemory.release_unused` hands those blocks back to the driver
(``torch.cuda.empty_cache()``) and says how much was reserved before and after, as the fields
``allocator_reserved_before_bytes``, ``allocator_reserved_after_bytes`` and ``allocator_released_bytes`` of the
samplers' sleep and wake answers.

:meth:`DeviceMemory.of` gives CUDA's functions for a CUDA device and, on CPU, functions that read 0 and do
nothing (the answers carry the fields, all 0). Tests inject their own (an engine's ``device_memory``).

:meth:`DeviceMemory.grown_outside_allocator` measures what a span of work (the vLLM engine's start) left in use on the
device that the allocator's figures cannot show; :meth:`DeviceMemory.watch` what a span used at its most while it
ran (a thread reads the device every few milliseconds), how much of that the allocator did not hold, and what the
allocator held unused when it began -- for work whose memory is gone by its end, such as a checkpoint save (on a GPU
a save's own rise was 0; the 772 MiB seen around it were the optimizer step's freed blocks, still cached:
benchmarks/RESULTS.md §2y).

What is not here: the engines' sleep and wake (:mod:`.vllm_sampler`, :mod:`.sampling`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["DeviceMemory"]


def _zero() -> int:
    return 0


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class DeviceMemory:
    """``reserved()``: bytes the caching allocator holds; ``free()``: bytes free on the device; ``empty_cache()``:
    release the allocator's unused blocks; ``synchronize()``: wait for the device's work; ``allocated()``: bytes of
    the allocator's blocks in use by tensors. ``on_device``: the functions read a device (``False`` for the CPU's,
    which read 0: nothing to poll)."""

    reserved: Callable[[], int] = _zero
    free: Callable[[], int] = _zero
    empty_cache: Callable[[], None] = _nothing
    synchronize: Callable[[], None] = _nothing
    allocated: Callable[[], int] = _zero
    on_device: bool = False

    @classmethod
    def of(cls, device: torch.device | str | None) -> DeviceMemory:
        """CUDA's functions for a CUDA ``device`` (when CUDA is in use), else the CPU's (0, nothing)."""
        device = torch.device(device) if isinstance(device, str) else device
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return cls()
        return cls(
            reserved=lambda: int(torch.cuda.memory_reserved(device)),
            free=lambda: int(torch.cuda.mem_get_info(device)[0]),
            empty_cache=torch.cuda.empty_cache,
            synchronize=lambda: torch.cuda.synchronize(device),
            allocated=lambda: int(torch.cuda.memory_allocated(device)),
            on_device=True,
        )

    def release_unused(self) -> dict[str, int]:
        """Release the caching allocator's unused blocks; the bytes it reserved before and after, and the
        difference."""
        before = int(self.reserved())
        self.empty_cache()
        after = int(self.reserved())
        return {"allocator_reserved_before_bytes": before, "allocator_reserved_after_bytes": after,
                "allocator_released_bytes": max(0, before - after)}

    def mark(self) -> tuple[int, int]:
        """``(free, reserved)`` now: the start of a span :meth:`grown_outside_allocator` measures."""
        self.synchronize()
        return int(self.free()), int(self.reserved())

    def grown_outside_allocator(self, mark: tuple[int, int]) -> int:
        """Bytes the device's use grew by since ``mark`` that the caching allocator does not hold (CUDA graphs,
        CUDA modules, NCCL's and other libraries' own buffers): the drop in free memory minus the growth of the
        allocator's reserve."""
        self.synchronize()
        free_before, reserved_before = mark
        return (free_before - int(self.free())) - (int(self.reserved()) - reserved_before)

    @contextmanager
    def watch(self, interval_s: float = 0.005) -> Iterator[dict[str, int]]:
        """Around a span of work: the dict it yields is filled when the span ends, in bytes, with
        ``grown_max`` (the most the device's use rose above its level at the start, from the drop in free memory),
        ``grown_outside_allocator_max`` (the most of such a rise the caching allocator's reserve did not account
        for), ``reserved_grown_max`` (the reserve's own largest rise), ``grown_after`` (the rise left at the end) and
        ``unused_reserved_at_start`` (what the allocator held at the start beyond its tensors: freed blocks it keeps
        cached, in use on the device before the span began, so no rise shows them). A thread reads ``free()`` and
        ``reserved()`` every ``interval_s`` seconds (only ``on_device``), so a rise shorter than that can be missed; the
        ends are read after ``synchronize()``."""
        figures: dict[str, int] = {}
        free0, reserved0 = self.mark()
        unused0 = max(0, reserved0 - int(self.allocated()))
        peaks = {"grown_max": 0, "grown_outside_allocator_max": 0, "reserved_grown_max": 0}
        stop = threading.Event()

        def read() -> None:
            grown, reserved_grown = free0 - int(self.free()), int(self.reserved()) - reserved0
            peaks["grown_max"] = max(peaks["grown_max"], grown)
            peaks["reserved_grown_max"] = max(peaks["reserved_grown_max"], reserved_grown)
            peaks["grown_outside_allocator_max"] = max(peaks["grown_outside_allocator_max"], grown - reserved_grown)

        def poll() -> None:
            while not stop.wait(interval_s):
                read()

        reader = threading.Thread(target=poll, name="device-memory-watch", daemon=True) if self.on_device else None
        if reader is not None:
            reader.start()
        try:
            yield figures
        finally:
            stop.set()
            if reader is not None:
                reader.join()
            self.synchronize()
            read()
            figures.update(peaks, grown_after=free0 - int(self.free()), unused_reserved_at_start=unused0)

    def unchanged(self) -> dict[str, int]:
        """The same fields when nothing is released (nothing woke)."""
        now = int(self.reserved())
        return {"allocator_reserved_before_bytes": now, "allocator_reserved_after_bytes": now,
                "allocator_released_bytes": 0}
