"""Seconds spent in named parts of a long piece of server work (the job warm-up's rounds), for its log line.

A part's end waits for the device first (``synchronize``, e.g.
:attr:`~arctic_rl.server.engines.device_memory.DeviceMemory.synchronize`): the work's kernels are queued, and the next
part would be charged for them otherwise. Parts may nest or repeat; each name's seconds add up.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

__all__ = ["PartTimes"]


class PartTimes:
    """Seconds by part name (``seconds``), measured with :meth:`part`."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None) -> None:
        self.synchronize = synchronize
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as part ``name`` (added to its earlier seconds)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
