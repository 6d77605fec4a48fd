"""GPU memory per run, when several GRPO runs share one GPU: a sampler for benchmarks/device/grpo_runs.sh.

Every few seconds it asks ``nvidia-smi`` which processes hold GPU memory, reads each one's
``GRPO_RUN_NAME`` from ``/proc/PID/environ`` (the runner exports it before starting a run, and every
process of the run inherits it: the driver, Ray's workers, the reference server, vLLM's engine), and
appends the run's total in MiB to ``RESULTS/NAME/gpu_mem.csv`` -- the file and format
``benchmarks/real_model_report.py`` reads (one ``memory.used [MiB]`` header, one number a line). The
whole GPU's use goes to ``RESULTS/gpu_mem_total.csv``. Stdlib only; stops when ``RESULTS/status``
says ``ALLDONE`` or on SIGTERM.

With ``--procs FILE`` it traces every process that holds GPU memory instead (a run alone on the GPU: which of
its processes holds what): one row per process and sample, ``seconds,pid,MiB,command`` (the command line's
first 100 characters, as Ray's and vLLM's process titles show them: ``ray::WorkerDict...``,
``VLLM::EngineCore``), until SIGTERM.

    python3 benchmarks/device/gpu_mem_by_run.py RESULTS [--interval 2]
    python3 benchmarks/device/gpu_mem_by_run.py --procs FILE [--interval 2]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import time
from pathlib import Path

MARKER = b"GRPO_RUN_NAME="


def run_of(pid: int) -> str | None:
    """The ``GRPO_RUN_NAME`` of a process, or None (gone, not ours, unreadable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(MARKER):
            name = item[len(MARKER):].decode("utf-8", "replace")
            return name if name and "/" not in name and name not in (".", "..") else None
    return None


def query(fields: str, what: str) -> list[list[str]]:
    """``nvidia-smi --query-<what>=<fields>`` as rows of strings ([] when it fails)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_processes() -> list[tuple[int, int]]:
    """``(pid, MiB)`` of every process holding GPU memory (malformed rows skipped; [] when nvidia-smi fails)."""
    return [(int(r[0]), int(r[1])) for r in query("pid,used_memory", "compute-apps")
            if len(r) == 2 and r[0].isdigit() and r[1].isdigit()]


def sample(results: Path) -> None:
    """One sample: every run's total and the GPU's total, appended to their files."""
    per_run: dict[str, int] = {}
    for pid, mib in gpu_processes():
        name = run_of(pid)
        if name is not None:
            per_run[name] = per_run.get(name, 0) + mib
    for name, mib in per_run.items():
        if (results / name).is_dir():
            append(results / name / "gpu_mem.csv", mib)
    total = query("memory.used", "gpu")
    if total and total[0] and total[0][0].isdigit():
        append(results / "gpu_mem_total.csv", sum(int(r[0]) for r in total if r and r[0].isdigit()))


def command_of(pid: int) -> str:
    """A process's command line, its first 100 characters, commas and newlines left out ("?" when gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
    return " ".join(text.replace(",", ";").split())[:100] or "?"


def sample_procs(path: Path, started: float) -> None:
    """One sample of every process holding GPU memory, appended to ``path`` (CSV with a header)."""
    rows = gpu_processes()
    if not rows:
        return
    new = not path.exists()
    with path.open("a", encoding="utf-8") as f:
        if new:
            f.write("seconds,pid,mib,command\n")
        for pid, mib in rows:
            f.write(f"{time.monotonic() - started:.0f},{pid},{mib},{command_of(pid)}\n")


def append(path: Path, mib: int) -> None:
    new = not path.exists()
    with path.open("a", encoding="utf-8") as f:
        if new:
            f.write("memory.used [MiB]\n")
        f.write(f"{mib}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", help="the runner's RESULTS directory (one folder per run)")
    parser.add_argument("--procs", type=Path, help="trace every process holding GPU memory into this CSV instead")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default 2)")
    args = parser.parse_args()
    if args.interval <= 0:
        parser.error(f"--interval: expected a positive number of seconds, got {args.interval}")
    if (args.results is None) == (args.procs is None):
        parser.error("give either RESULTS (memory by run) or --procs FILE (memory by process), not both or neither")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    if args.procs is not None:
        started = time.monotonic()
        while not stopping:
            sample_procs(args.procs, started)
            time.sleep(args.interval)
        return
    status = args.results / "status"
    while not stopping:
        sample(args.results)
        if status.is_file() and "ALLDONE" in status.read_text(encoding="utf-8", errors="replace"):
            break
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
