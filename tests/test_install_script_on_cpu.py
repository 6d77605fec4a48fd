"""``scripts/install.sh`` on a terminal: a few lines on success whatever pip colours, pip's error in full on failure.

pip colours its warnings when it writes to a terminal, which once defeated the script's filter, so the
script runs here under a pseudo-terminal (``pty``), as a user's shell runs it. It installs for real, into a
venv of its own (``VENV=``) whose site-packages chain to this test's venv through a ``.pth`` file: pip
finds every requirement already satisfied, downloads nothing (the build backend's setuptools comes from
pip's cache or the configured index) and installs only this checkout, in editable mode, into the new
venv. The test's own venv is never touched: pip does not uninstall outside the environment it installs
into. A full install from nothing (torch, verl, DeepSpeed: minutes of downloads) would test the same
filter on the same pip output, only slower.
"""

from __future__ import annotations

import os
import pathlib
import pty
import re
import select
import signal
import site
import subprocess
import sys
import time

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALL = REPO_ROOT / "scripts" / "install.sh"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

pytestmark = pytest.mark.slow  # a real pip install: resolving and building the checkout, ~1 min on 2 cores


def _run_on_a_terminal(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` with stdin/stdout/stderr on a new pseudo-terminal; return its status and what it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO_ROOT,
                            start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"{cmd} did not finish in {timeout_s} s:\n{b''.join(chunks).decode(errors='replace')}")
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def chained_venv(tmp_path_factory) -> pathlib.Path:
    """A new venv that sees this venv's packages (a .pth file) and so has nothing to download."""
    venv = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    (parent,) = [p for p in site.getsitepackages() if p.endswith("site-packages")][:1]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / version / "site-packages" / "zz_parent_venv.pth").write_text(parent + "\n")
    return venv


def _env(venv: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PIP_NO_COLOR", "NO_COLOR"}}
    env.update(VENV=str(venv), TERM="xterm-256color", **extra)  # a colour terminal
    return env


def test_install_prints_a_few_plain_lines_on_a_terminal(chained_venv):
    rc, output = _run_on_a_terminal(["bash", str(INSTALL)], _env(chained_venv), timeout_s=900)
    lines = output.replace("\r\n", "\n").rstrip("\n").split("\n")
    assert rc == 0, output
    assert len(lines) <= 10, output
    assert not ANSI.search(output), output  # no colour codes from pip
    assert "WARNING: Location" not in output and "Warning:" not in output and "!!" not in output, output
    assert lines[-1].startswith("[install] ok: verl 0.9.1") and lines[-1].endswith(f"our packages from {REPO_ROOT}")
    check = subprocess.run([str(chained_venv / "bin" / "python"), "-c", "import verl.remote_backend as m; print(m.__file__)"],
                           capture_output=True, text=True, check=True, timeout=300)
    assert check.stdout.strip().startswith(str(REPO_ROOT))  # the editable install of this checkout


def test_a_failing_pip_is_shown_in_full_with_its_status(chained_venv, tmp_path):
    """No index, and a constraint nothing can meet: pip fails (on the build backend it cannot fetch, or,
    without build isolation, on the constraint) and its whole report reaches the terminal."""
    constraint = tmp_path / "constraints.txt"
    constraint.write_text("verl==0.0.1\n")
    env = _env(chained_venv, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path), PIP_CONSTRAINT=str(constraint))
    rc, output = _run_on_a_terminal(["bash", str(INSTALL)], env, timeout_s=600)
    assert rc != 0, output
    assert f"[install] FAILED (pip exit status {rc}): pip install -c constraints.txt -e" in output, output
    report = output[: output.index("[install] FAILED")]
    assert "ERROR: " in report and "[install] verl-remote-backend" in report, output  # pip's own report
    assert len(report.splitlines()) >= 3, output  # all of it, not a filtered line
    assert not ANSI.search(output), output
