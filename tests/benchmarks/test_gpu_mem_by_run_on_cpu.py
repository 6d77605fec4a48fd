"""``benchmarks/device/gpu_mem_by_run.py``: GPU memory split by run through ``GRPO_RUN_NAME`` in each process's
environment. Real processes here; ``nvidia-smi`` is a stand-in script on ``PATH`` (this machine has no GPU)
that reports those processes' pids, so the parsing and attribution run as on the device."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gmr():
    return load_script("benchmarks/device/gpu_mem_by_run.py")


@pytest.fixture
def sleepers():
    """Three live processes: two of run ``alpha``, one of no run."""
    procs = []
    for name in ("alpha", "alpha", None):
        env = dict(os.environ)
        env.pop("GRPO_RUN_NAME", None)
        if name:
            env["GRPO_RUN_NAME"] = name
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env))
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def fake_smi(tmp_path, monkeypatch, apps: str, total: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\ncase \"$1\" in\n"
                      f"  --query-compute-apps=*) printf '{apps}' ;;\n"
                      f"  --query-gpu=*) printf '{total}' ;;\n"
                      "  *) exit 9 ;;\nesac\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_memory_is_summed_per_run_and_strangers_are_left_out(gmr, sleepers, tmp_path, monkeypatch):
    a1, a2, other = sleepers
    results = tmp_path / "results"
    (results / "alpha").mkdir(parents=True)
    (results / "beta").mkdir()
    apps = f"{a1.pid}, 1000\\n{a2.pid}, 2500\\n{other.pid}, 7000\\n999999999, 5\\nnot a row\\n"
    fake_smi(tmp_path, monkeypatch, apps, "12345\\n")
    gmr.sample(results)
    gmr.sample(results)
    assert (results / "alpha" / "gpu_mem.csv").read_text().splitlines() == ["memory.used [MiB]", "3500", "3500"]
    assert not (results / "beta" / "gpu_mem.csv").exists()
    assert (results / "gpu_mem_total.csv").read_text().splitlines() == ["memory.used [MiB]", "12345", "12345"]
    assert gmr.run_of(other.pid) is None and gmr.run_of(a1.pid) == "alpha"


def test_a_failing_nvidia_smi_writes_nothing(gmr, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 3\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "r" / "alpha").mkdir(parents=True)
    gmr.sample(tmp_path / "r")
    assert sorted(p.name for p in (tmp_path / "r").rglob("*")) == ["alpha"]


def test_the_report_reads_what_it_writes(gmr, tmp_path, monkeypatch):
    report = load_script("benchmarks/real_model_report.py")
    run = tmp_path / "alpha"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "data": {"critic/score/mean": 0.25}}\n')
    for mib in (2048, 6144, 4096):
        gmr.append(run / "gpu_mem.csv", mib)
    assert report.load_run("alpha", run).gpu_mem_mib == 6144


def test_bad_interval_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/device/gpu_mem_by_run.py", str(tmp_path), "--interval", "0"],
                          check=False, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "--interval: expected a positive number of seconds, got 0.0" in proc.stderr


def test_procs_mode_traces_each_process_with_its_command(gmr, sleepers, tmp_path, monkeypatch):
    a1, _, other = sleepers
    apps = f"{a1.pid}, 1000\\n{other.pid}, 7000\\nnot a row\\n"
    fake_smi(tmp_path, monkeypatch, apps, "8000\\n")
    trace = tmp_path / "gpu_procs.csv"
    gmr.sample_procs(trace, started=0.0)
    lines = trace.read_text().splitlines()
    assert lines[0] == "seconds,pid,mib,command" and len(lines) == 3
    rows = [line.split(",", 3) for line in lines[1:]]
    assert [(r[1], r[2]) for r in rows] == [(str(a1.pid), "1000"), (str(other.pid), "7000")]
    assert all(r[3].startswith(sys.executable) and "time.sleep(60)" in r[3] for r in rows)
    assert gmr.command_of(999999999) == "?"


def test_procs_mode_runs_until_sigterm_and_takes_one_target(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, "1, 5\\n", "5\\n")
    trace = tmp_path / "p.csv"
    proc = subprocess.Popen([sys.executable, "benchmarks/device/gpu_mem_by_run.py", "--procs", str(trace),
                             "--interval", "0.2"], cwd=REPO, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if trace.exists() and len(trace.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
    assert trace.read_text().splitlines()[1].split(",")[1:3] == ["1", "5"]
    both = subprocess.run([sys.executable, "benchmarks/device/gpu_mem_by_run.py", str(tmp_path), "--procs",
                           str(trace)], check=False, capture_output=True, text=True, cwd=REPO)
    assert both.returncode == 2 and "give either RESULTS" in both.stderr
