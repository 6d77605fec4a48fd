"""Rollout correction of the ``verl_bypass_mode`` loss: IS weights and rejection masks, as verl 0.9.1 computes them.

verl's ``bypass_mode`` policy loss (``core_algos.compute_policy_loss_bypass_mode``) takes the rollout's
log-probs as ``old_log_probs`` and, without gradient, compares the current policy with them
(``rollout_corr_helper.compute_rollout_correction_and_rejection_mask``). With ``log_ratio = logprob -
rollout_logprob`` (masked tokens only):

* IS weights (``rollout_is``): ``token``: ``exp(clamp(log_ratio, -20, 20))``; ``sequence``: ``exp`` of the
  clamped masked sum over the row, on every token of the row. A single threshold truncates them from above;
  ``"lower_upper"`` zeroes those outside the bounds. ``rollout_is_batch_normalize`` divides by their mean
  (over tokens, or over rows for ``sequence``) in the micro-batch, as verl's actor does on one rank.
* Rejection (``rollout_rs``, comma-joined, all must pass): per token ``k1 = -log_ratio``,
  ``k2 = log_ratio^2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio`` (``log_ratio`` clamped to +-20), taken
  per token or as a row's sum, mean or max; ``k1`` keeps ``log(lower) <= k1 <= log(upper)`` (one value ``u``:
  ``lower = 1/u``), the others ``stat <= upper``. A rejected token or row leaves the loss's mask.

Metrics carry verl's ``rollout_corr/`` names for the summary values (``rollout_is_mean``, ``rollout_is_max``,
``rollout_is_min``, ``rollout_rs_masked_fraction``); verl's fuller diagnostics (ESS, chi^2, PPL) are not computed.

What is not here: the losses that use them (:mod:`arctic_rl.server.compute.losses`), validation of the config's
types (:class:`arctic_rl.protocol.RolloutCorrection`).
"""

from __future__ import annotations

import math

import torch

from arctic_rl.protocol import RolloutCorrection

__all__ = ["SAFETY_BOUND", "correction_weights", "parse_is_threshold", "rejection_mask"]

#: verl's clamp of log-ratios before ``exp``
SAFETY_BOUND = 20.0


def _sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim)


def _mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    count = mask.sum() if dim is None else mask.sum(dim)
    return _sum(values, mask, dim) / (count + 1e-8)  # verl's masked_mean


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``(upper, lower)`` of ``rollout_is_threshold`` (``lower`` ``None``: truncation)."""
    parts = str(spec).strip().split("_", 1)
    if len(parts) == 1:
        return float(parts[0]), None
    return float(parts[1]), float(parts[0])


def correction_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrection
                       ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Detached IS weights ``[B, R]`` (zero off the mask), or ``None`` when ``rollout_is`` is off."""
    if cfg.rollout_is is None or cfg.rollout_is_threshold is None:
        return None, {}
    upper, lower = parse_is_threshold(cfg.rollout_is_threshold)
    with torch.no_grad():
        if cfg.rollout_is == "token":
            raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        else:
            raw = _sum(log_ratio, mask, -1).unsqueeze(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)
        raw = raw * mask
        if lower is None:
            weights = raw.clamp(max=upper)
        else:
            weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        metrics = {}
        if bool(mask.any()):
            metrics = {"rollout_corr/rollout_is_mean": _mean(weights, mask).item(),
                       "rollout_corr/rollout_is_max": weights[mask].max().item(),
                       "rollout_corr/rollout_is_min": weights[mask].min().item()}
        if cfg.rollout_is_batch_normalize:
            if cfg.rollout_is == "token":
                mean = _mean(weights, mask)
            else:
                rows = mask.sum(-1) > 0
                mean = _sum(_mean(weights, mask, -1), rows) / rows.sum().clamp_min(1e-8)
            if mean > 1e-8:
                weights = weights / mean
                metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean.item()
    return weights, metrics


def _rs_bounds(option: str, spec: str) -> tuple[float | None, float]:
    """``(lower, upper)`` of one option; ``k1`` bounds are ratios, returned as logs."""
    if option.endswith("k1"):
        lower, upper = (float(v) for v in spec.split("_", 1)) if "_" in spec else (1.0 / float(spec), float(spec))
        if lower <= 0 or upper <= 0 or lower > upper:
            raise ValueError(f"rollout_correction.rollout_rs_threshold: {option} needs 0 < lower <= upper, got {spec!r}")
        return math.log(lower), math.log(upper)
    if "_" in spec or float(spec) <= 0:
        raise ValueError(f"rollout_correction.rollout_rs_threshold: {option} takes one positive upper bound, "
                         f"got {spec!r}")
    return None, float(spec)


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrection
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The mask with rejected tokens/rows removed (``mask`` itself when ``rollout_rs`` is off)."""
    if cfg.rollout_rs is None:
        return mask, {}
    options = list(dict.fromkeys(o.strip() for o in cfg.rollout_rs.split(",") if o.strip()))
    if cfg.rollout_rs_threshold is None:
        raise ValueError("rollout_correction.rollout_rs_threshold: expected a threshold when rollout_rs is set, "
                         "got none")
    specs = [s.strip() for s in str(cfg.rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_correction.rollout_rs_threshold: expected 1 or {len(options)} thresholds "
                         f"(one per rollout_rs option), got {cfg.rollout_rs_threshold!r}")
    specs = specs * len(options) if len(specs) == 1 else specs
    with torch.no_grad():
        lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        stats = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": lr.exp() - 1.0 - lr}
        keep = torch.ones_like(mask)
        for option, spec in zip(options, specs, strict=True):
            lower, upper = _rs_bounds(option, spec)
            token = stats[option[-2:]]
            if option.startswith("token"):
                stat = token
            elif option.startswith("seq_sum"):
                stat = _sum(token, mask, -1).unsqueeze(-1)
            elif option.startswith("seq_mean"):
                stat = _mean(token, mask, -1).unsqueeze(-1)
            else:  # seq_max
                peak = token.masked_fill(~mask, float("-inf")).max(-1).values
                stat = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak).unsqueeze(-1)
            passed = stat <= upper if lower is None else (stat >= lower) & (stat <= upper)
            keep = keep & passed.expand_as(mask)
        kept = mask & keep
        fraction = _mean((~keep).to(log_ratio.dtype), mask).item() if bool(mask.any()) else 0.0
    return kept, {"rollout_corr/rollout_rs_masked_fraction": fraction}
