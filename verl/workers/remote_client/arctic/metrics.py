"""Metrics of the Arctic adapter under verl 0.9.1's names, and the model-FLOPs-utilisation estimate.

Names: verl's engine worker returns from ``update_actor`` a ``metrics`` dict of per-mini-batch
lists whose policy-loss keys come prefixed from its loss (``actor/pg_loss``, ``actor/pg_clipfrac``,
``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy_loss``) and whose other keys are bare
(``loss``, ``grad_norm``, ``lr``, ``kl_loss``, ``kl_coef``, ``mfu``): the trainer then adds ``actor/``
to the bare ones (``rename_dict``) and moves ``actor/mfu`` to ``perf/mfu/actor``. ``actor/entropy``
is not a worker metric: the trainer computes it from ``compute_log_prob``'s ``entropy``.
:func:`mini_batch_metrics` maps the metrics of a mini-batch's one ``/forward-backward`` (token
means over the mini-batch, as the server reports them) and its ``/step`` onto exactly those keys.

MFU: FLOPs are estimated as ``2 * params * tokens`` for a forward pass and ``6 * params * tokens``
for forward+backward (attention FLOPs ignored, the usual dense approximation), where ``tokens``
counts the real tokens of the batch (ZoRRO's savings therefore *raise* the reported MFU, as they
raise useful throughput). ``mfu = flops / seconds / (peak_tflops_per_device * 1e12 * devices)``,
with ``seconds`` the wall time of the HTTP calls. The server's device peak is not observable
from the client: without ``remote_backend.mfu.peak_tflops_per_device`` the metric is 0.0.

Memory: the reference server adds every job's memory by part to each ``/forward-backward``'s metrics
(``memory/<job type>/<part>_gib``, docs/SERVER.md "Memory"); they come out as
``actor/arctic/memory/<job type>/<part>_gib`` in verl's metrics (the vendor's server sends none).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["FlopsEstimator", "mini_batch_metrics"]

logger = logging.getLogger(__name__)

#: server metric name -> verl worker metric name. The names are the vendor's ``verl_grpo`` loss's (v1 and
#: v2; our reference server emits the same), which are already verl's. One ``/forward-backward`` per
#: mini-batch: the server reports the call's token means (``.sum``/``.tokens`` pairs collapsed over its
#: micro-batches and ranks), so each value is the mini-batch's as it is -- never added up over calls.
_TOKEN_MEANS = {
    "loss": "loss",
    "actor/pg_loss": "actor/pg_loss",
    "actor/pg_clipfrac": "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower": "actor/pg_clipfrac_lower",
    "actor/ppo_kl": "actor/ppo_kl",
    "actor/entropy_loss": "actor/entropy_loss",
    "kl_loss": "kl_loss",
    "kl_coef": "kl_coef",
}
#: server bookkeeping passed on under the adapter's prefix (ZoRRO's savings are visible there; the reference
#: server reports whether a ZoRRO request took the ZoRRO pass, the share of tokens that pass saves, and the
#: model passes the call ran: its micro-batches, or fewer where ZoRRO packed them)
_COUNTED = {
    "tokens_computed": "arctic/tokens_computed",
    "zorro_applied": "arctic/zorro_applied",
    "zorro_token_saving": "arctic/zorro_token_saving",
    "zorro_time_ratio": "arctic/zorro_time_ratio",
    "passes": "arctic/passes",
}


#: the reference server's memory report in a /forward-backward's metrics: ``memory/<job type>/<part>_gib``, every
#: job's (``training``, ``log_prob``, ``sampling``), passed on as ``arctic/memory/...`` (verl: ``actor/arctic/memory/...``)
_MEMORY_PREFIX = "memory/"


def _scalar(value: Any) -> float | None:
    """A float from a number or a per-rank list (mean); None for anything else."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        return float(sum(value) / len(value))
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        return float(value.item())
    return None


def mini_batch_metrics(call: Mapping[str, Any], step: Mapping[str, Any], *, kl_coef: float | None) -> dict[str, float]:
    """One optimizer step's metrics from its ``/forward-backward``'s metrics and ``/step``'s.

    Names are the vendor loss's (:data:`_TOKEN_MEANS`); a ``.sum``/``.tokens`` pair that a server
    left uncollapsed is collapsed here. ``kl_coef`` (when the call reports ``kl_loss``) is the
    configured one.
    """
    out: dict[str, float] = {}
    for name, value in call.items():
        if name.endswith(".sum"):
            tokens = _scalar(call.get(name[: -len(".sum")] + ".tokens"))
            number = _scalar(value)
            if tokens is None or number is None:
                continue
            name, value = name[: -len(".sum")], (number / tokens if tokens > 0 else 0.0)
        # verl's bypass_mode loss reports its rollout-correction diagnostics under rollout_corr/...: as they are
        target = _TOKEN_MEANS.get(name) or _COUNTED.get(name) or (name if name.startswith("rollout_corr/") else None)
        if name.startswith(_MEMORY_PREFIX):  # the server's memory by job and part (GiB)
            target = "arctic/" + name
        number = _scalar(value)
        if target is not None and number is not None:
            out[target] = number
    if kl_coef is not None and "kl_loss" in out:
        out["kl_coef"] = float(kl_coef)
    grad_norm = _scalar(step.get("grad_norm"))
    if grad_norm is not None:
        out["grad_norm"] = grad_norm
    lr = _scalar(step.get("last_lr", step.get("lr")))
    if lr is not None:
        out["lr"] = lr
    return out


class FlopsEstimator:
    """``mfu`` from a parameter count (read from the model config without loading weights)."""

    def __init__(self, model_path: str, *, peak_tflops_per_device: float | None, trust_remote_code: bool = False,
                 num_params: int | None = None) -> None:
        self.model_path = model_path
        self.peak_tflops_per_device = peak_tflops_per_device
        self.trust_remote_code = trust_remote_code
        self._num_params = num_params

    @property
    def num_params(self) -> int:
        """Parameters of the model, counted on the ``meta`` device (no memory, no download of weights)."""
        if self._num_params is None:
            self._num_params = 0
            try:
                import torch
                from transformers import AutoConfig, AutoModelForCausalLM

                config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config, trust_remote_code=self.trust_remote_code)
                self._num_params = sum(p.numel() for p in model.parameters())
            except Exception as exc:  # noqa: BLE001 - a metric must never fail a training step
                logger.warning("mfu: cannot count the parameters of %s (%s); reporting mfu 0.0", self.model_path, exc)
        return self._num_params

    def flops(self, tokens: int, *, training: bool) -> float:
        return (6.0 if training else 2.0) * self.num_params * float(tokens)

    def mfu(self, tokens: int, seconds: float, *, devices: int, training: bool) -> float:
        if not self.peak_tflops_per_device or seconds <= 0 or tokens <= 0:
            return 0.0
        value = self.flops(tokens, training=training) / seconds / (self.peak_tflops_per_device * 1e12 * devices)
        return value if math.isfinite(value) else 0.0
