"""The vendor's own Arctic RL servers (v2: Arctic-Platform; v1: PyPI ``arctic-platform==0.1.2``), served on CPU.

Where the vendor's code is found and launchers for its servers, shared by the conformance tests and by other
tests that run against the vendor (the re-entrant recovery tests, the memory options). The fixtures built on
them live in ``tests/conftest.py`` (``vendor_src``, ``vendor_kit``, ``vendor_v1_src``) and
``tests/conformance/conftest.py`` (``vendor_server``, ``vendor_v1_server``).

The vendor's code (Arctic-Platform, pinned and unmodified) is the contract that both our adapter and
our reference server are judged by. ``run_vendor_server.py`` from the shared vendor kit serves it on
127.0.0.1 with only its GPU-, Ray- and vLLM-bound parts substituted (the kit's README lists them).

The snapshot is looked up at ``$ARCTIC_PLATFORM_SRC`` (a directory holding ``arctic_platform/``) or
at ``<shared>/vendor/arctic-platform``. Outside CI a missing snapshot skips these tests with a
message saying how to get it; under CI (``CI=true``) it is a failure, so a green CI always means the
vendor contract was checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

_TESTS = Path(__file__).resolve().parents[1]
_SHARED = Path(os.environ.get("VERL_REMOTE_BACKEND_SHARED", _TESTS.parents[1] / "shared"))
_KIT = _SHARED / "vendor"



def _skip_or_fail(text: str) -> None:
    """Skip outside CI; under CI (``CI=true``) a missing vendor copy is a failure."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(text, pytrace=False)
    pytest.skip(text)


def _missing(what: str) -> None:
    _skip_or_fail(f"{what}: the vendor's Arctic-Platform snapshot is needed (set ARCTIC_PLATFORM_SRC to a directory "
                  f"holding arctic_platform/, or put the shared vendor kit at {_KIT}; the public repository is "
                  "Snowflake-AI-Research/Arctic-Platform at commit 586438082833d9f599bf8567cd1c1405b144dc6e)")


def find_vendor_src() -> Path:
    """The directory holding the vendor's ``arctic_platform`` package."""
    src = Path(os.environ.get("ARCTIC_PLATFORM_SRC", _KIT / "arctic-platform"))
    if not (src / "arctic_platform" / "common" / "http_server.py").is_file():
        _missing(f"no arctic_platform/common/http_server.py under {src}")
    return src


def find_vendor_kit() -> Path:
    """The folder of ``run_vendor_server.py`` (and the ArcticInference stubs it needs)."""
    if not (_KIT / "run_vendor_server.py").is_file():
        _missing(f"no run_vendor_server.py in {_KIT}")
    return _KIT


@dataclass
class VendorServer:
    """A running vendor server: its URL, process, log and (optional) exchange trace."""

    url: str
    proc: subprocess.Popen
    log: Path
    trace: Path

    def trace_lines(self, path: str | None = None) -> list[dict]:
        """The exchanges traced so far (``path`` keeps those of one route)."""
        if not self.trace.exists():
            return []
        rows = [json.loads(line) for line in self.trace.read_text().splitlines() if line.strip()]
        return [r for r in rows if path is None or r.get("path") == path]

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def destroy_all_jobs(self) -> None:
        """Destroy every job the server holds (the vendor allows one job per type at a time)."""
        status = requests.get(f"{self.url}/status", timeout=30).json()
        jobs = status.get("jobs") or status.get("active_jobs") or {}
        items = jobs.items() if isinstance(jobs, dict) else ((j.get("job_id"), j) for j in jobs)
        for job_id, info in items:
            job_type = info.get("job_type") if isinstance(info, dict) else None
            requests.post(f"{self.url}/destroy", params={"job_id": int(job_id)}, json={"job_type": job_type},
                          timeout=120)


@contextlib.contextmanager
def _serving(cmd: list[str], workdir: Path, name: str) -> Iterator[VendorServer]:
    """Run ``cmd`` (a server script that prints ``READY <port>`` first) in ``workdir`` with one thread,
    its stderr in ``<name>.log`` and its trace in ``<name>-trace.jsonl``; stop it (SIGTERM, then SIGKILL) on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    log, trace = workdir / f"{name}.log", workdir / f"{name}-trace.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as err:
        proc = subprocess.Popen([*cmd, "--trace", str(trace)], stdout=subprocess.PIPE, stderr=err, text=True,
                                cwd=str(workdir), env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("READY"):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{name} did not start (first line {line!r}); log tail:\n"
                               f"{log.read_text(errors='replace')[-4000:]}")
        yield VendorServer(url=f"http://127.0.0.1:{int(line.split()[1])}", proc=proc, log=log, trace=trace)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def running_vendor_server(vendor_kit: Path, vendor_src: Path, workdir: Path, *,
                          extra_args: tuple[str, ...] = ()) -> Iterator[VendorServer]:
    """Start ``run_vendor_server.py --port 0`` (the vendor's v2 app on CPU) and stop it on exit."""
    cmd = [sys.executable, str(vendor_kit / "run_vendor_server.py"), "--port", "0", "--vendor-src", str(vendor_src),
           *extra_args]
    with _serving(cmd, workdir, "vendor-server") as server:
        yield server



# ------------------------------------------------------------------------------------- vendor v1

_V1_INSTALL = Path(sys.prefix) / "arctic-platform-v1"


def find_vendor_v1_src() -> Path:
    """The directory holding the vendor's v1 ``arctic_platform`` package (PyPI ``arctic-platform==0.1.2``).

    ``scripts/install.sh --test`` installs it, without its dependencies, into ``<venv>/arctic-platform-v1``;
    ``$ARCTIC_PLATFORM_V1_SRC`` points at another copy. Missing: a skip outside CI, a failure under CI.
    """
    src = Path(os.environ.get("ARCTIC_PLATFORM_V1_SRC", _V1_INSTALL))
    if not (src / "arctic_platform" / "rl" / "http_server.py").is_file():
        text = (f"no arctic_platform/rl/http_server.py under {src}: the vendor's v1 code is needed (run "
                f"`bash scripts/install.sh --test`, or `pip install --no-deps --target {_V1_INSTALL} "
                "arctic-platform==0.1.2`, or set ARCTIC_PLATFORM_V1_SRC)")
        _skip_or_fail(text)
    return src


@contextlib.contextmanager
def running_vendor_v1_server(vendor_kit: Path, v1_src: Path, workdir: Path) -> Iterator[VendorServer]:
    """Start ``vendor_v1_server.py --port 0`` (the vendor's v1 app on CPU) and stop it on exit.

    Its trace lines carry ``global_steps``: the training engine's optimizer step count after the exchange.
    """
    cmd = [sys.executable, str(_TESTS / "conformance" / "vendor_v1_server.py"), "--port", "0", "--v1-src", str(v1_src),
           "--kit", str(vendor_kit)]
    with _serving(cmd, workdir, "vendor-v1-server") as server:
        yield server

