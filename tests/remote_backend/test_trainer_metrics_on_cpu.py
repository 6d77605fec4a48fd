"""The remote trainer's step metrics (``RemoteBackendTrainer._compute_metrics``): the bytes a backend released
around its sampler's sleeps and wakes, from the rollout servers and from the worker's weight syncs, become one
``perf/remote_backend/sampler_released_gib``; the phase seconds go to verl's ``timing_raw`` without them."""

from __future__ import annotations

import pytest
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl.remote_backend.progress import StepClock
from verl.remote_backend.trainer import RemoteBackendTrainer
from verl.remote_backend.workers.sampler_sleep import RELEASED_METRIC

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
