"""The loss an Arctic server is asked to compute: verl's ``policy_loss.loss_mode`` -> ``processing.loss_fn``,
verl's actor settings -> :class:`arctic_rl.protocol.LossConfig`, and what a server's loss cannot do, refused
before any job runs.

The reference server computes verl 0.9.1's ``vanilla`` (``verl_grpo``), ``gspo`` (``verl_gspo``) and
``bypass_mode`` (``verl_bypass_mode``, with ``policy_loss.rollout_correction``) policy losses and lists
``policy_losses`` in ``/health``'s features. The vendor's server lists no features; its only loss,
``verl_grpo``, is verl's vanilla loss with the clip ratios fixed at 0.2 and dual clip at 3.0
(``integrations/verl/grpo_loss.py``): any other loss mode or clip setting is refused there
(:func:`check_loss_support`), never run with other values than asked. verl's other registered losses
(:data:`VERL_UNSERVED_LOSS_MODES`) are refused everywhere, by name.

What is not here: the batch the loss reads (:mod:`.layout`), the call (:mod:`.training`).
"""

from __future__ import annotations

import torch

from arctic_rl.protocol import Features, LossConfig, RolloutCorrection
from verl.remote_backend.errors import RemoteBackendConfigError

from ..common.verl_settings import KL_TYPE_ALIASES, VerlSettings
from .layout import fold_is_weights

__all__ = ["POLICY_LOSS_NAMES", "VENDOR_FIXED_LOSS", "VERL_UNSERVED_LOSS_MODES", "apply_is_weights",
           "build_loss_config", "check_loss_support", "loss_body", "loss_fn_name"]

_ACTOR = "actor_rollout_ref.actor"

#: what the vendor's ``verl_grpo`` loss uses whatever it is sent (its clip ratios are constants)
VENDOR_FIXED_LOSS = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
#: verl 0.9.1's ``policy_loss.loss_mode`` values the reference server computes, by the loss it names
POLICY_LOSS_NAMES = {"vanilla": "verl_grpo", "gspo": "verl_gspo", "bypass_mode": "verl_bypass_mode"}
#: verl 0.9.1's other registered policy losses (``core_algos.POLICY_LOSS_REGISTRY``): refused by name
VERL_UNSERVED_LOSS_MODES = ("dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo")
#: ``rollout_correction`` keys the trainer reads, not the loss (``bypass_mode``) or OmegaConf's (``_target_``)
_TRAINER_ONLY_CORRECTION = ("bypass_mode", "_target_")


def _loss_error(exc: ValueError, prefix: str) -> RemoteBackendConfigError:
    """A pydantic error of the loss config, named by its verl key."""
    errors = getattr(exc, "errors", list)()
    loc = ".".join(str(p) for p in errors[0]["loc"]) if errors else "loss"
    received = errors[0].get("input") if errors else None
    return RemoteBackendConfigError(f"{prefix}.{loc}", errors[0]["msg"] if errors else str(exc),
                                    allowed="see arctic_rl.protocol.LossConfig", received=received)


def _rollout_correction(verl: VerlSettings) -> RolloutCorrection:
    """``policy_loss.rollout_correction`` as verl's ``bypass_mode`` loss reads it: absent, the dataclass defaults
    of ``RolloutCorrectionConfig`` (``rollout_is: sequence``); a mapping, its keys and the loss's ``.get``
    defaults for the others (``rollout_is: None``)."""
    key = f"{_ACTOR}.policy_loss.rollout_correction"
    if verl.rollout_correction is None:
        return RolloutCorrection()
    given = {k: v for k, v in verl.rollout_correction.items() if k not in _TRAINER_ONLY_CORRECTION}
    unknown = sorted(set(given) - set(RolloutCorrection.model_fields))
    if unknown:
        raise RemoteBackendConfigError(f"{key}.{unknown[0]}", "not a field of verl's RolloutCorrectionConfig",
                                       allowed=sorted(RolloutCorrection.model_fields), received=unknown[0])
    try:
        return RolloutCorrection.model_validate({"rollout_is": None, **given})
    except ValueError as exc:
        raise _loss_error(exc, key) from None


def loss_fn_name(verl: VerlSettings) -> str:
    """``processing.loss_fn`` of verl's ``policy_loss.loss_mode``; any other mode is refused naming the key."""
    name = POLICY_LOSS_NAMES.get(verl.loss_mode)
    if name is None:
        raise RemoteBackendConfigError(
            f"{_ACTOR}.policy_loss.loss_mode", "no server-side counterpart of this verl policy loss (verl 0.9.1's "
            f"others: {', '.join(VERL_UNSERVED_LOSS_MODES)})", allowed=list(POLICY_LOSS_NAMES), received=verl.loss_mode)
    return name


def check_loss_support(verl: VerlSettings, features: frozenset[str] | set[str]) -> None:
    """Refuse, before any job runs, what the server's loss cannot compute. A server that lists no
    ``policy_losses`` feature (the vendor's: its only loss is ``verl_grpo``, verl's vanilla loss with the clip
    ratios fixed at 0.2 and dual clip at 3.0) gets the vanilla loss at those values or nothing."""
    loss_fn_name(verl)
    build_loss_config(verl, loss_scale_tokens=None)
    if Features.POLICY_LOSSES in features:
        return
    if verl.loss_mode != "vanilla":
        raise RemoteBackendConfigError(
            f"{_ACTOR}.policy_loss.loss_mode", "the server lists no 'policy_losses' feature (the vendor's server): "
            "its only loss is verl_grpo, verl's vanilla PPO clip", allowed=["vanilla"], received=verl.loss_mode)
    for key, fixed in VENDOR_FIXED_LOSS.items():
        value = getattr(verl, key)
        if key in ("clip_ratio_low", "clip_ratio_high") and value is None:
            value = verl.clip_ratio
        if value is None or float(value) != fixed:
            raise RemoteBackendConfigError(
                f"{_ACTOR}.{key}", f"the server lists no 'policy_losses' feature (the vendor's server): its verl_grpo "
                f"loss always uses {key}={fixed}" + (" (dual clip on)" if key == "clip_ratio_c" else ""),
                allowed=[fixed], received=value)


def build_loss_config(verl: VerlSettings, *, loss_scale_tokens: float | None) -> LossConfig:
    """``processing.config`` of /forward-backward from verl's actor config (``rollout_correction`` for
    ``loss_mode=bypass_mode`` only)."""
    loss_fn_name(verl)
    kl_type = KL_TYPE_ALIASES.get(verl.kl_loss_type)
    if kl_type is None:
        raise RemoteBackendConfigError(f"{_ACTOR}.kl_loss_type", "unsupported KL estimator",
                                       allowed=sorted(KL_TYPE_ALIASES), received=verl.kl_loss_type)
    correction = _rollout_correction(verl) if verl.loss_mode == "bypass_mode" else None
    try:
        return LossConfig(
            clip_ratio=verl.clip_ratio,
            clip_ratio_low=verl.clip_ratio_low,
            clip_ratio_high=verl.clip_ratio_high,
            clip_ratio_c=verl.clip_ratio_c,
            loss_agg_mode=verl.loss_agg_mode,
            use_kl_loss=verl.use_kl_loss,
            kl_loss_coef=verl.kl_loss_coef,
            kl_loss_type=kl_type,
            entropy_coeff=verl.entropy_coeff,
            loss_scale_tokens=loss_scale_tokens,
            rollout_correction=correction,
        )
    except ValueError as exc:  # pydantic: name the first bad field in verl's terms
        raise _loss_error(exc, _ACTOR) from None


def loss_body(loss: LossConfig) -> dict:
    """The JSON of ``loss`` as sent in ``processing.config`` (:meth:`LossConfig.wire_body`)."""
    return loss.wire_body()


def apply_is_weights(batch: dict[str, torch.Tensor], verl: VerlSettings) -> None:
    """The trainer's ``rollout_is_weights`` (decoupled mode), in place: folded into the advantages for the losses
    that multiply them in (:func:`.layout.fold_is_weights`), dropped for ``bypass_mode``, whose loss computes its
    own weights from the current log-probs and ignores the batch's (verl's ``compute_policy_loss_bypass_mode``)."""
    if verl.loss_mode == "bypass_mode":
        batch.pop("rollout_is_weights", None)
    else:
        fold_is_weights(batch)
