"""Asynchronous GRPO on the Arctic RL reference server, on CPU: verl's async replay buffer, one step of lag.

``trainer.v1.remote_backend.async_mode=true``: before step 1 one batch of prompts goes to the
server (verl's warm-up batch), every step hands over one more and trains the oldest finished one,
so the batch trained at step 2 was sent before step 1's update (generated with the weights of
version 0, trained by the weights of version 1). verl's own bookkeeping says so in its
``training/off_policy/trajectory_staleness*`` metrics; verl's decoupled rollout correction (token
IS against the sampler's log-probs) corrects for it and logs ``rollout_corr/*``. The staleness
bound is the remote-backend default (``max_off_policy_threshold=2``: one step of lag).
verl's bypass mode works in the mode too: the sampler's log-probs stand for the old ones and no step
runs an old-log-prob pass.

The vendor's server (async, each weight sync fenced) and the fall-back to sync are
tests/conformance/test_vendor_async_on_cpu.py; which servers run the mode, tests/remote_client/arctic/
test_concurrency_on_cpu.py.

Run by hand::

    pytest -m e2e tests/special_e2e/test_grpo_async.py -s
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.e2e import build_task, bundled_server_log, check_steps, run_recipe, tiny_grpo_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ASYNC_OVERRIDES = [
    "remote_backend=arctic",
    "remote_backend.train.deepspeed.bf16=false",
    "trainer.v1.remote_backend.async_mode=true",
    # verl's decoupled rollout correction: token IS weights against the sampler's own log-probs
    "actor_rollout_ref.rollout.calculate_log_probs=true",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
]


def run_async(tmp_path: Path, *extra: str, steps: int = 2) -> tuple[dict[int, dict[str, float]], str]:
    task = build_task(tmp_path / "task")
    overrides = [*tiny_grpo_overrides(task, tmp_path / "run", steps=steps, micro_batch=4), *ASYNC_OVERRIDES, *extra]
    return run_recipe(overrides, cwd=tmp_path, timeout=900)


def test_two_async_grpo_steps_train_one_step_stale_batches(tmp_path):
    # an entropy bonus: step 1's update moves the weights even when every group's rewards are equal (advantages all
    # 0, KL 0 on step 1: a zero gradient, which Adam turns into no update and the IS weights of step 2 into 1)
    steps, output = run_async(tmp_path, "actor_rollout_ref.actor.entropy_coeff=0.01")
    check_steps(steps, [1, 2], ("actor/pg_loss", "actor/grad_norm", "rollout_corr/rollout_is_mean",
                                "rollout_corr/rollout_is_max", "training/off_policy/trajectory_staleness/mean",
                                "training/off_policy/trajectory_staleness/max", "training/off_policy/dropped_share",
                                "timing_s/update_weights"))
    assert "asynchronous remote mode on" in output
    for metrics in steps.values():
        assert metrics["training/off_policy/async_mode"] == 1.0
        assert 0 < metrics["rollout_corr/rollout_is_max"] <= 2.0
        assert metrics["actor/grad_norm"] > 0
        assert metrics["training/off_policy/trajectory_staleness/max"] <= 1  # the bound: one step of lag
        assert metrics["training/off_policy/dropped_share"] == 0.0
    # step 1 trains the warm-up batch (weights 0, on-policy); step 2 the batch sent before step 1's update
    assert steps[1]["training/off_policy/trajectory_staleness_worst/max"] == 0
    assert steps[2]["training/off_policy/trajectory_staleness_worst/max"] == 1
    # verl's IS weights: 1 on the policy that sampled (step 1), away from 1 on the batch one update old (step 2)
    assert steps[1]["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-4)
    assert abs(steps[2]["rollout_corr/rollout_is_max"] - 1.0) > 1e-3 or abs(steps[2]["rollout_corr/rollout_is_min"] - 1.0) > 1e-3
    assert "remote backend 'arctic' destroyed" in output


def test_late_samples_are_dropped_and_counted(tmp_path):
    """Two warm-up batches make a backlog: the batch sent at step 1 would be trained at step 3, two versions late,
    which the bound (one step of lag) drops with verl's ``drop`` strategy -- counted, and never trained."""
    steps, _ = run_async(tmp_path, "trainer.v1.remote_backend.num_warmup_batches=2", steps=3)
    check_steps(steps, [1, 2, 3])
    for step, metrics in steps.items():
        assert metrics["training/off_policy/trajectory_staleness/max"] <= 1, step  # nothing older is trained
    assert steps[1]["training/off_policy/dropped_share"] == 0.0
    assert steps[3]["training/off_policy/evicted_samples"] >= 1
    assert 0 < steps[3]["training/off_policy/dropped_share"] < 1
    assert steps[3]["training/off_policy/evicted_samples_staleness/max"] == 3  # verl counts versions spanned


def test_async_in_verls_bypass_mode_trains_lagged_batches_without_an_old_log_prob_pass(tmp_path):
    """verl's bypass mode in the asynchronous mode (docs/ASYNC.md, "Correcting for the lag"): the sampler's own
    log-probs stand for the old ones, so a step has no old-log-prob pass on the server, and the batch trained at step
    2 is still one version old."""
    task = build_task(tmp_path / "task")
    overrides = [*tiny_grpo_overrides(task, tmp_path / "run", micro_batch=4), "remote_backend=arctic",
                 "remote_backend.train.deepspeed.bf16=false", "trainer.v1.remote_backend.async_mode=true",
                 "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.bypass_mode=true",
                 "actor_rollout_ref.actor.entropy_coeff=0.01"]
    steps, output = run_recipe(overrides, cwd=tmp_path, timeout=900)
    check_steps(steps, [1, 2], ("actor/pg_loss", "actor/grad_norm", "training/off_policy/trajectory_staleness/max"))
    assert "asynchronous remote mode on" in output
    for metrics in steps.values():
        assert metrics["training/off_policy/async_mode"] == 1.0
        assert "timing_s/old_log_prob/server" not in metrics  # no old-log-prob pass on the server
        assert metrics["actor/grad_norm"] > 0
    assert steps[1]["training/off_policy/trajectory_staleness_worst/max"] == 0
    assert steps[2]["training/off_policy/trajectory_staleness_worst/max"] == 1
    server_log = bundled_server_log(tmp_path / "run")
    assert server_log.count("forward job=") == 2  # the reference log-probs only (the KL loss): one /forward a step
