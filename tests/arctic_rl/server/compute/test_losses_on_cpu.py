"""The server's allow-listed losses: hand-computed values, validation, and parity with verl 0.9.1.

The fixture below is small enough to do by hand (the comments carry the arithmetic). Ratios are
``exp(logprobs - old_log_probs)`` with ``old_log_probs = 0``, so ``logprobs = log(ratio)``.
"""

from __future__ import annotations

import math
import pickle
import sys

import pytest
import torch

from arctic_rl.protocol import LOSS_NAMES, LossConfig
from arctic_rl.server.compute.losses import (
    LOSS_FUNCTIONS,
    LossNameError,
    compute_loss,
    kl_penalty,
    resolve_loss,
)
from arctic_rl.server.compute.token_logprobs import TokenLogprobs

# row 0: ratio 1.5 (A=+1, clipped to 1.2), 0.5 (A=+1, not clipped), 1.0 (A=-1), masked token
# row 1: ratio 4.0 (A=-1, dual-clipped to 3), 0.5 (A=-1, clipped to 0.8), 2.0 (A=+2, clipped to 1.2), 1.0 (A=0)
RATIOS = [[1.5, 0.5, 1.0, 1.3], [4.0, 0.5, 2.0, 1.0]]
ADVANTAGES = [[1.0, 1.0, -1.0, -1.0], [-1.0, -1.0, 2.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]
# per-token losses (defaults: clip 0.2, dual clip 3): row 0: -1.2, -0.5, 1.0 (sum -0.7, 3 tokens)
#                                                     row 1: 3.0, 0.8, -2.4, 0.0 (sum 1.4, 4 tokens)


def fixture(entropy=None, **extra) -> tuple[TokenLogprobs, dict[str, torch.Tensor]]:
    lp = torch.tensor(RATIOS, dtype=torch.float64).log().requires_grad_()
    out = TokenLogprobs(lp, entropy, tokens_computed=0, unique_prompts=2)
    batch = {
        "response_mask": torch.tensor(MASK),
        "old_log_probs": torch.zeros(2, 4, dtype=torch.float64),
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float64),
        **extra,
    }
    return out, batch


def test_ppo_clip_token_mean_by_hand():
    out, batch = fixture()
    loss, m = compute_loss("verl_grpo", out, batch, LossConfig())
    assert loss.item() == pytest.approx(0.7 / 7)
    assert m["loss"] == pytest.approx(0.1) and m["actor/pg_loss"] == pytest.approx(0.1)
    assert m["actor/pg_clipfrac"] == pytest.approx(3 / 7)  # 1.5 (row 0), 0.5 and 2.0 (row 1)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 7)  # the dual-clipped 4.0
    assert m["actor/ppo_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 1.0 * 4.0 * 0.5 * 2.0 * 1.0) / 7)
    assert m["num_tokens"] == 7.0
    assert "kl_loss" not in m and "actor/entropy_loss" not in m


def test_ppo_clip_gradient_by_hand():
    out, batch = fixture()
    compute_loss("grpo", out, batch, LossConfig())[0].backward()
    # d/d(lp) of -A * ratio is -A * ratio where the unclipped branch is active, 0 where clipped
    expected = torch.tensor([[0.0, -0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64) / 7
    torch.testing.assert_close(out.logprobs.grad, expected)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 0.7 / 7),
        ("seq-mean-token-sum", (-0.7 + 1.4) / 2),
        ("seq-mean-token-mean", (-0.7 / 3 + 1.4 / 4) / 2),
    ],
)
def test_aggregation_modes(mode, expected):
    out, batch = fixture()
    loss, _ = compute_loss("verl_grpo", out, batch, LossConfig(loss_agg_mode=mode))
    assert loss.item() == pytest.approx(expected)


def test_fully_masked_rows_count_in_seq_mean_as_verls_actor_counts_them():
    """verl's actor divides the seq-means by global_batch_size, the mini-batch's rows, empty ones included."""
    out, batch = fixture()
    batch["response_mask"] = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])
    loss, m = compute_loss("verl_grpo", out, batch, LossConfig(loss_agg_mode="seq-mean-token-sum"))
    assert loss.item() == pytest.approx(1.4 / 2)
    assert m["num_tokens"] == 4.0


def test_dual_clip_disabled():
    out, batch = fixture()
    loss, m = compute_loss("verl_grpo", out, batch, LossConfig(clip_ratio_c=None))
    assert loss.item() == pytest.approx((0.7 + 1.0) / 7)  # the 4.0 ratio keeps its loss of 4
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_asymmetric_clip():
    out, batch = fixture()
    loss, m = compute_loss("verl_grpo", out, batch, LossConfig(clip_ratio_low=0.1, clip_ratio_high=0.4))
    # row 0: -1.4, -0.5, 1.0; row 1: 3.0, 0.9, -2.8, 0.0
    assert loss.item() == pytest.approx(0.2 / 7)
    assert m["actor/pg_clipfrac"] == pytest.approx(3 / 7)


def test_rollout_is_weights_multiply_token_losses():
    weights = torch.tensor([[1.0, 2.0, 0.5, 9.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    out, batch = fixture(rollout_is_weights=weights)
    loss, _ = compute_loss("verl_grpo", out, batch, LossConfig())
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.5 + 1.4) / 7)


def test_loss_scale_tokens_replaces_the_token_count():
    out, batch = fixture()
    loss, m = compute_loss("verl_grpo", out, batch, LossConfig(loss_scale_tokens=14))
    assert loss.item() == pytest.approx(0.7 / 14)
    assert m["num_tokens"] == 7.0


def test_entropy_bonus():
    entropy = torch.tensor([[1.0, 2.0, 3.0, 100.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    out, batch = fixture(entropy=entropy)
    loss, m = compute_loss("verl_grpo", out, batch, LossConfig(entropy_coeff=0.1))
    assert m["actor/entropy_loss"] == pytest.approx(10.0 / 7)  # the masked 100 does not count
    assert loss.item() == pytest.approx(0.1 - 0.1 * 10.0 / 7)
    out, batch = fixture()
    with pytest.raises(ValueError, match="entropy_coeff"):
        compute_loss("verl_grpo", out, batch, LossConfig(entropy_coeff=0.1))


# lp - ref = [0.5, 0.0] on one row of two tokens; advantages 0 so the policy term is 0
@pytest.mark.parametrize(
    "kind, per_token",
    [
        ("kl", [0.5, 0.0]),
        ("abs", [0.5, 0.0]),
        ("mse", [0.125, 0.0]),
        ("low_var_kl", [math.exp(-0.5) + 0.5 - 1.0, 0.0]),
    ],
)
def test_kl_types(kind, per_token):
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    out = TokenLogprobs(lp, None, 0, 1)
    batch = {
        "response_mask": torch.ones(1, 2, dtype=torch.bool),
        "old_log_probs": lp.clone(),
        "advantages": torch.zeros(1, 2, dtype=torch.float64),
        "ref_log_prob": torch.tensor([[-0.5, -1.0]], dtype=torch.float64),
    }
    cfg = LossConfig(use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=0.5)
    loss, m = compute_loss("verl_grpo", out, batch, cfg)
    assert m["kl_loss"] == pytest.approx(sum(per_token) / 2)
    assert loss.item() == pytest.approx(0.5 * sum(per_token) / 2)
    assert m["actor/pg_loss"] == 0.0


def test_low_var_kl_is_clamped_like_verl():
    lp = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[30.0, -30.0]])
    # ref - lp = 30 -> clamp to 20 -> exp(20) - 21 -> clamp to 10; -30 -> -20 -> exp(-20) + 19 -> 10
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), torch.tensor([[10.0, 10.0]]))
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(lp, ref, "k9")


def test_kl_needs_ref_log_prob():
    out, batch = fixture()
    with pytest.raises(ValueError, match="ref_log_prob"):
        compute_loss("verl_grpo", out, batch, LossConfig(use_kl_loss=True, kl_loss_coef=0.1))


@pytest.mark.parametrize("name", ["sft", "sft_ce", "cross_entropy"])
@pytest.mark.parametrize(
    "mode, expected",
    [("token-mean", 7 / 3), ("seq-mean-token-sum", (3 + 4) / 2), ("seq-mean-token-mean", (1.5 + 4) / 2)],
)
def test_sft_cross_entropy(name, mode, expected):
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    out = TokenLogprobs(lp, None, 0, 2)
    loss, m = compute_loss(name, out, {"loss_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}, {"loss_agg_mode": mode})
    assert loss.item() == pytest.approx(expected)
    assert m["sft_loss"] == pytest.approx(expected) and m["loss"] == m["sft_loss"] and m["num_tokens"] == 3.0
    loss.backward()
    assert lp.grad[0, 2] == 0 and lp.grad[1, 1] == 0


@pytest.mark.parametrize("name", ["verl_grpo", "sft"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_empty_mask_gives_zero_loss_without_nan(name, mode):
    entropy = torch.ones(2, 4, dtype=torch.float64)
    out, batch = fixture(entropy=entropy, ref_log_prob=torch.zeros(2, 4, dtype=torch.float64))
    batch["response_mask"] = torch.zeros(2, 4, dtype=torch.bool)
    cfg = LossConfig(loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    loss, m = compute_loss(name, out, batch, cfg)
    assert loss.item() == 0.0 and m["num_tokens"] == 0.0
    assert all(math.isfinite(v) for v in m.values())
    loss.backward()
    assert bool((out.logprobs.grad == 0).all())


def test_bad_tensors_are_named():
    out, batch = fixture()
    with pytest.raises(ValueError, match=r"advantages: expected shape \[2, 4\].*got \[2, 5\]"):
        compute_loss("verl_grpo", out, {**batch, "advantages": torch.zeros(2, 5, dtype=torch.float64)})
    with pytest.raises(ValueError, match="old_log_probs: expected finite"):
        compute_loss("verl_grpo", out, {**batch, "old_log_probs": torch.full((2, 4), float("nan"))})
    with pytest.raises(ValueError, match="advantages: expected finite"):
        compute_loss("verl_grpo", out, {**batch, "advantages": torch.full((2, 4), float("inf"))})
    with pytest.raises(ValueError, match="advantages: expected a floating-point dtype"):
        compute_loss("verl_grpo", out, {**batch, "advantages": torch.zeros(2, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="old_log_probs: expected"):
        compute_loss("verl_grpo", out, {k: v for k, v in batch.items() if k != "old_log_probs"})
    with pytest.raises(ValueError, match="response_mask"):
        compute_loss("verl_grpo", out, {k: v for k, v in batch.items() if k != "response_mask"})


def test_loss_mask_is_accepted_instead_of_response_mask():
    out, batch = fixture()
    batch["loss_mask"] = batch.pop("response_mask")
    loss, _ = compute_loss("verl_grpo", out, batch)
    assert loss.item() == pytest.approx(0.1)


# --------------------------------------------------------------------------------------------
# Allow-list
# --------------------------------------------------------------------------------------------


def test_allow_list_is_the_protocols():
    assert set(LOSS_FUNCTIONS) == set(LOSS_NAMES)
    assert resolve_loss("grpo") is resolve_loss("verl_grpo")
    assert resolve_loss(None) is resolve_loss("grpo")
    with pytest.raises(TypeError):
        LOSS_FUNCTIONS["evil"] = print  # read-only


@pytest.mark.parametrize("name", ["os.system", "verl.trainer.foo.bar", "GRPO", "", 3])
def test_unknown_loss_names_are_refused_without_importing(name):
    before = set(sys.modules)
    with pytest.raises(LossNameError) as info:
        resolve_loss(name)
    message = str(info.value)
    assert repr(name) in message
    assert all(allowed in message for allowed in LOSS_NAMES)
    assert info.value.allowed == list(LOSS_NAMES) and info.value.received == name
    assert isinstance(info.value, ValueError)
    assert set(sys.modules) == before
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == message


# --------------------------------------------------------------------------------------------
# Parity with verl 0.9.1 itself
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # importing verl's core_algos pulls in ray (~10 s)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_type", ["low_var_kl", "kl", "abs", "mse"])
def test_matches_verl_policy_loss(mode, kl_type):
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    g = torch.Generator().manual_seed(0)
    b, r = 6, 9
    lp = -torch.rand(b, r, generator=g, dtype=torch.float64) * 3
    old = lp + 0.5 * torch.randn(b, r, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(b, r, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, r)
    weights = 0.5 + torch.rand(b, r, generator=g, dtype=torch.float64)
    entropy = torch.rand(b, r, generator=g, dtype=torch.float64)
    mask = torch.rand(b, r, generator=g) > 0.3
    mask[0] = False
    actor = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.25,
        clip_ratio_c=2.5,
        loss_agg_mode=mode,
    )
    # as verl's ppo_loss sets it for one mini-batch on one rank (row 0 is empty: it counts in the seq-means)
    actor.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=b)
    pg, pg_metrics = core_algos.compute_policy_loss_vanilla(
        old, lp, adv, mask, loss_agg_mode=mode, config=actor, rollout_is_weights=weights
    )
    ent = core_algos.agg_loss(entropy, mask, mode, **actor.global_batch_info)
    kl = core_algos.agg_loss(core_algos.kl_penalty(lp, ref, kl_type), mask, mode, **actor.global_batch_info)
    verl_loss = pg - 0.01 * ent + 0.1 * kl

    cfg = LossConfig(
        clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.25, clip_ratio_c=2.5, loss_agg_mode=mode,
        use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.1, entropy_coeff=0.01,
    )  # fmt: skip
    batch = {"response_mask": mask, "old_log_probs": old, "advantages": adv, "ref_log_prob": ref,
             "rollout_is_weights": weights}  # fmt: skip
    loss, m = compute_loss("verl_grpo", TokenLogprobs(lp, entropy, 0, b), batch, cfg)
    assert loss.item() == pytest.approx(verl_loss.item(), rel=1e-9)
    assert m["actor/pg_loss"] == pytest.approx(pg.item(), rel=1e-9)
    assert m["kl_loss"] == pytest.approx(kl.item(), rel=1e-9)
    assert m["actor/pg_clipfrac"] == pytest.approx(pg_metrics["actor/pg_clipfrac"], rel=1e-6)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(pg_metrics["actor/pg_clipfrac_lower"], rel=1e-6)
    assert m["actor/ppo_kl"] == pytest.approx(pg_metrics["actor/ppo_kl"], rel=1e-6)
