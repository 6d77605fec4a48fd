"""One ``/forward-backward``'s metrics from those of its micro-batches (token means over the call, as the vendor
reports them).

What is not here: the losses that produce the metrics (:mod:`arctic_rl.server.compute.losses`), the engine.
"""

from __future__ import annotations

__all__ = ["LOSS_METRICS", "combine_micro_metrics"]

#: loss-valued metrics: with ``token-mean`` each micro-batch's value is its masked sum / the mini-batch's tokens
LOSS_METRICS = ("loss", "actor/pg_loss", "kl_loss", "actor/entropy_loss", "sft_loss")


def combine_micro_metrics(parts: list[tuple[dict[str, float], float]], *, token_mean: bool,
                           denom: float | None) -> dict[str, float]:
    """One call's metrics from its micro-batches', as the vendor reports them: token means over the call.

    Ratio metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``, ...) are per-micro-batch token means: weighted by tokens.
    Loss-valued metrics under ``token-mean`` are masked sums / ``denom``: ``sum * denom / tokens`` is
    the call's token mean. Under the seq-mean modes each micro-batch holds the same number of rows:
    their plain mean."""
    tokens = sum(t for _, t in parts)
    names = {k for m, _ in parts for k in m if k != "num_tokens"}
    out: dict[str, float] = {}
    for name in sorted(names):
        values = [(m[name], t) for m, t in parts if name in m]
        if name in LOSS_METRICS and token_mean and denom:
            out[name] = sum(v for v, _ in values) * denom / tokens if tokens else 0.0
        elif name in LOSS_METRICS:
            out[name] = sum(v for v, _ in values) / len(values)
        else:
            weight = sum(t for _, t in values)
            out[name] = sum(v * t for v, t in values) / weight if weight else sum(v for v, _ in values) / len(values)
    return out
