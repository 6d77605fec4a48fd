"""``benchmarks/device/gpu_mem_by_run.py``: GPU memory split by run through ``GRPO_RUN_NAME`` in each process's
environment. Real processes here; ``nvidia-smi`` is a stand-in script on ``PATH`` (this machine has no GPU)
that reports those processes' pids, so the parsing and attribution run as on the device."""

from __future__ import annotations

import os
import subprocess
import sys
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
