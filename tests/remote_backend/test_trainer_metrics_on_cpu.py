"""The remote trainer's step metrics (``RemoteBackendTrainer._compute_metrics``): the bytes a backend released
around its sampler's sleeps and wakes, from the rollout servers and from the worker's weight syncs, become one
``perf/remote_backend/sampler_released_gib``, the sleeps a server declined ``perf/remote_backend/sampler_sleeps_declined``;
the phase seconds go to verl's ``timing_raw`` without them; the
generation phase's window (hand-over, first call, last answer, samples back) becomes ``gen/...`` entries."""

from __future__ import annotations

import pytest
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl.remote_backend.progress import StepClock
from verl.remote_backend.timings import GenerationWindow
from verl.remote_backend.trainer import RemoteBackendTrainer
from verl.remote_backend.workers.sampler_sleep import DECLINED_METRIC, RELEASED_METRIC

GIB = 1 << 30


def _trainer(monkeypatch, phases: dict, generation: dict) -> RemoteBackendTrainer:
    seen: list[tuple[dict, dict]] = []
    monkeypatch.setattr(PPOTrainerSync, "_compute_metrics",
                        lambda self, batch, metrics, timing_raw, **kw: seen.append((dict(metrics), dict(timing_raw))))
    trainer = object.__new__(RemoteBackendTrainer)  # no verl set-up: only the metric assembly runs
    trainer._step_clock, trainer.total_training_steps, trainer.seen = StepClock(), 4, seen
    monkeypatch.setattr(trainer, "_phase_timings", lambda: dict(phases), raising=False)
    monkeypatch.setattr(trainer, "_generation_timings", lambda: dict(generation), raising=False)
    return trainer


@pytest.mark.parametrize(("phases", "generation", "want"), [
    ({"update_weights/adapter": 0.1, RELEASED_METRIC: 3.0 * GIB}, {RELEASED_METRIC: 1.0 * GIB}, 4.0),
    ({"update_weights/adapter": 0.1, RELEASED_METRIC: 2.0 * GIB}, {}, 2.0),  # the weight sync's wake alone
    ({"update_weights/adapter": 0.1}, {RELEASED_METRIC: 0.0}, 0.0),
    ({"update_weights/adapter": 0.1}, {}, None),  # nobody said: no figure, not a zero
])
def test_released_bytes_from_servers_and_weight_syncs_are_one_metric(monkeypatch, capsys, phases, generation, want):
    trainer = _trainer(monkeypatch, phases, generation)
    metrics, timing_raw = {}, {"step": 1.0}
    trainer._compute_metrics(None, metrics, timing_raw, global_steps=1, epoch=0)
    (passed_metrics, passed_timing), = trainer.seen
    assert passed_metrics.get("perf/remote_backend/sampler_released_gib") == want
    assert RELEASED_METRIC not in passed_timing and passed_timing["update_weights/adapter"] == 0.1
    assert "[remote_backend]" in capsys.readouterr().out


def test_the_generation_window_reaches_timing_raw_once(monkeypatch):
    seen: list[dict] = []
    monkeypatch.setattr(PPOTrainerSync, "_compute_metrics",
                        lambda self, batch, metrics, timing_raw, **kw: seen.append(dict(timing_raw)))
    monkeypatch.setattr(PPOTrainerSync, "on_sample_end", lambda self: None)  # verl's: sleeps the replicas
    trainer = object.__new__(RemoteBackendTrainer)
    trainer._step_clock, trainer.total_training_steps = StepClock(), 4
    monkeypatch.setattr(trainer, "_phase_timings", dict, raising=False)
    answers = {"drain_call_window": [{"first_call": 100.5, "last_answer": 102.0, "answered": 8.0}],
               "collect_generation_timings": [{"gen/backend_busy": 1.2, "gen/backend_calls": 4.0}]}
    monkeypatch.setattr(trainer, "_ask_rollout_servers", lambda method: answers[method], raising=False)
    trainer._gen_window = GenerationWindow(submit_began=100.0, submit_ended=100.1)
    monkeypatch.setattr("verl.remote_backend.trainer.time.time", lambda: 102.25)
    trainer.on_sample_end()
    trainer._compute_metrics(None, {}, {"step": 3.0}, global_steps=1, epoch=0)
    assert seen[0] == pytest.approx({"step": 3.0, "gen/backend_busy": 1.2, "gen/submit": 0.1,
                                     "gen/to_first_call": 0.5, "gen/calls_span": 1.5, "gen/after_last_answer": 0.25})
    trainer._compute_metrics(None, {}, {"step": 3.0}, global_steps=2, epoch=0)  # no phase since: no window figures
    assert "gen/calls_span" not in seen[1]


def test_sleeps_a_server_declined_are_a_count_beside_the_metrics_not_a_timing(monkeypatch):
    trainer = _trainer(monkeypatch, {}, {"gen/backend_busy": 0.5, DECLINED_METRIC: 2.0})
    trainer._compute_metrics(None, {}, {"step": 1.0}, global_steps=1, epoch=0)
    (passed_metrics, passed_timing), = trainer.seen
    assert passed_metrics["perf/remote_backend/sampler_sleeps_declined"] == 2.0
    assert DECLINED_METRIC not in passed_timing and passed_timing["gen/backend_busy"] == 0.5
