"""Turn verl's JSONL metrics file into ``metrics.csv`` and a reward-curve PNG, and summarise the curve.

verl's file logger (``trainer.logger=[console,file]``, path from ``VERL_FILE_LOGGER_PATH``) writes one
line per ``log`` call: ``{"step": 3, "data": {"critic/score/mean": 0.51, "timing_s/gen": 1.2, ...}}``.
Several lines may share a step (validation is logged separately); they are merged.

``metrics.csv`` has one row per step and one column per numeric metric. ``reward_curve.png`` plots the
mean reward of each step's samples (verl calls it ``critic/score/mean``; GRPO trains no critic). The summary is
the learning bar of the examples: mean of the first ``--window`` steps and of the last ``--window`` steps
(5 by default, as the reverse-text example; the arithmetic example uses 10), their difference and the peak.
Other examples (examples/arithmetic) use this script too, with their own ``--title``.

Usage: ``python examples/reverse_text/plot.py METRICS.jsonl --out-dir DIR [--metric critic/score/mean]
[--window 5] [--title TEXT]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

REWARD_METRIC = "critic/score/mean"


def load_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` of the numeric metrics in a verl JSONL metrics file (steps ascending)."""
    merged: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict) or "step" not in rec or not isinstance(rec.get("data"), dict):
                raise ValueError(f'{path}:{lineno}: expected {{"step": int, "data": {{...}}}}, got {line[:80]!r}')
            row = merged.setdefault(int(rec["step"]), {})
            for key, value in rec["data"].items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                row[key] = float(value)
    return dict(sorted(merged.items()))


def metric_series(metrics: dict[int, dict[str, float]], name: str = REWARD_METRIC) -> tuple[list[int], list[float]]:
    """Steps and values of one metric, skipping steps that lack it (or hold NaN)."""
    steps, values = [], []
    for step, row in metrics.items():
        v = row.get(name)
        if v is not None and not math.isnan(v):
            steps.append(step)
            values.append(v)
    return steps, values


def summarize(values: list[float], k: int = 5) -> dict[str, Any]:
    """First-``k`` mean, last-``k`` mean, their difference (``gain``), peak and number of steps."""
    if len(values) < k:
        raise ValueError(f"values: need at least k={k} steps to summarise, got {len(values)}")
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    return {"steps": len(values), f"first{k}": round(first, 4), f"last{k}": round(last, 4),
            "gain": round(last - first, 4), "peak": round(max(values), 4)}


def write_csv(metrics: dict[int, dict[str, float]], path: str | Path) -> Path:
    """One row per step, one column per metric (empty where a step lacks it)."""
    keys = sorted({k for row in metrics.values() for k in row})
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["step", *keys])
        for step, row in metrics.items():
            w.writerow([step, *("" if k not in row else repr(row[k]) for k in keys)])
    return Path(path)


def axis_label(metric: str) -> str:
    """What the y axis shows: "mean reward" for verl's ``critic/score/mean`` (the mean reward of the step's
    samples; GRPO trains no critic, the name is verl's), else the metric's own name."""
    return "mean reward" if metric == REWARD_METRIC else metric


def plot_curve(steps: list[int], values: list[float], path: str | Path, *, metric: str = REWARD_METRIC,
               title: str = "reverse-text GRPO through verl + Arctic RL") -> Path:
    """Save a PNG of ``metric`` per step (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    label = axis_label(metric)
    ax.plot(steps, values, marker="o", markersize=3, linewidth=1.5, label=f"{label} ({metric})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(label)
    ax.set_ylim(0.0, 1.0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="verl JSONL metrics file (VERL_FILE_LOGGER_PATH)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--metric", default=REWARD_METRIC)
    p.add_argument("--title", default="reverse-text GRPO through verl + Arctic RL")
    p.add_argument("--window", type=int, default=5, help="steps averaged at each end of the curve in the summary")
    a = p.parse_args(argv)
    if a.window < 1:
        raise SystemExit(f"[plot] --window: expected >= 1, got {a.window}")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = load_metrics(a.metrics)
    steps, values = metric_series(metrics, a.metric)
    if not values:
        raise SystemExit(f"[plot] {a.metrics} has no {a.metric!r} values ({len(metrics)} steps logged)")
    csv_path = write_csv(metrics, out / "metrics.csv")
    try:
        png_path: Path | None = plot_curve(steps, values, out / "reward_curve.png", metric=a.metric, title=a.title)
    except ImportError:  # matplotlib is optional: the CSV and the summary do not need it
        png_path = None
        print("[plot] matplotlib is not installed: no reward_curve.png (pip install matplotlib)")
    summary = summarize(values, a.window) if len(values) >= a.window else {"steps": len(values)}
    summary = {"metric": a.metric, **summary, "csv": str(csv_path), "plot": str(png_path) if png_path else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[plot] {json.dumps(summary)}")
    return summary


if __name__ == "__main__":
    main()
