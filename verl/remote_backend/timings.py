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
  least one call was in flight, which is what the backend cost the generation phase;
* :class:`CallWindow` and :class:`GenerationWindow` -- where the rest of a synchronous generation phase goes: a
  rollout server stamps the first of verl's calls to reach it and its last answer (wall clock), and the trainer
  sets them against the moments it handed the batch to verl's agent loop and got the samples back
  (``gen/submit``, ``gen/to_first_call``, ``gen/calls_span``, ``gen/after_last_answer``).

A backend offers its transport's times through :class:`~verl.remote_backend.protocols.ReportsCallTimes`;
one that does not still gets ``<phase>/adapter``. A server that does not report its seconds (the vendor's)
leaves ``<phase>/server`` out rather than reporting zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PHASE_OF_METHOD", "BusyClock", "CallTimes", "CallTotals", "CallWindow", "GenerationWindow", "PhaseTimes"]

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


class CallWindow:
    """Wall-clock stamps of a rollout server's calls since the last drain: when the first arrived and when the
    last was answered (``time.time``, comparable with the trainer's stamps on one machine)."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._first: float | None = None
        self._last: float | None = None
        self._answered = 0

    def arrived(self) -> None:
        with self._lock:
            if self._first is None:
                self._first = self._clock()

    def answered(self) -> None:
        with self._lock:
            self._last = self._clock()
            self._answered += 1

    def drain(self) -> dict[str, float]:
        """``{"first_call": t, "last_answer": t, "answered": n}`` since the last drain (``{}`` when no call was
        answered), and start again."""
        with self._lock:
            first, last, answered = self._first, self._last, self._answered
            self._first, self._last, self._answered = None, None, 0
        if first is None or last is None:
            return {}
        return {"first_call": first, "last_answer": last, "answered": float(answered)}


@dataclass
class GenerationWindow:
    """One synchronous generation phase seen from the trainer (wall clock, seconds since the epoch).

    ``submit_began``/``submit_ended`` bracket verl's hand-over of the batch to its agent loop (``prepare_step``, in
    the step but before verl's ``gen`` timer starts); ``sampled`` is when verl's replay buffer returned the samples
    (``on_sample_end``, before the sampler is put to sleep); ``first_call``/``last_answer`` come from the rollout
    servers' :class:`CallWindow` (earliest and latest over servers)."""

    submit_began: float
    submit_ended: float
    sampled: float | None = None
    first_call: float | None = None
    last_answer: float | None = None

    def close(self, sampled: float, windows: list[Mapping[str, float]]) -> None:
        """The samples are back at ``sampled``; ``windows`` are the servers' drained :class:`CallWindow` s."""
        self.sampled = sampled
        firsts = [w["first_call"] for w in windows if "first_call" in w]
        lasts = [w["last_answer"] for w in windows if "last_answer" in w]
        self.first_call = min(firsts) if firsts else None
        self.last_answer = max(lasts) if lasts else None

    def timings(self) -> dict[str, float]:
        """``timing_raw`` entries: ``gen/submit`` (verl handing the batch over), ``gen/to_first_call`` (from the
        hand-over's start to the first call reaching a server: verl's agent loop before its first request),
        ``gen/calls_span`` (first call to last answer) and ``gen/after_last_answer`` (last answer to verl's replay
        buffer returning the samples: verl's post-processing, TransferQueue writes and polling). Empty until the
        phase closed with calls inside it (a phase whose calls straddle it, as in asynchronous mode, says nothing)."""
        if self.sampled is None or self.first_call is None or self.last_answer is None:
            return {}
        if not self.submit_began <= self.first_call <= self.last_answer <= self.sampled:
            return {}
        return {
            "gen/submit": self.submit_ended - self.submit_began,
            "gen/to_first_call": self.first_call - self.submit_began,
            "gen/calls_span": self.last_answer - self.first_call,
            "gen/after_last_answer": self.sampled - self.last_answer,
        }
