"""Where a phase's seconds go: the forwarder worker's, the transport's and the server's own.

verl times each phase of a step from the driver (``timing_s/old_log_prob``, ``timing_s/update_actor``, ...).
Through a remote backend that time splits into verl's own work and the Ray hop to the forwarder worker, the
adapter's work in the worker (layout, encoding), the transport (HTTP) and the server's compute. This module
measures the inner three so that every run's metrics show the split:

* :class:`CallTimes` -- an adapter's transport records each call's wall seconds and, when the server says
  (the reference server's ``Server-Timing`` header), the server's own seconds; the worker drains it after each
  forwarded call;
* :class:`PhaseTimes` -- the worker's per-phase sums since the driver last asked, as ``timing_raw`` entries
  ``<phase>/worker`` (the worker method as Ray runs it: verl's TransferQueue bridge reading the batch and writing
  the answer back, around the adapter's call), ``<phase>/adapter``, ``<phase>/http`` and ``<phase>/server``
  (verl's ``compute_timing_metrics`` turns them into ``timing_s/<phase>/worker`` ...);
* :class:`BusyClock` -- for calls that overlap (a rollout server's generate calls): the time during which at
  least one call was in flight, which is what the backend cost the generation phase.

A backend offers its transport's times through :class:`~verl.remote_backend.protocols.ReportsCallTimes`;
one that does not still gets ``<phase>/adapter``. A server that does not report its seconds (the vendor's)
leaves ``<phase>/server`` out rather than reporting zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PHASE_OF_METHOD", "BusyClock", "CallTimes", "CallTotals", "PhaseTimes"]

#: forwarder worker method -> verl's name of the phase it serves (the driver's ``marked_timer`` names)
PHASE_OF_METHOD = {
    "compute_log_prob": "old_log_prob",
    "compute_ref_log_prob": "ref",
    "update_actor": "update_actor",
    "update_weights": "update_weights",
}


@dataclass(frozen=True)
class CallTotals:
    """What a transport did since it was last drained."""

    calls: int = 0
    #: wall seconds of the calls, retries and waits between them included
    wall_s: float = 0.0
    #: the server's own seconds, summed over the calls that reported them
    server_s: float = 0.0
    #: calls whose answer carried the server's seconds
    server_reported: int = 0

    def as_mapping(self) -> dict[str, float]:
        return {
            "calls": float(self.calls),
            "wall_s": self.wall_s,
            "server_s": self.server_s,
            "server_reported": float(self.server_reported),
        }

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> CallTotals:
        return cls(
            calls=int(values.get("calls", 0)),
            wall_s=float(values.get("wall_s", 0.0)),
            server_s=float(values.get("server_s", 0.0)),
            server_reported=int(values.get("server_reported", 0)),
        )


class CallTimes:
    """Thread-safe sums of a transport's calls; :meth:`drain` returns them and starts again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = CallTotals()

    def record(self, wall_s: float, server_s: float | None) -> None:
        with self._lock:
            t = self._totals
            self._totals = CallTotals(
                calls=t.calls + 1,
                wall_s=t.wall_s + max(0.0, wall_s),
                server_s=t.server_s + (server_s if server_s is not None else 0.0),
                server_reported=t.server_reported + (1 if server_s is not None else 0),
            )

    def drain(self) -> CallTotals:
        with self._lock:
            totals, self._totals = self._totals, CallTotals()
        return totals


class PhaseTimes:
    """The worker's seconds per phase since the driver last collected them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}

    def add(self, phase: str, adapter_s: float, calls: CallTotals | None) -> None:
        """One forwarded call of ``phase``: its seconds in the worker and what its transport reported."""
        with self._lock:
            self._bump(f"{phase}/adapter", adapter_s)
            if calls is not None and calls.calls:
                self._bump(f"{phase}/http", calls.wall_s)
                if calls.server_reported:
                    self._bump(f"{phase}/server", calls.server_s)

    def add_worker(self, phase: str, seconds: float) -> None:
        """One call of the worker method serving ``phase``, verl's TransferQueue bridge included."""
        with self._lock:
            self._bump(f"{phase}/worker", seconds)

    def _bump(self, key: str, seconds: float) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + seconds

    def collect(self) -> dict[str, float]:
        """The sums as ``timing_raw`` entries, and start again."""
        with self._lock:
            sums, self._sums = self._sums, {}
        return sums


class BusyClock:
    """Seconds during which at least one of possibly overlapping calls was in flight."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._busy_s = 0.0
        self._calls = 0

    def begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = self._clock()
            self._in_flight += 1
            self._calls += 1

    def end(self) -> None:
        with self._lock:
            if self._in_flight <= 0:
                raise RuntimeError("BusyClock.end() without a matching begin()")
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_s += self._clock() - self._since

    def collect(self) -> tuple[float, int]:
        """(busy seconds, calls begun) since the last collect; a call still in flight counts up to now."""
        with self._lock:
            now = self._clock()
            busy = self._busy_s + (now - self._since if self._in_flight else 0.0)
            calls = self._calls
            self._busy_s, self._calls = 0.0, 0
            if self._in_flight:
                self._since = now
        return busy, calls
