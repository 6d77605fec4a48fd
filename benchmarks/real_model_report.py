"""Compare GRPO runs of the real-model recipe: reward curves, reward per 10 steps, step time and its phases.

Reads the run directories the example scripts write (``examples/grpo/run_arithmetic_grpo_smollm2*.sh``:
verl's ``metrics.jsonl``, and ``gpu_mem.csv`` when the device runner logged ``nvidia-smi``), prints
markdown tables and writes one PNG with every run's reward curve:

* reward (``critic/score/mean``) per block of 10 steps, first-10 -> last-10 gain;
* median step time (``timing_s/step``) and the median of each phase verl times (``timing_s/gen``,
  ``timing_s/old_log_prob``, ``timing_s/update_actor``, ...) over the steps from ``--from-step`` on (default 3:
  steps 1-2 are start-up -- compiles, the first generation, the asynchronous mode's first batch), each run's
  ratio to the baseline run (the first ``--run`` unless ``--baseline`` names another), and the first step's time;
* steps and seconds until the 5-step moving mean of the reward first reaches ``--threshold``;
* GPU memory: the most in use on the device (``gpu_mem.csv``) and verl's ``perf/max_memory_allocated_gb``;
* where a remote run's phases lost time around the server's own seconds (:data:`GAP_PHASES`, from the
  ``timing_s/<phase>/worker``, ``/adapter``, ``/http`` and ``/server`` entries the backend's workers report): verl's
  phase less the server's seconds, split into verl's driver and Ray hop (phase - worker), verl's TransferQueue
  bridge (worker - adapter), the adapter's layout and encoding (adapter - http) and the transport with any wait at
  the server before its timer starts (http - server). The issue's goal is <= 0.1 s a phase.

The PNG plots reward against the step, or with ``--wall-clock`` against the seconds the steps took (the sum of
``timing_s/step``: where an asynchronous run shows its worth).

    python benchmarks/real_model_report.py --run "stock verl, short=DIR" --run "arctic, ZoRRO off, short=DIR" \
        [--baseline LABEL] [--threshold 0.5] [--from-step 3] [--png curves.png [--wall-clock]]

No GPU and no verl import: it only reads files (``--smoke`` runs it on generated metrics).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REWARD = "critic/score/mean"
STEP = "timing_s/step"
SAVE = "timing_s/save_checkpoint"
ADV_MAX, ADV_MIN = "critic/advantages/max", "critic/advantages/min"
BLOCK = 10
#: the phases whose gap to the server's own seconds is reported (verl's timer names)
GAP_PHASES = ("old_log_prob", "ref", "update_actor", "update_weights")
#: (column, minuend, subtrahend) of the gap's parts: suffixes of ``timing_s/<phase>`` ("" = verl's phase itself)
GAP_PARTS = (("driver + Ray hop", "", "/worker"), ("bridge", "/worker", "/adapter"), ("adapter", "/adapter", "/http"),
             ("HTTP + wait", "/http", "/server"))


@dataclass
class Run:
    label: str
    rows: dict[int, dict[str, float]]
    gpu_mem_mib: float | None = None
    notes: list[str] = field(default_factory=list)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(s, r[key]) for s, r in self.rows.items() if key in r and not math.isnan(r[key])]

    def median(self, key: str, from_step: int = 1) -> float | None:
        """The median of ``key`` over steps ``from_step`` on (all steps when the run has none that late)."""
        return _median(self.series(key), from_step)

    def step_series(self) -> list[tuple[int, float]]:
        """Each step's seconds less the checkpoint save inside it (``timing_s/save_checkpoint``): the remote recipe
        saves at its last step and stock verl's at none, so steps compare on their training work."""
        return [(s, v - self.rows[s].get(SAVE, 0.0)) for s, v in self.series(STEP)]

    def step_median(self, from_step: int = 1) -> float | None:
        return _median(self.step_series(), from_step)

    def first(self, key: str) -> float | None:
        series = self.series(key)
        return series[0][1] if series else None


def _median(series: list[tuple[int, float]], from_step: int) -> float | None:
    values = [v for s, v in series if s >= from_step] or [v for _, v in series]
    return statistics.median(values) if values else None


def _load_metrics():
    """``load_metrics`` of the examples' plot script (one reader of verl's metrics file), loaded by path."""
    path = Path(__file__).resolve().parents[1] / "examples" / "reverse_text" / "plot.py"
    spec = importlib.util.spec_from_file_location("_examples_plot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_metrics


def load_run(label: str, run_dir: Path) -> Run:
    """One run directory: its ``metrics.jsonl`` merged per step, and the peak of its ``gpu_mem.csv``."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"--run {label}={run_dir}: no metrics.jsonl there")
    try:
        rows = _load_metrics()(metrics)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    run = Run(label, rows)
    mem = run_dir / "gpu_mem.csv"
    if mem.is_file():
        used = []
        with mem.open(encoding="utf-8") as f:
            for rec in csv.reader(f):  # MiB in the last column: "8339", "8339 MiB" or "<timestamp>, 8339"
                value = rec[-1].strip().split(" ")[0] if rec else ""
                if value.replace(".", "", 1).isdigit():
                    used.append(float(value))
        run.gpu_mem_mib = max(used) if used else None
    return run


def blocks(run: Run) -> list[float]:
    """Mean reward of steps 1-10, 11-20, ... (a last, shorter block included)."""
    series = run.series(REWARD)
    out = []
    for start in range(0, len(series), BLOCK):
        chunk = [v for _, v in series[start : start + BLOCK]]
        out.append(sum(chunk) / len(chunk))
    return out


def time_to(run: Run, threshold: float, window: int = 5) -> tuple[int, float] | None:
    """(step, seconds since the first step) where the ``window``-step moving mean first reaches ``threshold``."""
    series = run.series(REWARD)
    step_s = dict(run.series(STEP))
    elapsed = 0.0
    for i, (step, _) in enumerate(series):
        elapsed += step_s.get(step, 0.0)
        if i + 1 >= window and sum(v for _, v in series[i + 1 - window : i + 1]) / window >= threshold:
            return step, elapsed
    return None


def zero_signal_steps(run: Run) -> tuple[int, int] | None:
    """(steps whose advantages were all zero, steps with a reward strictly between 0 and 1), or None when verl
    logged no advantages. A step of the second kind has a group where some samples were right, so in GRPO
    (n > 1 samples per prompt, different samples) it should rarely be of the first kind: many such steps mean
    the samples of a group were identical (e.g. sampled with one seed) and nothing was learned from them."""
    rows = [row for row in run.rows.values() if ADV_MAX in row and ADV_MIN in row and REWARD in row]
    if not rows:
        return None
    mixed = [row for row in rows if 0.0 < row[REWARD] < 1.0]
    return sum(1 for row in mixed if row[ADV_MAX] == 0.0 and row[ADV_MIN] == 0.0), len(mixed)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def report(runs: list[Run], baseline: Run, threshold: float, from_step: int = 3) -> str:
    lines = []
    width = max(len(blocks(r)) for r in runs)
    head = [f"steps {i * BLOCK + 1}-{(i + 1) * BLOCK}" for i in range(width)]
    lines += ["| run | steps | " + " | ".join(head) + " | first 10 -> last 10 |",
              "|---|---|" + "---|" * width + "---|"]
    for r in runs:
        b = blocks(r)
        series = [v for _, v in r.series(REWARD)]
        gain = (sum(series[-BLOCK:]) / len(series[-BLOCK:]) - sum(series[:BLOCK]) / len(series[:BLOCK])) if series else None
        cells = [_fmt(x) for x in b] + ["-"] * (width - len(b))
        lines.append(f"| {r.label} | {len(series)} | " + " | ".join(cells) + f" | {_fmt(gain, '+.3f')} |")
    phases = sorted({k for r in runs for row in r.rows.values() for k in row if k.startswith("timing_s/")} - {STEP})
    base_step = baseline.step_median(from_step)
    lines += ["", f"| run (medians from step {from_step}, s) | step (checkpoint saves out) | vs {baseline.label} | first step | "
              + " | ".join(p[9:] for p in phases) + " |", "|---|---|---|---|" + "---|" * len(phases)]
    for r in runs:
        step = r.step_median(from_step)
        ratio = step / base_step if step and base_step else None
        lines.append(f"| {r.label} | {_fmt(step, '.2f')} | {_fmt(ratio, '.2f')}x | {_fmt(r.first(STEP), '.1f')} | "
                     + " | ".join(_fmt(r.median(p, from_step), ".2f") for p in phases) + " |")
    head = (f"| run | reward >= {threshold} (5-step mean) at | GPU memory in use, max (GiB) | "
            "verl max_memory_allocated (GiB) | all-zero advantages (of steps with 0 < reward < 1) |")
    lines += ["", head, "|---|---|---|---|---|"]
    for r in runs:
        hit = time_to(r, threshold)
        where = f"step {hit[0]}, {hit[1]:.0f} s" if hit else "not reached"
        mem = r.gpu_mem_mib / 1024 if r.gpu_mem_mib is not None else None
        alloc = max((v for _, v in r.series("perf/max_memory_allocated_gb")), default=None)
        zero = zero_signal_steps(r)
        flat = "-" if zero is None else f"{zero[0]} of {zero[1]}"
        lines.append(f"| {r.label} | {where} | {_fmt(mem, '.1f')} | {_fmt(alloc, '.1f')} | {flat} |")
    gaps = gap_rows(runs, from_step)
    if gaps:
        lines += ["", f"| run | phase (medians from step {from_step}, s) | verl | server | gap | "
                  + " | ".join(name for name, _, _ in GAP_PARTS) + " |", "|---|---|---|---|---|" + "---|" * len(GAP_PARTS)]
        lines += gaps
    return "\n".join(lines)


def gap_rows(runs: list[Run], from_step: int) -> list[str]:
    """One table row per run and phase that reported the server's seconds (see the module docstring)."""
    rows = []
    for r in runs:
        for phase in GAP_PHASES:
            key = f"timing_s/{phase}"
            server = r.median(key + "/server", from_step)
            if server is None:
                continue
            verl = r.median(key, from_step)
            gap, *parts = [  # per step, then the median: the parts of one step add up to its gap
                _median([(s, row[key + a] - row[key + b]) for s, row in r.rows.items()
                         if key + a in row and key + b in row], from_step)
                for a, b in [("", "/server")] + [(a, b) for _, a, b in GAP_PARTS]]
            rows.append(f"| {r.label} | {phase} | {_fmt(verl, '.2f')} | {_fmt(server, '.2f')} | {_fmt(gap, '.2f')} | "
                        + " | ".join(_fmt(x, ".2f") for x in parts) + " |")
    return rows


def wall_clock(run: Run) -> list[tuple[float, float]]:
    """(seconds since the run's first step began, reward) at the end of each step that has both."""
    step_s, elapsed, out = dict(run.series(STEP)), 0.0, []
    for step, value in run.series(REWARD):
        if step in step_s:
            elapsed += step_s[step]
            out.append((elapsed, value))
    return out


def plot(runs: list[Run], path: Path, threshold: float, wall: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in runs:
        points = wall_clock(r) if wall else r.series(REWARD)
        xs, values = zip(*points) if points else ((), ())
        ax.plot(xs, values, label=r.label, linewidth=1.2)
    ax.axhline(threshold, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("seconds of steps (sum of timing_s/step)" if wall else "GRPO step")
    ax.set_ylabel(REWARD)
    ax.set_title("SmolLM2-135M-Instruct, arithmetic GRPO")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _smoke_runs(root: Path) -> list[str]:
    """Two generated run directories (a faster one that learns sooner), as ``LABEL=DIR`` arguments."""
    specs = []
    for label, pace, step_s in (("baseline", 0.010, 4.0), ("candidate", 0.012, 3.0)):
        d = root / label
        d.mkdir(parents=True)
        with (d / "metrics.jsonl").open("w", encoding="utf-8") as f:
            for step in range(1, 51):
                data = {REWARD: min(1.0, 0.2 + pace * step), STEP: step_s, "timing_s/gen": step_s / 2,
                        "perf/max_memory_allocated_gb": 10.0}
                f.write(json.dumps({"step": step, "data": data}) + "\n")
        (d / "gpu_mem.csv").write_text("memory.used [MiB]\n20480 MiB\n30720 MiB\n", encoding="utf-8")
        specs.append(f"{label}={d}")
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", default=[], metavar="LABEL=DIR", help="a run directory (repeat)")
    p.add_argument("--baseline", help="the label step times are compared with (default: the first run)")
    p.add_argument("--threshold", type=float, default=0.5, help="reward to reach (5-step moving mean)")
    p.add_argument("--from-step", type=int, default=3, help="medians over the steps from this one on (default 3)")
    p.add_argument("--png", type=Path, help="write every run's reward curve into this PNG")
    p.add_argument("--wall-clock", action="store_true", help="the PNG's x axis: seconds of steps, not steps")
    p.add_argument("--smoke", action="store_true", help="run on two generated runs (CPU check)")
    args = p.parse_args(argv)
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="real_model_report_")
        args.run = _smoke_runs(Path(tmp.name))
        args.png = args.png or Path(tmp.name) / "curves.png"
    if not args.run:
        p.error("--run LABEL=DIR: at least one run directory is needed")
    runs = []
    for spec in args.run:
        label, sep, where = spec.partition("=")
        if not sep or not label or not where:
            p.error(f"--run: expected LABEL=DIR, got {spec!r}")
        runs.append(load_run(label, Path(where)))
    by_label = {r.label: r for r in runs}
    if args.baseline is not None and args.baseline not in by_label:
        p.error(f"--baseline: expected one of {sorted(by_label)}, got {args.baseline!r}")
    if args.from_step < 1:
        p.error(f"--from-step: expected a step number >= 1, got {args.from_step}")
    baseline = by_label[args.baseline] if args.baseline else runs[0]
    print(report(runs, baseline, args.threshold, args.from_step))
    if args.png:
        plot(runs, args.png, args.threshold, wall=args.wall_clock)
        print(f"\ncurves: {args.png}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
