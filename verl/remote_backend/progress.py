"""One concise progress line per training step, built from the metrics dict verl logs.

verl's console logger prints every metric of a step (~100 keys), which buries the two things a person
watching a run wants: is the reward going up, and where does the time go. This module formats::

    step 7/40 | reward 0.512 | gen 1.2s lp 0.3s upd 0.8s sync 0.1s | 3.1 s/step | ETA 1m42s

from the keys verl's trainers already produce (``critic/score/mean``; ``timing_s/<phase>`` from
``marked_timer`` in ``verl/trainer/ppo/ray_trainer.py`` and ``verl/trainer/ppo/v1/trainer_base.py``).
Phases a step did not run (no ``ref`` without a KL term) are left out. It only formats (and keeps
the running mean behind the ETA, :class:`StepClock`); the trainer decides when to print.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["PHASES", "REWARD_KEY", "STEP_TIME_KEY", "StepClock", "format_duration", "format_progress"]

#: Mean sequence reward of the step's rollouts.
REWARD_KEY = "critic/score/mean"
#: Wall time of the whole step.
STEP_TIME_KEY = "timing_s/step"
#: (short label, verl timing key) in the order a GRPO/PPO step runs them.
PHASES: tuple[tuple[str, str], ...] = (
    ("gen", "timing_s/gen"),
    ("rew", "timing_s/reward"),
    ("lp", "timing_s/old_log_prob"),
    ("ref", "timing_s/ref"),
    ("val", "timing_s/values"),
    ("adv", "timing_s/adv"),
    ("crit", "timing_s/update_critic"),
    ("upd", "timing_s/update_actor"),
    ("sync", "timing_s/update_weights"),
    ("ckpt", "timing_s/save_checkpoint"),
    ("test", "timing_s/testing"),
)
# Phases shown only when they took noticeable time (they are near-zero bookkeeping otherwise).
_SHOW_IF_SLOW = {"rew", "adv", "ckpt"}
_SLOW_S = 0.05


def _number(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool):
        return None
    try:
        value = float(value)  # numpy scalars, 0-d tensors and plain numbers alike
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m`` (rounded to whole seconds)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"seconds: expected a number >= 0, got {seconds!r}")
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StepClock:
    """Mean seconds per step so far, and the time the remaining steps will take at that pace."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Count one finished step (its ``timing_s/step``; a step without it is not counted)."""
        step_s = _number(metrics, STEP_TIME_KEY)
        if step_s is not None:
            self.steps += 1
            self.seconds += step_s

    def eta_s(self, step: int, total: int | None) -> float | None:
        """Seconds left after ``step`` of ``total``; ``None`` when unknown or nothing is left."""
        if not total or not self.steps or step >= total:
            return None
        return self.seconds / self.steps * (total - step)


def format_progress(metrics: Mapping[str, Any], step: int, total: int | None, eta_s: float | None = None) -> str:
    """``step k/N | reward r | <phase> t s ... | s/step | ETA t`` for one step's ``metrics``.

    ``total`` may be ``None`` (or 0) when the number of steps is unknown; it is then left out.
    ``eta_s`` (seconds left, e.g. from :class:`StepClock`) is shown when given. Missing metrics
    are skipped, so the function never fails on a partial dict.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics: expected a mapping of metric name to value, got {type(metrics).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise ValueError(f"total: expected None or an int >= 0, got {total!r}")
    if eta_s is not None and (isinstance(eta_s, bool) or not isinstance(eta_s, (int, float)) or not eta_s >= 0):
        raise ValueError(f"eta_s: expected None or a number of seconds >= 0, got {eta_s!r}")
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    reward = _number(metrics, REWARD_KEY)
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    phases = []
    for label, key in PHASES:
        seconds = _number(metrics, key)
        if seconds is None or (label in _SHOW_IF_SLOW and seconds < _SLOW_S):
            continue
        phases.append(f"{label} {seconds:.1f}s")
    if phases:
        parts.append(" ".join(phases))
    step_s = _number(metrics, STEP_TIME_KEY)
    if step_s is not None:
        parts.append(f"{step_s:.1f} s/step")
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)
