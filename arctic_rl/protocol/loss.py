"""The loss a ``/forward-backward`` call asks for: the allow-lists of loss and post-processor names,
and :class:`LossConfig` (``processing.config``) with its ``rollout_correction``.

A request never names code: a loss or post-processor off these lists is a 400 at our server (the
vendor's imports any dotted path it is sent).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Strict

__all__ = [
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "LOSS_NAMES",
    "POST_PROCESSORS",
    "ROLLOUT_RS_OPTIONS",
    "SFT_LOSS_NAMES",
    "LossConfig",
    "RolloutCorrection",
]

#: Loss functions by name. A request never names code: anything else is a 400.
LOSS_NAMES: tuple[str, ...] = ("verl_grpo", "grpo", "verl_gspo", "verl_bypass_mode", "sft", "sft_ce", "cross_entropy")
SFT_LOSS_NAMES: tuple[str, ...] = ("sft", "sft_ce", "cross_entropy")
POST_PROCESSORS: tuple[str, ...] = (
    "compute_entropy_and_logprobs",
    "apply_temperature",
    "compute_entropy",
    "identity",
)
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_TYPES: tuple[str, ...] = ("low_var_kl", "kl", "abs", "mse")
#: verl 0.9.1's rejection-sampling criteria (``rollout_corr_helper``), comma-joined in ``rollout_rs``
ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip


class RolloutCorrection(Strict):
    """verl's ``policy_loss.rollout_correction`` as the ``verl_bypass_mode`` loss reads it: IS weights
    and rejection masks of the current policy against the rollout's log-probs (``old_log_probs``)."""

    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    #: verl's dataclass default (the actor's ``policy_loss.rollout_correction``) is ``sequence``
    rollout_is: Literal["token", "sequence"] | None = "sequence"
    #: an upper bound (truncation) or ``"lower_upper"`` (weights outside are zeroed)
    rollout_is_threshold: float | str | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_threshold(cls, value: float | str | None) -> float | str | None:
        if value is not None:
            bounds = [float(v) for v in str(value).split("_", 1)]  # a non-number: ValueError, a 400
            if min(bounds) <= 0 or bounds != sorted(bounds):
                raise ValueError(f"expected a positive bound or 'lower_upper' with 0 < lower <= upper, got {value!r}")
        return value

    @field_validator("rollout_rs")
    @classmethod
    def _rs_options(cls, value: str | None) -> str | None:
        if value is not None:
            bad = [o for o in value.split(",") if o.strip() not in ROLLOUT_RS_OPTIONS]
            if bad or not value.strip():
                raise ValueError(f"expected comma-separated options of {list(ROLLOUT_RS_OPTIONS)}, got {value!r}")
        return value


class LossConfig(Strict):
    """``processing.config`` of a ``/forward-backward`` call: the loss hyper-parameters."""

    clip_ratio: float = Field(0.2, ge=0.0)
    clip_ratio_low: float | None = Field(None, ge=0.0)
    clip_ratio_high: float | None = Field(None, ge=0.0)
    #: dual-clip lower bound for negative advantages (> 1); ``None`` disables dual clip
    clip_ratio_c: float | None = Field(3.0, gt=1.0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    entropy_coeff: float = 0.0
    #: divide the mean by this token count instead of the call's own (``global`` token-mean
    #: across the micro-batches of one step); ``None`` uses the call's own count.
    loss_scale_tokens: float | None = Field(None, gt=0.0)
    #: read by the ``verl_bypass_mode`` loss only (``None`` there: verl's defaults)
    rollout_correction: RolloutCorrection | None = None

    def wire_body(self) -> dict:
        """The JSON sent as ``processing.config``: every field, ``rollout_correction`` only where a loss reads
        it (set), so the vanilla body is the one the vendor's server always got."""
        return self.model_dump(mode="json", exclude={"rollout_correction"} if self.rollout_correction is None else None)
