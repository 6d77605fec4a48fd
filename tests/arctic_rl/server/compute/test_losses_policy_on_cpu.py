"""The reference server's ``verl_gspo`` and ``verl_bypass_mode`` losses by hand, and their config's validation.

Parity with verl 0.9.1's own functions, case by case, is ``tests/remote_client/arctic/test_rollout_correction_on_cpu.py``
(slow: it imports verl); these fast checks pin the arithmetic on rows small enough to follow.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from arctic_rl.protocol import LossConfig, RolloutCorrection
from arctic_rl.server.compute.losses import compute_loss
from arctic_rl.server.compute.token_logprobs import TokenLogprobs
from arctic_rl.server.errors import BadRequest


def rows(log_ratios, adv, mask=None):
    """``logprobs = -1 + log_ratio`` against ``old_log_probs = -1``; a leaf to differentiate."""
    lr = torch.tensor(log_ratios, dtype=torch.float64)
    lp = (lr - 1.0).requires_grad_()
    batch = {"response_mask": torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.tensor(mask).bool(),
             "old_log_probs": torch.full_like(lr, -1.0), "advantages": torch.tensor(adv, dtype=torch.float64)}
    return TokenLogprobs(lp, None, 0, 0), batch


def bypass(**rc) -> LossConfig:
    return LossConfig(rollout_correction=RolloutCorrection(**rc))


def test_gspo_clips_the_sequence_ratio_and_spreads_its_gradient_over_the_tokens():
    # row 0: log-ratios 0.2, 0.0 -> sequence ratio e^0.1 (inside [0.8, 1.2]); row 1: 1.0, 1.0 -> e^1 clipped to 1.2
    out, batch = rows([[0.2, 0.0], [1.0, 1.0]], [[1.0, 1.0], [2.0, 2.0]])
    loss, m = compute_loss("verl_gspo", out, batch, LossConfig())
    s = math.exp(0.1)
    assert loss.item() == pytest.approx((-1.0 * s * 2 - 2.0 * 1.2 * 2) / 4)
    (grad,) = torch.autograd.grad(loss, out.logprobs)
    # d ratio_t / d logprob_t = ratio (the sequence part carries no gradient); clipped tokens: none
    torch.testing.assert_close(grad, torch.tensor([[-s / 4, -s / 4], [0.0, 0.0]], dtype=torch.float64))
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5) and m["actor/pg_clipfrac_lower"] == 0.0


def test_bypass_ppo_clip_is_the_vanilla_loss_against_the_rollout_without_weights():
    out, batch = rows([[0.5, -0.1, 0.05], [2.0, 0.0, -3.0]], [[1.0, -1.0, 1.0], [-1.0, 2.0, 0.5]])
    vanilla, _ = compute_loss("verl_grpo", out, batch, LossConfig())
    loss, m = compute_loss("verl_bypass_mode", out, batch, bypass(loss_type="ppo_clip", rollout_is="token"))
    assert loss.item() == pytest.approx(vanilla.item())
    # the weights are reported (metrics), not applied: exp(log-ratio) truncated at 2
    weights = [min(math.exp(x), 2.0) for x in (0.5, -0.1, 0.05, 2.0, 0.0, -3.0)]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(weights) / 6)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)


@pytest.mark.parametrize(("level", "weights"), [
    ("token", [[math.exp(0.5), math.exp(-0.5)], [2.0, 1.0]]),  # exp(1.5) truncated at 2
    ("sequence", [[1.0, 1.0], [2.0, 2.0]]),  # row sums 0 and 1.5 -> 1 and exp(1.5) truncated
])
def test_bypass_reinforce_weights_the_log_prob_gradient(level, weights):
    out, batch = rows([[0.5, -0.5], [1.5, 0.0]], [[1.0, 1.0], [-2.0, -2.0]])
    loss, m = compute_loss("verl_bypass_mode", out, batch, bypass(loss_type="reinforce", rollout_is=level))
    (grad,) = torch.autograd.grad(loss, out.logprobs)
    w = torch.tensor(weights, dtype=torch.float64)
    torch.testing.assert_close(grad, -batch["advantages"] * w / 4)  # -A * w per token, token-mean over 4
    assert loss.item() == pytest.approx(float((-batch["advantages"] * out.logprobs.detach() * w).sum() / 4))
    assert "actor/pg_clipfrac" not in m and m["actor/ppo_kl"] == pytest.approx(-(0.5 - 0.5 + 1.5) / 4)


def test_icepop_zeroes_weights_outside_the_bounds_and_batch_normalisation_makes_their_mean_one():
    out, batch = rows([[0.0, math.log(3.0)], [math.log(0.5), math.log(0.1)]], [[1.0, 1.0], [1.0, 1.0]])
    cfg = bypass(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.4_2.5")
    loss, _ = compute_loss("verl_bypass_mode", out, batch, cfg)
    (grad,) = torch.autograd.grad(loss, out.logprobs)
    torch.testing.assert_close(grad, -torch.tensor([[1.0, 0.0], [0.5, 0.0]], dtype=torch.float64) / 4)
    cfg = bypass(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.4_2.5",
                 rollout_is_batch_normalize=True)
    loss, m = compute_loss("verl_bypass_mode", out, batch, cfg)
    (grad,) = torch.autograd.grad(loss, out.logprobs)
    torch.testing.assert_close(grad, -torch.tensor([[1.0, 0.0], [0.5, 0.0]], dtype=torch.float64) / 4 / (1.5 / 4),
                               rtol=1e-6, atol=1e-9)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.5 / 4)


def test_rejection_removes_tokens_and_rows_from_the_loss_but_not_from_the_token_count():
    # token_k1 with ratio bounds [0.5, 2]: the token of ratio 3 goes; seq_max_k2 <= 0.7 (row 0: 0.6): row 1 (1.125) goes
    out, batch = rows([[0.0, math.log(3.0), 0.1], [0.2, 1.5, 0.0]], [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    cfg = bypass(loss_type="reinforce", rollout_is=None, rollout_rs="token_k1,seq_max_k2",
                 rollout_rs_threshold="0.5_2.0,0.7")
    loss, m = compute_loss("verl_bypass_mode", out, batch, cfg.model_copy(update={"loss_scale_tokens": 6.0}))
    (grad,) = torch.autograd.grad(loss, out.logprobs)
    torch.testing.assert_close(grad, -torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64) / 6)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 6) and m["num_tokens"] == 6.0


@pytest.mark.parametrize("name", ["verl_gspo", "verl_bypass_mode"])
def test_an_empty_mask_gives_a_zero_loss_without_nan(name):
    out, batch = rows([[0.3, -0.2]], [[1.0, -1.0]], mask=[[0, 0]])
    loss, m = compute_loss(name, out, batch, bypass(loss_type="reinforce", rollout_is="sequence"))
    (grad,) = torch.autograd.grad(loss, out.logprobs)
    assert loss.item() == 0.0 and not torch.isnan(grad).any() and math.isfinite(m["loss"])


@pytest.mark.parametrize(("config", "field"), [
    ({"loss_type": "ppo"}, "loss_type"),
    ({"rollout_is": "tokens"}, "rollout_is"),
    ({"rollout_is_threshold": "2_1"}, "rollout_is_threshold"),
    ({"rollout_is_threshold": "high"}, "rollout_is_threshold"),
    ({"rollout_rs": "token_k1,seq_k9"}, "rollout_rs"),
    ({"extra": 1}, "extra"),
])
def test_a_bad_rollout_correction_is_refused_naming_the_field(config, field):
    with pytest.raises(ValidationError) as err:
        LossConfig.model_validate({"rollout_correction": config})
    assert err.value.errors()[0]["loc"] == ("rollout_correction", field)


def test_the_server_answers_a_bad_rollout_correction_with_a_400_naming_it():
    from arctic_rl.server.http.validation import parse_batch_body

    ids = torch.tensor([[5, 6, 7, 8]])
    body = {"batch": {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompts": ids[:, :2],
                      "response_mask": torch.tensor([[0, 0, 1, 1]]), "old_log_probs": torch.zeros(1, 4),
                      "advantages": torch.zeros(1, 4)},
            "meta": {}, "processing": {"loss_fn": "verl_bypass_mode",
                                       "config": {"rollout_correction": {"rollout_is": "tokens"}}}}
    with pytest.raises(BadRequest) as err:
        parse_batch_body(body, vocab_size=16, train=True)
    assert err.value.field == "processing.config.rollout_correction.rollout_is" and err.value.status_code == 400


def test_a_rejection_threshold_that_does_not_fit_its_options_is_named():
    out, batch = rows([[0.1, 0.2]], [[1.0, 1.0]])
    cfg = bypass(rollout_rs="token_k2,seq_sum_k3", rollout_rs_threshold="1,2,3")
    with pytest.raises(ValueError, match=r"rollout_correction\.rollout_rs_threshold"):
        compute_loss("verl_bypass_mode", out, batch, cfg)
    with pytest.raises(ValueError, match=r"rollout_correction\.rollout_rs_threshold"):
        compute_loss("verl_bypass_mode", out, batch, bypass(rollout_rs="token_k2"))
