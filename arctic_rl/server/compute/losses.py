"""The reference server's losses, resolved only from a fixed allow-list of names.

A ``/forward-backward`` body names its loss in ``processing.loss_fn``. The vendor's server imports
any dotted path it receives there (remote code execution by whoever reaches the port); this module
maps the names of :data:`arctic_rl.protocol.LOSS_NAMES` to functions defined here and answers any
other name with :class:`LossNameError` -- it never imports anything a request names.

verl 0.9.1's policy losses (``core_algos``), each combined as verl's ``ppo_loss`` does:
``pg_loss - entropy_coeff * entropy + kl_loss_coef * kl`` (optional KL penalty to the reference policy,
``kl_penalty``: ``low_var_kl``/``kl``/``abs``/``mse``; optional entropy bonus), aggregated by ``loss_agg_mode``:

* ``verl_grpo``, ``grpo``: ``compute_policy_loss_vanilla`` -- the PPO clipped surrogate with asymmetric
  clip ratios, optional dual clip for negative advantages and optional ``rollout_is_weights``.
* ``verl_gspo``: ``compute_policy_loss_gspo`` -- the clipped *sequence* ratio (mean log-ratio of the row),
  no dual clip, optional ``rollout_is_weights``.
* ``verl_bypass_mode``: ``compute_policy_loss_bypass_mode`` -- ``old_log_probs`` are the rollout's; the IS
  weights and rejection mask of ``config.rollout_correction`` are computed from the current log-probs
  (:mod:`arctic_rl.server.compute.rollout_correction`), then ``loss_type`` ``ppo_clip`` (vanilla on the rejection
  mask, no weights: the ratio is the correction) or ``reinforce`` (``-A * logprob * w``, no clipping).
* ``sft``, ``sft_ce``, ``cross_entropy``: masked cross-entropy ``-log p(token)``.

Inputs are *response-sliced* ``[B, R]`` tensors (the last ``R`` columns of the body's left-padded
RL tensors) next to a :class:`~arctic_rl.server.compute.token_logprobs.TokenLogprobs`. ``loss_scale_tokens``
replaces the token count of ``token-mean`` (a global token mean over the micro-batches of a step);
the loss-valued metrics (``loss``, ``actor/pg_loss``, ``kl_loss``, ``actor/entropy_loss``,
``sft_loss``) use the same aggregation as the loss, so they add up over micro-batches like the loss
does. An empty mask gives a zero loss (and zero gradients), never NaN.

Metric names are the vendor's ``verl_grpo`` loss's (``integrations/verl/grpo_loss.py``), which its
own verl client hands to verl unchanged: ``actor/pg_loss``, ``actor/pg_clipfrac``,
``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy_loss``, ``loss``, ``kl_loss`` and
``kl_coef`` (with ``use_kl_loss``).

What is not here: log-prob computation (:mod:`arctic_rl.server.compute.token_logprobs`), optimizer steps, HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from arctic_rl.protocol import LOSS_NAMES, LossConfig, RolloutCorrection
from arctic_rl.server.compute.rollout_correction import correction_weights, rejection_mask
from arctic_rl.server.compute.token_logprobs import TokenLogprobs

__all__ = ["DEFAULT_LOSS", "LOSS_FUNCTIONS", "LossFn", "LossNameError", "bypass_mode_loss", "compute_loss", "gspo_loss",
           "kl_penalty", "ppo_clip_loss", "resolve_loss"]

LossFn = Callable[[TokenLogprobs, Mapping[str, torch.Tensor], LossConfig], tuple[torch.Tensor, dict[str, float]]]
#: the loss of a forward-backward body whose ``processing.loss_fn`` is null
DEFAULT_LOSS = "grpo"
#: verl clamps the log-ratio before ``exp`` (``compute_policy_loss_vanilla``)
_LOG_RATIO_CLAMP = 20.0


class LossNameError(ValueError):
    """A loss name outside the allow-list. ``allowed`` and ``received`` are kept for a 400 body."""

    def __init__(self, received: Any, allowed: tuple[str, ...]) -> None:
        self.received = received
        self.allowed = list(allowed)
        super().__init__(f"processing.loss_fn: expected one of {self.allowed}, got {received!r}")

    def __reduce__(self):  # picklable with its arguments
        return (type(self), (self.received, tuple(self.allowed)))


# --------------------------------------------------------------------------------------------
# Validation and aggregation
# --------------------------------------------------------------------------------------------


def _tensor(batch: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], *, required: bool = True):
    value = batch.get(name)
    if value is None:
        if required:
            raise ValueError(f"{name}: expected a {list(shape)} tensor in the batch, got none (keys: {sorted(batch)})")
        return None
    if not isinstance(value, torch.Tensor):
        raise ValueError(  # noqa: TRY004 - the server answers every ValueError of a loss input with a 400
            f"{name}: expected a torch.Tensor of shape {list(shape)}, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)} (response-sliced [B, R]), got {list(value.shape)}")
    return value


def _float_tensor(batch: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], *, required: bool = True):
    value = _tensor(batch, name, shape, required=required)
    if value is None:
        return None
    if not value.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point dtype, got {value.dtype}")
    if not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name}: expected finite values, got {bad} non-finite (nan/inf) of {value.numel()}")
    return value


def _mask(batch: Mapping[str, torch.Tensor], names: tuple[str, str], shape: tuple[int, ...]) -> torch.Tensor:
    name = names[0] if batch.get(names[0]) is not None else names[1]
    value = _tensor(batch, name, shape, required=False)
    if value is None:
        raise ValueError(f"{names[0]}: expected a {list(shape)} mask ({names[0]} or {names[1]}), got none")
    if value.dtype == torch.bool:
        return value
    if value.is_floating_point() or value.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return value != 0
    raise ValueError(f"{name}: expected a bool, integer or float mask, got {value.dtype}")


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    kept = torch.where(mask, values, zeros)  # where, not multiply: a nan/inf under the mask stays out
    return kept.sum() if dim is None else kept.sum(dim)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked_sum(values, mask) / mask.sum().clamp_min(1)


def _aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """verl's ``agg_loss`` for the three modes of the protocol (single rank), as its actor calls it: token-mean
    over ``loss_scale_tokens`` (the mini-batch's tokens), the seq-means over the batch's rows."""
    mode = cfg.loss_agg_mode
    if mode == "token-mean":
        denom = cfg.loss_scale_tokens if cfg.loss_scale_tokens is not None else mask.sum().clamp_min(1)
        return _masked_sum(loss_mat, mask) / denom
    tokens_per_seq = mask.sum(-1)
    seq_losses = _masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / tokens_per_seq.clamp_min(1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(
            f"loss_agg_mode: expected one of token-mean, seq-mean-token-sum, seq-mean-token-mean, got {mode!r}"
        )
    # verl's actor divides by global_batch_size, the mini-batch's rows (fully masked ones included: a row
    # that rejection sampling emptied still counts); the engine's micro-batches are equal, so each one's
    # rows, with DeepSpeed's division by GAS, give that
    seq_mask = tokens_per_seq > 0
    return _masked_sum(seq_losses, seq_mask) / max(int(loss_mat.shape[0]), 1)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate to the reference policy (verl's ``kl_penalty_forward``)."""
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    if kind == "low_var_kl":  # k3 estimator, clamped like verl for stability
        log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
        return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_loss_type: expected one of ['low_var_kl', 'kl', 'abs', 'mse'], got {kind!r}")


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def _vanilla_pg(logprobs, old, adv, mask, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token losses of verl's ``compute_policy_loss_vanilla`` (before weights and aggregation)."""
    low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    log_ratio = (logprobs - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(unclipped, clipped)
    clipfrac = _masked_mean((clipped > unclipped).to(logprobs.dtype), mask)
    if cfg.clip_ratio_c is not None:  # dual clip: bound the loss of negative advantages by -A * c
        bound = -adv * cfg.clip_ratio_c
        negative = adv < 0
        clipfrac_lower = _masked_mean(((pg_losses > bound) & negative).to(logprobs.dtype), mask)
        pg_losses = torch.where(negative, torch.minimum(pg_losses, bound), pg_losses)
    else:
        clipfrac_lower = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return pg_losses, {
        "actor/pg_clipfrac": clipfrac.item(),
        "actor/pg_clipfrac_lower": clipfrac_lower.item(),
        "actor/ppo_kl": _masked_mean(-log_ratio.detach(), mask).item(),
    }


def _gspo_pg(logprobs, old, adv, mask, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token losses of verl's ``compute_policy_loss_gspo``: the sequence's mean log-ratio (no gradient)
    plus the token's own log-prob, so each token carries the sequence ratio's gradient share; no dual clip."""
    low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    log_ratio = logprobs - old
    seq_log_ratio = _masked_sum(log_ratio, mask, dim=-1) / mask.sum(-1).clamp_min(1)
    log_seq_ratio = (logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = log_seq_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), {
        "actor/pg_clipfrac": _masked_mean((clipped > unclipped).to(logprobs.dtype), mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
        "actor/ppo_kl": _masked_mean(-log_ratio.detach(), mask).item(),
    }


def _policy_loss(out: TokenLogprobs, batch: Mapping[str, torch.Tensor], cfg: LossConfig, mode: str):
    """verl's ``ppo_loss``: the policy loss of ``mode`` plus its optional entropy and KL terms."""
    logprobs = out.logprobs
    shape = tuple(logprobs.shape)
    mask = _mask(batch, ("response_mask", "loss_mask"), shape)
    old = _float_tensor(batch, "old_log_probs", shape).to(logprobs.dtype)
    adv = _float_tensor(batch, "advantages", shape).to(logprobs.dtype)
    weights = _float_tensor(batch, "rollout_is_weights", shape, required=False)
    weights = None if weights is None else weights.to(logprobs.dtype)
    pg_mask, extra = mask, {}
    if mode == "bypass_mode":  # old_log_probs are the rollout's: weights and rejection from the current policy
        rc = cfg.rollout_correction or RolloutCorrection()
        log_ratio = logprobs.detach() - old
        weights, extra = correction_weights(log_ratio, mask, rc)
        pg_mask, rs_metrics = rejection_mask(log_ratio, mask, rc)
        extra.update(rs_metrics)
        if rc.loss_type == "reinforce":
            pg_losses = -adv * logprobs * (weights if weights is not None else 1.0)
            pg_metrics = {"actor/ppo_kl": _masked_mean(-log_ratio, pg_mask).item()}
        else:  # ppo_clip: the ratio to the rollout is the correction; verl applies no weights here
            pg_losses, pg_metrics = _vanilla_pg(logprobs, old, adv, pg_mask, cfg)
    else:
        pg_losses, pg_metrics = (_gspo_pg if mode == "gspo" else _vanilla_pg)(logprobs, old, adv, mask, cfg)
        if weights is not None:
            pg_losses = pg_losses * weights
    pg_loss = _aggregate(pg_losses, pg_mask, cfg)
    loss = pg_loss
    metrics = {"actor/pg_loss": pg_loss.item(), **pg_metrics, **extra}
    if out.entropy is not None:
        if tuple(out.entropy.shape) != shape:
            raise ValueError(f"entropy: expected shape {list(shape)}, got {list(out.entropy.shape)}")
        entropy = _aggregate(out.entropy, mask, cfg)
        loss = loss - cfg.entropy_coeff * entropy
        metrics["actor/entropy_loss"] = entropy.item()
    elif cfg.entropy_coeff != 0.0:
        raise ValueError(
            f"entropy_coeff: a non-zero value ({cfg.entropy_coeff}) needs entropy; "
            "compute the log-probs with calculate_entropy=True"
        )
    if cfg.use_kl_loss:
        ref = _float_tensor(batch, "ref_log_prob", shape, required=False)
        if ref is None:
            raise ValueError(f"ref_log_prob: expected a {list(shape)} tensor when use_kl_loss is true, got none")
        kl = _aggregate(kl_penalty(logprobs, ref.to(logprobs.dtype), cfg.kl_loss_type), mask, cfg)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["kl_loss"] = kl.item()
        metrics["kl_coef"] = cfg.kl_loss_coef
    metrics["loss"] = loss.item()
    metrics["num_tokens"] = float(mask.sum().item())
    return loss, metrics


def ppo_clip_loss(out: TokenLogprobs, batch: Mapping[str, torch.Tensor], cfg: LossConfig):
    """verl's vanilla PPO/GRPO policy loss plus its optional KL and entropy terms."""
    return _policy_loss(out, batch, cfg, "vanilla")


def gspo_loss(out: TokenLogprobs, batch: Mapping[str, torch.Tensor], cfg: LossConfig):
    """verl's ``gspo`` policy loss (sequence-level clipped ratio) plus its optional KL and entropy terms."""
    return _policy_loss(out, batch, cfg, "gspo")


def bypass_mode_loss(out: TokenLogprobs, batch: Mapping[str, torch.Tensor], cfg: LossConfig):
    """verl's ``bypass_mode`` policy loss (``old_log_probs`` are the rollout's; ``cfg.rollout_correction``
    picks ``ppo_clip`` or ``reinforce`` and the IS weights / rejection) plus its optional KL and entropy terms."""
    return _policy_loss(out, batch, cfg, "bypass_mode")


def sft_cross_entropy(out: TokenLogprobs, batch: Mapping[str, torch.Tensor], cfg: LossConfig):
    """Masked token cross-entropy ``-log p(token)`` aggregated by ``loss_agg_mode``."""
    shape = tuple(out.logprobs.shape)
    mask = _mask(batch, ("loss_mask", "response_mask"), shape)
    loss = _aggregate(-out.logprobs, mask, cfg)
    value = loss.item()
    return loss, {"loss": value, "sft_loss": value, "num_tokens": float(mask.sum().item())}


LOSS_FUNCTIONS: Mapping[str, LossFn] = MappingProxyType(
    {
        "verl_grpo": ppo_clip_loss,
        "grpo": ppo_clip_loss,
        "verl_gspo": gspo_loss,
        "verl_bypass_mode": bypass_mode_loss,
        "sft": sft_cross_entropy,
        "sft_ce": sft_cross_entropy,
        "cross_entropy": sft_cross_entropy,
    }
)
if tuple(sorted(LOSS_FUNCTIONS)) != tuple(sorted(LOSS_NAMES)):  # the protocol's list is the contract
    raise RuntimeError(f"LOSS_FUNCTIONS {sorted(LOSS_FUNCTIONS)} != arctic_rl.protocol.LOSS_NAMES {sorted(LOSS_NAMES)}")


def resolve_loss(name: str | None) -> LossFn:
    """The loss function of an allow-listed name (``None``: :data:`DEFAULT_LOSS`).

    Any other value -- a dotted path included -- raises :class:`LossNameError`; nothing is imported.
    """
    if name is None:
        name = DEFAULT_LOSS
    if not isinstance(name, str) or name not in LOSS_FUNCTIONS:
        raise LossNameError(name, LOSS_NAMES)
    return LOSS_FUNCTIONS[name]


def compute_loss(
    name: str | None,
    out: TokenLogprobs,
    batch: Mapping[str, torch.Tensor],
    cfg: LossConfig | Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar (differentiable) loss and float metrics of the named loss.

    ``batch`` holds response-sliced ``[B, R]`` tensors; ``cfg`` a :class:`LossConfig` (or its dict).
    """
    fn = resolve_loss(name)
    if cfg is None:
        cfg = LossConfig()
    elif not isinstance(cfg, LossConfig):
        cfg = LossConfig.model_validate(dict(cfg))
    if out.logprobs.ndim != 2:
        raise ValueError(f"logprobs: expected a 2-D [B, R] tensor, got shape {list(out.logprobs.shape)}")
    return fn(out, batch, cfg)
