"""What a failing example run and its header say on the terminal (``examples/common/console.sh``,
``examples/grpo/run_reverse_text_grpo_arl_local.sh``).

* A failing command's own error line reaches the terminal even when it is far above the log's tail.
* The header names the server the run talks to -- the URL given (as ``ARCTIC_RL_URL`` or as a
  ``remote_backend.server.url=`` override) or the reference server it starts -- and the start-up line
  says what is started; a misspelt key ends the run with the entry point's one-line error.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CONSOLE = REPO_ROOT / "examples" / "common" / "console.sh"
SCRIPT = REPO_ROOT / "examples" / "grpo" / "run_reverse_text_grpo_arl_local.sh"


def test_a_failure_shows_the_error_line_even_above_the_tail(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "set -euo pipefail\n"
        f"source {CONSOLE}\n"
        f"console_init {tmp_path / 'run.log'}\n"
        "console_run '^never' python3 -c '"
        'import sys\n'
        'print("Traceback (most recent call last):")\n'
        'print("(TaskRunner pid=12) verl.remote_backend.errors.RemoteBackendConfigError: x.y: bad; allowed: 1")\n'
        'print("\\n".join(f"noise {i}" for i in range(100)))\n'
        "sys.exit(3)'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERBOSE"}
    env["CONSOLE_TAIL_LINES"] = "5"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 3
    lines = proc.stderr.splitlines()
    assert "noise 99" in lines and "noise 90" not in lines  # the tail: 5 lines
    error_at = lines.index("---- error ----")
    assert lines[error_at + 1] == "verl.remote_backend.errors.RemoteBackendConfigError: x.y: bad; allowed: 1"
    assert "FAILED (exit status 3)" in proc.stderr


def test_a_clean_failure_without_an_error_line_adds_no_error_section(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(f"set -euo pipefail\nsource {CONSOLE}\nconsole_init {tmp_path / 'run.log'}\n"
                      "console_run '^never' bash -c 'echo just output; exit 4'\n")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 4 and "---- error ----" not in proc.stderr and "just output" in proc.stderr


def _run_script(tmp_path: pathlib.Path, args: list[str], **env_extra: str) -> subprocess.CompletedProcess:
    """The example as a user runs it, its model and data cached (stand-ins: nothing gets that far)."""
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir(exist_ok=True)
    data.mkdir(exist_ok=True)
    (model / "warm_start.json").write_text("{}")
    for name in ("train.parquet", "val.parquet"):
        (data / name).write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k not in {"VERBOSE", "RUN_DIR", "ARCTIC_RL_URL"}}
    env.update(PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHON=sys.executable,
               OUT_DIR=str(tmp_path / "out"), MODEL_DIR=str(model), DATA_DIR=str(data), RUN_NAME="typo", **env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.slow  # the entry point imports verl before it refuses the key: ~10-30 s
@pytest.mark.parametrize(
    ("args", "env", "given"),
    [
        (["remote_backend.server.url='http://127.0.0.1:9'"], {}, "http://127.0.0.1:9"),
        ([], {"ARCTIC_RL_URL": "http://127.0.0.1:8"}, "http://127.0.0.1:8"),
        ([], {}, None),
    ],
    ids=["url_override", "url_env", "reference_server"],
)
def test_header_names_the_server_and_a_misspelt_key_shows_its_error(tmp_path, args, env, given):
    proc = _run_script(tmp_path, [*args, "remote_backend.server.urll=x"], **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    if given:
        assert f"remote backend 'arctic' -> the Arctic RL server at {given} (given; none is started here)" in proc.stdout
        assert f"[grpo] starting verl and Ray, connecting to {given} " in proc.stdout
        assert "reference" not in proc.stdout
    else:
        assert "remote backend 'arctic' -> the reference Arctic RL server, started here on 127.0.0.1" in proc.stdout
        assert "[grpo] starting verl, Ray and the reference server " in proc.stdout
    error = proc.stderr.splitlines()[proc.stderr.splitlines().index("---- error ----") + 1]
    assert error.startswith("[remote_backend] error: remote_backend.server.urll: unknown key 'urll'")
    assert "did you mean remote_backend.server.url" in error
