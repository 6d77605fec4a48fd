"""``DeviceMemory.watch``: the device memory a span of work used at its most, and the part of it PyTorch's
caching allocator did not hold (no GPU here: ``free()`` and ``reserved()`` read a fake device that the span's work
changes while the watch's thread reads it)."""

from __future__ import annotations

import time

import torch

from arctic_rl.server.engines.device_memory import DeviceMemory

MIB = 1 << 20


class FakeDevice:
    """80 GiB free at the start, 6 GiB reserved by the allocator; counts the reads of its free memory."""

    def __init__(self) -> None:
        self.free_bytes, self.reserved_bytes, self.reads = 80 << 30, 6 << 30, 0

    def free(self) -> int:
        self.reads += 1
        return self.free_bytes

    def memory(self) -> DeviceMemory:
        return DeviceMemory(reserved=lambda: self.reserved_bytes, free=self.free)

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
                    "grown_after": 0}


def test_a_rise_the_allocator_holds_is_not_counted_outside_it_and_what_stays_is_reported():
    dev = FakeDevice()
    with dev.memory().watch(interval_s=0.002) as seen:
        dev.reserved_bytes += 512 * MIB  # the allocator took a new segment (its count first: the watch reads free
        dev.free_bytes -= 512 * MIB  # memory, then the reserve, so no read sees this rise outside the allocator)
        dev.read_twice()
        dev.free_bytes -= 100 * MIB  # and 100 MiB outside it, which stay
        dev.read_twice()
    assert seen == {"grown_max": 612 * MIB, "grown_outside_allocator_max": 100 * MIB,
                    "reserved_grown_max": 512 * MIB, "grown_after": 612 * MIB}


def test_the_end_is_read_even_when_the_span_is_shorter_than_one_poll():
    dev = FakeDevice()
    with dev.memory().watch(interval_s=10.0) as seen:
        dev.free_bytes -= 64 * MIB
    assert seen["grown_max"] == seen["grown_after"] == 64 * MIB


def test_on_a_cpu_device_every_figure_is_zero():
    with DeviceMemory.of(torch.device("cpu")).watch() as seen:
        torch.ones(1000).sum()
    assert seen == {"grown_max": 0, "grown_outside_allocator_max": 0, "reserved_grown_max": 0, "grown_after": 0}
