"""Tests of verl.remote_backend.progress: the one-line per-step progress summary."""

from __future__ import annotations

import numpy as np
import pytest

from verl.remote_backend.progress import PHASES, StepClock, format_duration, format_progress


def test_full_step_line():
    metrics = {
        "critic/score/mean": np.float32(0.5123),
        "timing_s/gen": 1.23,
        "timing_s/reward": 0.01,  # bookkeeping under 0.05 s is left out
        "timing_s/old_log_prob": 0.31,
        "timing_s/adv": 0.002,
        "timing_s/update_actor": 0.84,
        "timing_s/update_weights": 0.12,
        "timing_s/step": 3.06,
        "actor/pg_loss": 0.7,  # everything else is ignored
    }
    expected = "step 7/40 | reward 0.512 | gen 1.2s lp 0.3s upd 0.8s sync 0.1s | 3.1 s/step"
    assert format_progress(metrics, 7, 40) == expected


def test_partial_and_unknown_total():
    assert format_progress({}, 3, None) == "step 3"
    assert format_progress({"critic/score/mean": 0.25}, 1, 0) == "step 1 | reward 0.250"
    assert format_progress({"timing_s/step": 2.0, "timing_s/ref": 0.4}, 2, 5) == "step 2/5 | ref 0.4s | 2.0 s/step"


def test_non_numbers_and_nan_are_skipped():
    metrics = {"critic/score/mean": float("nan"), "timing_s/gen": "fast", "timing_s/update_actor": True,
               "timing_s/step": np.float64(1.0)}
    assert format_progress(metrics, 1, 2) == "step 1/2 | 1.0 s/step"


def test_phases_follow_a_step_in_order():
    labels = [label for label, _ in PHASES]
    assert labels.index("gen") < labels.index("lp") < labels.index("upd") < labels.index("sync")
    assert all(key.startswith("timing_s/") for _, key in PHASES)


@pytest.mark.parametrize("metrics, step, total, match", [
    ([], 1, 2, "metrics"),
    ({}, -1, 2, "step"),
    ({}, 1.5, 2, "step"),
    ({}, 1, -3, "total"),
    ({}, 1, "10", "total"),
])
def test_bad_arguments_name_the_parameter(metrics, step, total, match):
    with pytest.raises((TypeError, ValueError), match=match):
        format_progress(metrics, step, total)


def test_eta_is_the_mean_step_time_times_the_steps_left():
    clock = StepClock()
    assert clock.eta_s(0, 40) is None  # no step measured yet
    clock.add({"timing_s/step": 10.0})
    clock.add({"critic/score/mean": 0.5})  # a step without its timing is not counted
    clock.add({"timing_s/step": 20.0})
    assert clock.eta_s(2, 40) == pytest.approx(15.0 * 38)
    assert clock.eta_s(40, 40) is None and clock.eta_s(2, None) is None
    line = format_progress({"timing_s/step": 20.0}, 2, 40, eta_s=clock.eta_s(2, 40))
    assert line == "step 2/40 | 20.0 s/step | ETA 9m30s"


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (185, "3m05s"), (7620, "2h07m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("eta", [-1.0, float("nan"), "5", True])
def test_bad_eta_names_the_parameter(eta):
    with pytest.raises(ValueError, match="eta_s"):
        format_progress({}, 1, 2, eta_s=eta)
