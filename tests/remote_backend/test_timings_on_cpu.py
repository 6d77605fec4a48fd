"""The per-phase split of a step's seconds: call sums, phase sums and the busy clock of overlapping calls."""

from __future__ import annotations

import threading

import pytest

from verl.remote_backend.timings import (
    PHASE_OF_METHOD,
    BusyClock,
    CallTimes,
    CallTotals,
    CallWindow,
    GenerationWindow,
    PhaseTimes,
)


def test_call_times_sum_and_drain():
    times = CallTimes()
    times.record(0.5, 0.25)
    times.record(0.25, None)  # a server that does not say
    totals = times.drain()
    assert totals == CallTotals(calls=2, wall_s=0.75, server_s=0.25, server_reported=1)
    assert times.drain() == CallTotals()
    assert CallTotals.from_mapping(totals.as_mapping()) == totals


def test_call_times_are_thread_safe():
    times = CallTimes()

    def record() -> None:
        for _ in range(1000):
            times.record(0.001, 0.0005)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    totals = times.drain()
    assert totals.calls == 4000 and totals.server_reported == 4000
    assert totals.wall_s == pytest.approx(4.0) and totals.server_s == pytest.approx(2.0)


def test_phase_times_leave_out_what_nobody_reported():
    phases = PhaseTimes()
    phases.add("update_actor", 1.0, CallTotals(calls=2, wall_s=0.8, server_s=0.6, server_reported=2))
    phases.add("update_actor", 0.5, CallTotals(calls=1, wall_s=0.4, server_s=0.3, server_reported=1))
    phases.add("old_log_prob", 0.2, CallTotals(calls=1, wall_s=0.1))  # the vendor's server: no seconds
    phases.add("ref", 0.3, None)  # a backend that reports no calls
    assert phases.collect() == pytest.approx({
        "update_actor/adapter": 1.5, "update_actor/http": 1.2, "update_actor/server": 0.9,
        "old_log_prob/adapter": 0.2, "old_log_prob/http": 0.1,
        "ref/adapter": 0.3,
    })
    assert phases.collect() == {}


def test_phase_names_are_verls_timer_names():
    assert PHASE_OF_METHOD == {"compute_log_prob": "old_log_prob", "compute_ref_log_prob": "ref",
                               "update_actor": "update_actor", "update_weights": "update_weights"}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_clock_counts_overlaps_once():
    clock = _Clock()
    busy = BusyClock(clock)
    busy.begin()            # t=0: call A
    clock.now = 1.0
    busy.begin()            # t=1: call B joins
    clock.now = 2.0
    busy.end()              # t=2: A ends, B still running
    clock.now = 3.0
    busy.end()              # t=3: B ends -> busy 0..3
    clock.now = 10.0
    busy.begin()            # t=10: call C, still running at collect
    clock.now = 10.5
    assert busy.collect() == (pytest.approx(3.5), 3)
    clock.now = 11.0
    busy.end()
    assert busy.collect() == (pytest.approx(0.5), 0)  # C's second half; no call began since


def test_busy_clock_refuses_an_unmatched_end():
    with pytest.raises(RuntimeError, match="without a matching begin"):
        BusyClock().end()


def test_call_window_stamps_the_first_arrival_and_the_last_answer():
    clock = _Clock()
    window = CallWindow(clock)
    assert window.drain() == {}
    clock.now = 1.0
    window.arrived()        # A arrives
    clock.now = 1.5
    window.arrived()        # B arrives: not the first
    clock.now = 2.0
    window.answered()       # A answered
    clock.now = 4.0
    window.answered()       # B answered: the last
    assert window.drain() == {"first_call": 1.0, "last_answer": 4.0, "answered": 2.0}
    assert window.drain() == {}  # drained
    clock.now = 5.0
    window.arrived()        # still running at the drain: no answer yet, no window
    assert window.drain() == {}


def test_generation_window_splits_the_phase_by_its_stamps():
    window = GenerationWindow(submit_began=10.0, submit_ended=10.2)
    assert window.timings() == {}  # not closed
    window.close(14.0, [{"first_call": 10.5, "last_answer": 13.0, "answered": 4.0},
                        {"first_call": 10.4, "last_answer": 13.5, "answered": 4.0}, {}])
    assert window.timings() == pytest.approx({"gen/submit": 0.2, "gen/to_first_call": 0.4,
                                              "gen/calls_span": 3.1, "gen/after_last_answer": 0.5})


@pytest.mark.parametrize("windows", [
    [],                                                   # no server answered (another replica kind)
    [{"first_call": 9.0, "last_answer": 13.0}],           # a call from before the hand-over (not this phase's)
    [{"first_call": 10.5, "last_answer": 15.0}],          # answered after the samples were back (asynchronous)
])
def test_generation_window_says_nothing_for_calls_outside_the_phase(windows):
    window = GenerationWindow(submit_began=10.0, submit_ended=10.2)
    window.close(14.0, windows)
    assert window.timings() == {}
