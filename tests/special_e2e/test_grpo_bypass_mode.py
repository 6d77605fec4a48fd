"""Two GRPO steps of stock verl 0.9.1 in rollout-correction bypass mode with verl's ``bypass_mode`` policy loss,
on the Arctic RL reference server, on CPU.

The recipe is verl's own way of asking for it: ``algorithm.rollout_correction.bypass_mode=true`` (the V1
trainer takes the rollout's log-probs as the old ones and skips the old-log-prob pass; the sampler must return
them: ``actor_rollout_ref.rollout.calculate_log_probs=true``) and
``actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode`` with its ``policy_loss.rollout_correction``
(``loss_type=reinforce``, token-level IS weights truncated at 2: the loss furthest from verl's vanilla one). The
reference server runs the update with its ``verl_bypass_mode`` loss; its log shows no old-log-prob ``/forward``.
(``loss_type=ppo_clip`` on the server's real training pass: ``tests/arctic_rl/server/compute/test_losses_model_on_cpu.py``; one
run here keeps the CI's time.)

Run by hand (prints the command it runs)::

    pytest -m e2e tests/special_e2e/test_grpo_bypass_mode.py -s
"""

from __future__ import annotations

import pytest

from tests.support.e2e import build_task, bundled_server_log, check_steps, run_recipe, tiny_grpo_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_two_grpo_steps_with_the_bypass_mode_loss(tmp_path):
    task = build_task(tmp_path / "task")
    steps, output = run_recipe([
        *tiny_grpo_overrides(task, tmp_path / "run", micro_batch=4),
        "algorithm.rollout_correction.bypass_mode=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=reinforce",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold=2.0",
        "remote_backend=arctic",
        "remote_backend.train.deepspeed.bf16=false",
    ], cwd=tmp_path, timeout=1500)

    # the loss's rollout_corr/ metrics under verl's actor prefix, as stock verl's worker logs them
    check_steps(steps, [1, 2], ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/kl_loss",
                                "actor/rollout_corr/rollout_is_mean", "actor/rollout_corr/rollout_is_max"))
    for metrics in steps.values():
        assert 0 < metrics["actor/rollout_corr/rollout_is_max"] <= 2.0  # truncated at the threshold
        assert "actor/pg_clipfrac" not in metrics  # reinforce does not clip
        assert "timing_s/old_log_prob/server" not in metrics  # no old-log-prob pass on the server
    server_log = bundled_server_log(tmp_path / "run")
    assert server_log.count("loss_fn=verl_bypass_mode") == 2 and "loss_fn=verl_grpo" not in server_log
    assert server_log.count("forward job=") == 2  # the reference log-probs only: one /forward a step
    assert "remote backend 'arctic' destroyed" in output
