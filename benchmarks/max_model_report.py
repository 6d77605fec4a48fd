"""What one run of ``benchmarks/max_model.py`` came to, read from its files, and the table of all runs.

A run's folder (``WORK/results/NAME/``) holds what the runner wrote there: ``attempt.json`` when it started
(size, side, level, the settings: environment and Hydra overrides), ``console.txt`` (the script's terminal),
``gpu_mem.csv`` (``nvidia-smi`` every 200 ms: used, total MiB), and when it ended ``metrics.jsonl`` (verl's
file logger: one ``{"step": k, "data": {...}}`` line per step), ``run_tail.log`` (the last lines of the
script's ``run.log``) and ``result.json`` (:func:`analyze`'s answer plus the exit status and wall time).

:func:`analyze` decides the outcome: ``fit`` (every step ran and the script exited 0), ``oom`` (a line of any
log says the GPU -- or the host -- ran out of memory: :data:`OOM_PATTERNS`; the line is kept as evidence),
``timeout`` (the runner stopped it), ``error`` (anything else; the last error line is kept), or ``running``
(no ``result.json`` yet and no failure seen). It reads the peak of ``gpu_mem.csv`` (the whole GPU, as
``grpo_runs.sh`` samples it), each step's ``timing_s/step`` and the training process's own allocator peak:
``perf/max_memory_allocated_gb`` on stock verl, the largest ``actor/arctic/memory/<job>/device_max_allocated_gib``
through the adapter (the reference server's report, docs/SERVER.md "Memory").

    python benchmarks/max_model.py --report WORK [WORK2 ...]      # prints :func:`render`'s table
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

#: a log line saying a run ran out of memory (GPU: torch, CUDA, vLLM's start-up checks; host: Ray's OOM killer)
OOM_PATTERNS = (
    re.compile(r"out of memory", re.IGNORECASE),
    re.compile(r"OutOfMemoryError"),
    re.compile(r"No available memory for the cache blocks"),
    re.compile(r"is less than desired GPU memory utilization"),
    re.compile(r"KV cache is needed, which is larger than the available KV cache memory"),
    re.compile(r"running low on memory"),
)
_ERROR = re.compile(r"(Error|Exception|Traceback|FAILED|failed)")
#: files of a run directory scanned for evidence (their last bytes)
_LOG_SUFFIXES = (".log", ".txt", ".err", ".out")
_TAIL_BYTES = 4 << 20
SIZE_ORDER = ("tiny", "0.6b", "1.7b", "4b", "8b", "14b")
SIDE_ORDER = ("arctic", "stock")
GIB = 1024.0


def tail_lines(path: Path, limit: int = _TAIL_BYTES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def log_files(result_dir: Path, run_dir: Path | None) -> list[Path]:
    """The run's text logs: the result folder's and, when it is there, everything under the script's RUN_DIR."""
    files = [p for p in sorted(result_dir.glob("*")) if p.suffix in _LOG_SUFFIXES and p.is_file()]
    if run_dir is not None and run_dir.is_dir():
        files += [p for p in sorted(run_dir.rglob("*")) if p.suffix in _LOG_SUFFIXES and p.is_file()]
    return files


def oom_evidence(files: list[Path]) -> str | None:
    """The first line of ``files`` that says memory ran out, as ``file: line`` (trimmed), or None."""
    for path in files:
        for line in tail_lines(path):
            if any(p.search(line) for p in OOM_PATTERNS):
                return f"{path.name}: {line.strip()[:240]}"
    return None


def error_evidence(files: list[Path]) -> str | None:
    """The last error-looking line of the first file that has one (console first), trimmed."""
    for path in files:
        hits = [line.strip() for line in tail_lines(path) if _ERROR.search(line)]
        if hits:
            return f"{path.name}: {hits[-1][:240]}"
    return None


def read_steps(path: Path) -> list[dict[str, Any]]:
    """verl's file-logger lines: ``data`` of each ``{"step", "data"}`` record, in order (bad lines skipped)."""
    steps = []
    for line in tail_lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("data"), dict):
            steps.append(record["data"])
    return steps


def gpu_peak_gib(path: Path) -> tuple[float | None, float | None]:
    """``(peak used, total)`` GiB of an ``nvidia-smi`` csv of ``used, total`` MiB lines (or ``used`` alone)."""
    peak = total = None
    for line in tail_lines(path, 64 << 20):
        cells = [c.strip() for c in line.split(",")]
        try:
            used = float(cells[0])
        except (ValueError, IndexError):
            continue
        peak = used if peak is None else max(peak, used)
        if len(cells) > 1:
            try:
                total = float(cells[1])
            except ValueError:
                pass
    return (None if peak is None else round(peak / GIB, 2)), (None if total is None else round(total / GIB, 2))


def process_peak_gib(steps: list[dict[str, Any]]) -> float | None:
    """The training process's own allocator peak over all steps (stock verl's, or the reference server's)."""
    values = []
    for data in steps:
        for key, value in data.items():
            wanted = key == "perf/max_memory_allocated_gb" or (
                key.startswith("actor/arctic/memory/") and key.endswith("/device_max_allocated_gib"))
            if wanted and isinstance(value, (int, float)):
                values.append(float(value))
    return round(max(values), 2) if values else None


def analyze(result_dir: Path, *, run_dir: Path | None = None, rc: int | None = None, timed_out: bool = False,
            steps_wanted: int | None = None) -> dict[str, Any]:
    """The outcome and measurements of one run (see the module docstring). ``rc is None``: still running."""
    files = log_files(result_dir, run_dir)
    metrics = result_dir / "metrics.jsonl"
    if not metrics.is_file() and run_dir is not None:
        metrics = run_dir / "metrics.jsonl"
    steps = read_steps(metrics)
    times = [round(float(d["timing_s/step"]), 2) for d in steps if isinstance(d.get("timing_s/step"), (int, float))]
    peak, total = gpu_peak_gib(result_dir / "gpu_mem.csv")
    oom = oom_evidence(files)
    done = rc == 0 and (steps_wanted is None or len(steps) >= steps_wanted)
    if done:
        outcome, evidence = "fit", None
    elif timed_out:
        outcome, evidence = "timeout", oom or error_evidence(files)
    elif oom:
        outcome, evidence = "oom", oom
    elif rc is None:
        outcome, evidence = "running", None
    else:
        outcome, evidence = "error", error_evidence(files) or f"exit status {rc}, {len(steps)} step(s) logged"
    memory = {k: v for k, v in (steps[-1] if steps else {}).items() if k.startswith("actor/arctic/memory/")}
    return {"outcome": outcome, "evidence": evidence, "steps": len(steps), "step_times_s": times,
            "step_time_s": times[-1] if times else None, "step_reported": len(times) or None,
            "peak_gpu_gib": peak, "gpu_total_gib": total, "process_peak_gib": process_peak_gib(steps),
            "memory_metrics": memory}


def load_results(dirs: list[Path]) -> list[dict[str, Any]]:
    """Every run under ``dirs`` (a work folder, its ``results/`` or one run's folder): its ``result.json``, else
    its ``attempt.json`` analysed as it stands (a run still going, or one whose runner died)."""
    rows = []
    for base in dirs:
        base = Path(base)
        candidates = [base] if (base / "attempt.json").is_file() else sorted(
            p.parent for p in list(base.glob("*/attempt.json")) + list(base.glob("results/*/attempt.json")))
        for folder in candidates:
            if (folder / "result.json").is_file():
                rows.append(json.loads((folder / "result.json").read_text()))
                continue
            attempt = json.loads((folder / "attempt.json").read_text())
            if attempt.get("outcome") == "skipped":
                rows.append(attempt)
                continue
            run_dir = Path(attempt["run_dir"]) if attempt.get("run_dir") else None
            rows.append({**attempt, **analyze(folder, run_dir=run_dir)})
    return rows


def _key(row: dict[str, Any]) -> tuple:
    size, side = row.get("size"), row.get("side")
    return (SIZE_ORDER.index(size) if size in SIZE_ORDER else 99, SIDE_ORDER.index(side) if side in SIDE_ORDER else 9,
            row.get("level_index", 0), row.get("name", ""))


def _num(value: Any, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def render(rows: list[dict[str, Any]]) -> str:
    """The markdown table of ``rows`` (one per attempt), then the largest size that fit on each side."""
    lines = [
        ("| size | parameters | side | settings | result | GPU peak GiB (nvidia-smi) | process peak GiB | "
         "step s (step) | wall s | evidence |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(rows, key=_key):
        params = row.get("params")
        step = f"{_num(row.get('step_time_s'))} ({row['step_reported']})" if row.get("step_time_s") is not None else ""
        evidence = (row.get("evidence") or row.get("reason") or "").replace("|", "/")
        lines.append(
            f"| {row.get('size', '?')} | {'' if params is None else f'{params / 1e9:.2f} B'} | {row.get('side', '?')} "
            f"| {row.get('settings_text', row.get('level', ''))} | **{row.get('outcome', '?')}** "
            f"| {_num(row.get('peak_gpu_gib'))} | {_num(row.get('process_peak_gib'))} | {step} "
            f"| {_num(row.get('wall_s'), 0)} | {evidence[:160]} |")
    lines.append("")
    for side in sorted({r.get("side") for r in rows if r.get("side")}, key=lambda s: _key({"side": s})):
        fits = [r for r in rows if r.get("side") == side and r.get("outcome") == "fit"]
        best = max(fits, key=_key) if fits else None
        lines.append(f"- largest size that fit, {side}: " + (
            f"{best['size']} ({best.get('settings_text', best.get('level'))})" if best else "none"))
    return "\n".join(lines)
