"""``DeviceMemory.watch``: the device memory a span of work used at its most, the part of it PyTorch's caching
allocator did not hold, and the freed blocks the allocator kept cached when the span began (no GPU here: ``free()``,
``reserved()`` and ``allocated()`` read a fake device that the span's work changes while the watch's thread reads
it)."""

from __future__ import annotations

import threading
import time

import torch

from arctic_rl.server.engines.device_memory import DeviceMemory

MIB = 1 << 20


class FakeDevice:
    """80 GiB free at the start, 6 GiB reserved by the allocator, 5 GiB of it in tensors; counts the reads of its free
    memory."""

    def __init__(self) -> None:
        self.free_bytes, self.reserved_bytes, self.allocated_bytes, self.reads = 80 << 30, 6 << 30, 5 << 30, 0

    def free(self) -> int:
        self.reads += 1
        return self.free_bytes

    def memory(self) -> DeviceMemory:
        return DeviceMemory(reserved=lambda: self.reserved_bytes, free=self.free,
                            allocated=lambda: self.allocated_bytes, on_device=True)

    def read_twice(self) -> None:
        """Wait until the watch's thread has read the device twice more (a loaded machine may delay it)."""
        until, deadline = self.reads + 2, time.monotonic() + 10
        while self.reads < until and time.monotonic() < deadline:
            time.sleep(0.001)


def test_a_transient_rise_outside_the_allocator_is_seen_though_it_is_gone_at_the_end():
    dev = FakeDevice()
    with dev.memory().watch(interval_s=0.002) as seen:
        assert seen == {}  # filled at the end
        dev.free_bytes -= 772 * MIB  # a driver-level allocation (a library's buffer), not the allocator's
        dev.read_twice()
        dev.free_bytes += 520 * MIB
        dev.read_twice()
        dev.free_bytes += 252 * MIB
    assert seen == {"grown_max": 772 * MIB, "grown_outside_allocator_max": 772 * MIB, "reserved_grown_max": 0,
                    "grown_after": 0, "unused_reserved_at_start": 1 << 30}


def test_a_rise_the_allocator_holds_is_not_counted_outside_it_and_what_stays_is_reported():
    dev = FakeDevice()
    with dev.memory().watch(interval_s=0.002) as seen:
        dev.reserved_bytes += 512 * MIB  # the allocator took a new segment (its count first: the watch reads free
        dev.free_bytes -= 512 * MIB  # memory, then the reserve, so no read sees this rise outside the allocator)
        dev.read_twice()
        dev.free_bytes -= 100 * MIB  # and 100 MiB outside it, which stay
        dev.read_twice()
    assert seen == {"grown_max": 612 * MIB, "grown_outside_allocator_max": 100 * MIB,
                    "reserved_grown_max": 512 * MIB, "grown_after": 612 * MIB, "unused_reserved_at_start": 1 << 30}


def test_blocks_cached_before_the_span_show_as_unused_at_its_start_not_as_a_rise():
    """What a GPU showed (benchmarks/RESULTS.md §2y): the optimizer step's freed blocks, still cached when a save
    began, kept the device's use 772 MiB up during the save, which itself allocated nothing."""
    dev = FakeDevice()
    dev.allocated_bytes -= 772 * MIB  # the step freed its flat gradient copies; the allocator keeps the blocks
    with dev.memory().watch(interval_s=0.002) as seen:
        dev.read_twice()
    assert seen["grown_max"] == seen["reserved_grown_max"] == seen["grown_after"] == 0
    assert seen["unused_reserved_at_start"] == (1 << 30) + 772 * MIB


def test_the_end_is_read_even_when_the_span_is_shorter_than_one_poll():
    dev = FakeDevice()
    with dev.memory().watch(interval_s=10.0) as seen:
        dev.free_bytes -= 64 * MIB
    assert seen["grown_max"] == seen["grown_after"] == 64 * MIB


def test_on_a_cpu_device_every_figure_is_zero_and_nothing_polls():
    with DeviceMemory.of(torch.device("cpu")).watch() as seen:
        torch.ones(1000).sum()
        assert not any(t.name == "device-memory-watch" for t in threading.enumerate())  # a CPU save: no thread
    assert seen == {"grown_max": 0, "grown_outside_allocator_max": 0, "reserved_grown_max": 0, "grown_after": 0,
                    "unused_reserved_at_start": 0}
