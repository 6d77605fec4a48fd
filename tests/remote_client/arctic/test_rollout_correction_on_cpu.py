"""The remote update computes stock verl 0.9.1's actor loss: loss and gradient, case by case of rollout correction.

One fixed GRPO batch (4 prompts x 2 samples, responses of 1-6 tokens, nested as verl's V1 trainer hands it to
``update_actor``) and one leaf tensor of per-token log-probs (the model's output over every position). Each case
is one verl config, read by both sides from the same composed main config (verl's generated trainer yaml):

* **stock verl**: the trainer-side step (bypass: ``old_log_probs := rollout_log_probs``, as
  ``RayPPOTrainer``'s V1 ``_compute_old_log_prob`` does; decoupled: ``compute_rollout_correction_and_add_to_batch``
  on the padded batch, as its ``_compute_advantage`` does), then ``verl.workers.utils.losses.ppo_loss`` -- the
  engine workers' actor loss, which dispatches to the registered policy loss (``get_policy_loss_fn``) -- with
  the actor config verl builds from the yaml (``omega_conf_to_dataclass``).
* **remote**: the same trainer-side step (it runs on verl's driver either way), then what the adapter's
  ``update_actor`` sends for one mini-batch (its layout, dense batch, IS weights folded into the advantages or
  dropped for ``bypass_mode``,
  ``loss_fn_name``/``build_loss_config``/``build_meta``, ``forward_body``), parsed by the reference server's
  own validation (``parse_batch_body``) and computed by its loss (``compute_loss``) on the log-probs the server
  would hand it (response columns, server row order).

Both losses and both gradients w.r.t. the shared log-prob leaf (float64) agree to float32 round-off (the
server reads the batch's old log-probs, advantages and weights as float32, as it does on the wire). The log-probs are
far enough from the old/rollout ones that PPO clipping, dual clip, IS truncation and rejection all bite.
"""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu

from tests.support.arctic import grpo_rows, verl_main_config

pytestmark = pytest.mark.slow  # verl's core_algos pulls in ray (~10 s)

PROMPT_LENS = [4, 7, 5, 3]
N = 2
ROWS = len(PROMPT_LENS) * N
VOCAB = 128

BYPASS = {"algorithm": {"rollout_correction": {"bypass_mode": True}}}


def decoupled(**rc) -> dict:
    return {"algorithm": {"rollout_correction": {"bypass_mode": False, **rc}}}


def actor(**kw) -> dict:
    return {"actor_rollout_ref": {"actor": kw}}


def bypass_loss(**rc) -> dict:
    """``policy_loss.loss_mode=bypass_mode``; ``rc`` the ``policy_loss.rollout_correction`` mapping (none: absent)."""
    policy = {"loss_mode": "bypass_mode", **({"rollout_correction": rc} if rc else {})}
    return {**BYPASS, **actor(policy_loss=policy)}


def merge(*parts: dict) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(*parts))


CASES = {
    # bypass mode, verl's default (vanilla) loss: the ratio is taken against the rollout's log-probs
    "bypass-vanilla": BYPASS,
    "bypass-vanilla-seq-mean-token-mean": merge(BYPASS, actor(loss_agg_mode="seq-mean-token-mean")),
    "bypass-vanilla-kl-entropy": merge(BYPASS, actor(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                                                     entropy_coeff=0.01, clip_ratio_high=0.28)),
    # decoupled mode: old log-probs recomputed, IS weights (and rejection) of old vs rollout from the trainer
    "decoupled-token-is": decoupled(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled-seq-is": decoupled(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled-seq-is-seq-mean-token-sum": merge(decoupled(rollout_is="sequence", rollout_is_threshold=2.0),
                                                 actor(loss_agg_mode="seq-mean-token-sum")),
    "decoupled-token-is-icepop-rs": decoupled(rollout_is="token", rollout_is_threshold="0.5_1.5",
                                              rollout_rs="token_k1", rollout_rs_threshold="0.4_2.5"),
    # policy_loss.loss_mode=bypass_mode: IS weights and rejection of the current policy vs the rollout, in the loss
    "bypass_mode-ppo_clip-defaults": bypass_loss(),
    "bypass_mode-ppo_clip-rs": bypass_loss(loss_type="ppo_clip", rollout_rs="seq_max_k2", rollout_rs_threshold=0.5),
    "bypass_mode-reinforce-seq-is": bypass_loss(loss_type="reinforce", rollout_is="sequence",
                                                rollout_is_threshold=2.0),
    "bypass_mode-reinforce-token-is-normalized-rs": bypass_loss(
        loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.3_3.0", rollout_is_batch_normalize=True,
        rollout_rs="token_k3,seq_mean_k1", rollout_rs_threshold="1.0,0.5_2.0"),
    # rejection emptying whole rows: they still count in verl's seq-means (global_batch_size = the rows)
    "decoupled-seq-is-seq-rs-seq-mean-token-sum": merge(
        decoupled(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1),
        actor(loss_agg_mode="seq-mean-token-sum")),
    "bypass_mode-ppo_clip-row-rs-seq-mean-token-mean": merge(
        bypass_loss(loss_type="ppo_clip", rollout_rs="seq_max_k2", rollout_rs_threshold=0.3),
        actor(loss_agg_mode="seq-mean-token-mean")),
    # the trainer's (decoupled) weights reach a bypass_mode loss, which ignores them and makes its own
    "bypass_mode-reinforce-with-decoupled-weights": merge(
        actor(policy_loss={"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce",
                                                                              "rollout_is": "token"}}),
        decoupled(rollout_is="sequence", rollout_is_threshold=2.0)),
    # gspo (with decoupled token IS weights, which it applies)
    "gspo": merge(actor(policy_loss={"loss_mode": "gspo"}, loss_agg_mode="seq-mean-token-mean"),
                  decoupled(rollout_is="token", rollout_is_threshold=2.0)),
    "gspo-token-mean": actor(policy_loss={"loss_mode": "gspo"}, clip_ratio_low=0.1, clip_ratio_high=0.3),
}


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def fixed_batch():
    """The batch verl's V1 trainer hands the actor (every per-token field nested), the leaf log-probs over
    every position, and the entropy (model outputs, ``[total_nnz]``)."""
    prompts, responses = grpo_rows(3, PROMPT_LENS, n=N, interleave=True)
    g = torch.Generator().manual_seed(11)
    seqs = [p + r for p, r in zip(prompts, responses)]
    total = sum(map(len, seqs))
    values = (-torch.rand(total, generator=g, dtype=torch.float64) * 2.5 - 0.05).requires_grad_()
    entropy = torch.rand(total, generator=g, dtype=torch.float64) * 3
    current = [values.detach()[o + len(p) - 1: o + len(p) - 1 + len(r)]
               for o, p, r in zip(torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).tolist(), prompts, responses)]

    def near(shift: float) -> list[torch.Tensor]:  # log-probs of other policies: the current ones, moved
        return [(c + shift * torch.randn(len(c), generator=g, dtype=torch.float64)).clamp(max=-1e-3) for c in current]

    adv_rows = torch.randn(ROWS, generator=g, dtype=torch.float64)
    data = tu.get_tensordict({
        "prompts": nested([torch.tensor(p) for p in prompts]),
        "responses": nested([torch.tensor(r) for r in responses]),
        "input_ids": nested([torch.tensor(s) for s in seqs]),
        "position_ids": nested([torch.arange(len(s)) for s in seqs]),
        "attention_mask": nested([torch.ones(len(s), dtype=torch.int64) for s in seqs]),
        "response_mask": nested([torch.ones(len(r), dtype=torch.int64) for r in responses]),
        "advantages": nested([torch.full((len(r),), float(adv_rows[i]), dtype=torch.float64)
                              for i, r in enumerate(responses)]),
        "old_log_probs": nested(near(0.3)),
        "rollout_log_probs": nested(near(0.6)),
        "ref_log_prob": nested(near(0.4)),
    })
    return data, values, entropy


def trainer_step(data, cfg) -> None:
    """What verl's V1 trainer does before ``update_actor`` (the same for stock verl and the remote backend)."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.workers.utils.padding import response_to_nested

    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode:  # _compute_old_log_prob: the rollout's log-probs are the old ones
        data["old_log_probs"] = data["rollout_log_probs"]
        return
    if rc.rollout_is is None and rc.rollout_rs is None:
        return
    mask = data["response_mask"]
    padded = DataProto.from_dict(tensors={k: data[k].to_padded_tensor(0.0) for k in
                                          ("old_log_probs", "rollout_log_probs", "response_mask")})
    out, _ = compute_rollout_correction_and_add_to_batch(padded, rc)  # _compute_advantage
    data["response_mask"] = response_to_nested(out.batch["response_mask"], mask)
    if "rollout_is_weights" in out.batch.keys():  # noqa: SIM118 - a TensorDict
        data["rollout_is_weights"] = response_to_nested(out.batch["rollout_is_weights"], mask)


def stock_loss(cfg, data, values, entropy, *, with_entropy: bool):
    """verl's engine-worker actor loss on one mini-batch of all rows."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    mini = data.clone(recurse=False)
    if not config.use_kl_loss:
        del mini["ref_log_prob"]
    tokens = int(data["response_mask"].values().sum())
    tu.assign_non_tensor(mini, dp_size=1, batch_num_tokens=tokens, global_batch_size=ROWS)
    output = {"log_probs": values, **({"entropy": entropy} if with_entropy else {})}
    loss, metrics = ppo_loss(config, output, mini)
    return loss, metrics


def remote_loss(cfg, data, values, entropy, *, with_entropy: bool):
    """What the adapter sends for the mini-batch, parsed and computed as the reference server does."""
    from arctic_rl.protocol import Processing
    from arctic_rl.server.compute.losses import compute_loss
    from arctic_rl.server.compute.token_logprobs import TokenLogprobs
    from arctic_rl.server.http.validation import parse_batch_body
    from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
    from verl.workers.remote_client.arctic.builders import build_meta
    from verl.workers.remote_client.arctic.layout import RESPONSE_KEYS, dense_batch, plan_layout
    from verl.workers.remote_client.arctic.loss_config import (
        apply_is_weights,
        build_loss_config,
        loss_body,
        loss_fn_name,
    )
    from verl.workers.remote_client.arctic.training import TRAIN_POST, forward_body
    from verl.workers.remote_client.common.verl_settings import VerlSettings

    verl, arctic = VerlSettings.from_main_config(cfg), ArcticConfig.from_main_config(cfg)
    layout = plan_layout(data, response_width=None, group_rows=False)
    present = set(data.keys())
    keys = tuple(k for k in RESPONSE_KEYS if k in present and (k != "ref_log_prob" or verl.use_kl_loss))
    batch = dense_batch(data, layout, pad_token_id=0, keys=keys)
    apply_is_weights(batch, verl)
    tokens = float(batch["response_mask"].sum())
    token_mean = verl.loss_agg_mode == "token-mean"
    loss_cfg = build_loss_config(verl, loss_scale_tokens=tokens if token_mean else None)
    meta = build_meta(verl, arctic, max_prompt_len=layout.prompt_width, max_response_len=layout.response_width,
                      temperature=1.0, calculate_entropy=with_entropy, pad_token_id=0, global_batch_size=ROWS,
                      batch_num_tokens=tokens, loss=loss_cfg)
    processing = Processing(loss_fn=loss_fn_name(verl), post=list(TRAIN_POST), config=loss_body(loss_cfg))
    parsed = parse_batch_body(forward_body(batch, meta, processing), vocab_size=VOCAB, train=True)
    config = parsed.loss_config
    if token_mean:  # the training engine's denominator: meta.batch_num_tokens first
        config = config.model_copy(update={"loss_scale_tokens": parsed.meta.batch_num_tokens})
    # the server's log-probs: response column j of server row i predicts response token j (from the
    # position before it), rows in the layout's order
    r = layout.response_width
    seq_start = layout.offsets[:-1].index_select(0, layout.order)
    plen = layout.prompt_lens.index_select(0, layout.order)
    rlen = layout.response_lens.index_select(0, layout.order)
    cols = torch.arange(r)
    index = (seq_start + plen - 1).unsqueeze(1) + cols
    valid = cols < rlen.unsqueeze(1)
    index = torch.where(valid, index, torch.zeros_like(index))
    zero = torch.zeros((), dtype=values.dtype)
    lp = torch.where(valid, values[index], zero)
    ent = torch.where(valid, entropy[index], zero) if with_entropy else None
    return compute_loss(parsed.loss_name, TokenLogprobs(lp, ent, 0, 0), parsed.rl, config)


@pytest.mark.parametrize("case", list(CASES))
def test_remote_loss_and_gradient_equal_stock_verls_actor_loss(case):
    cfg = verl_main_config(merge(actor(ppo_mini_batch_size=len(PROMPT_LENS), ppo_micro_batch_size_per_gpu=ROWS),
                                 {"actor_rollout_ref": {"rollout": {"n": N}}}, CASES[case]))
    data, values, entropy = fixed_batch()
    tokens_before = int(data["response_mask"].values().sum())
    trainer_step(data, cfg)
    with_entropy = cfg.actor_rollout_ref.actor.entropy_coeff != 0
    stock, stock_metrics = stock_loss(cfg, data, values, entropy, with_entropy=with_entropy)
    (stock_grad,) = torch.autograd.grad(stock, values)
    remote, remote_metrics = remote_loss(cfg, data, values, entropy, with_entropy=with_entropy)
    (remote_grad,) = torch.autograd.grad(remote, values)

    assert stock.item() != 0.0 and stock_grad.abs().sum() > 0
    if "rs" in case.split("-"):  # rejection bit: some tokens (whole rows, for a row criterion) left the loss
        if "bypass_mode" in case:
            assert remote_metrics["rollout_corr/rollout_rs_masked_fraction"] > 0
        else:
            assert int(data["response_mask"].values().sum()) < tokens_before
    torch.testing.assert_close(remote.detach(), stock.detach(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(remote_grad, stock_grad, rtol=1e-5, atol=1e-8)
    # folded into the advantages, a weight of 0 (IcePop) leaves its token unclipped in pg_clipfrac: a metric only
    weights = data.get("rollout_is_weights", None)
    zero_weights = weights is not None and bool((weights.values() == 0).any())
    for name in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "kl_loss", "actor/entropy_loss",
                 "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_mean"):
        if name in stock_metrics and not (zero_weights and name == "actor/pg_clipfrac"):
            assert remote_metrics[name] == pytest.approx(metric(stock_metrics[name]), rel=1e-5, abs=1e-7), name


def metric(value) -> float:
    """A float of one of ppo_loss's metrics (verl's ``Metric`` holds a list of values)."""
    values = getattr(value, "values", None)
    if values is not None:
        (value,) = values
    return float(value)


def test_every_registered_verl_policy_loss_is_served_or_refused_by_name():
    """verl 0.9.1's registry is the list: each loss mode maps to a server loss or is named in the refusal."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl.remote_backend.errors import RemoteBackendConfigError
    from verl.workers.remote_client.arctic.loss_config import (
        POLICY_LOSS_NAMES,
        VERL_UNSERVED_LOSS_MODES,
        loss_fn_name,
    )
    from verl.workers.remote_client.common.verl_settings import VerlSettings

    assert set(POLICY_LOSS_NAMES) | set(VERL_UNSERVED_LOSS_MODES) == set(POLICY_LOSS_REGISTRY)
    assert not set(POLICY_LOSS_NAMES) & set(VERL_UNSERVED_LOSS_MODES)
    for mode in VERL_UNSERVED_LOSS_MODES:
        cfg = verl_main_config(actor(policy_loss={"loss_mode": mode}))
        with pytest.raises(RemoteBackendConfigError) as err:
            loss_fn_name(VerlSettings.from_main_config(cfg))
        assert err.value.field == "actor_rollout_ref.actor.policy_loss.loss_mode" and err.value.received == mode
