"""No example run erases another's files (``recipe_run_dir`` / ``recipe_claim_run_dir`` in
``examples/common/recipe.sh``).

Without ``RUN_NAME`` or ``RUN_DIR`` every run of an example script gets a directory of its own,
``OUT_DIR/runs/<what it is>_<time stamp>``, and ``OUT_DIR/runs/latest`` points at the newest; a given
``RUN_NAME``/``RUN_DIR`` that holds files is refused, naming it and ``OVERWRITE``/``RESUME``. The slow test
repeats what a new user did: the main command, then the same command with an override (one that fails, as
``lr=abc`` did), and finds the first run's files as they were.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "examples" / "grpo" / "run_reverse_text_grpo_arl_local.sh"
_KNOBS = {"ZORRO", "STEPS", "SEED", "MODEL_DIR", "DATA_DIR", "OUT_DIR", "ARCTIC_RL_URL", "RUN_NAME", "RUN_DIR",
          "OVERWRITE", "RESUME", "VERBOSE", "VERL_FILE_LOGGER_PATH", "INIT_MODEL_DIR"}


def _run(args: list[str], cwd: pathlib.Path, timeout: float = 900, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _KNOBS}
    env.update(PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHON=sys.executable,
               OUT_DIR=str(cwd / "out"), **env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.parametrize("given", ["RUN_NAME", "RUN_DIR"])
def test_a_given_run_directory_that_holds_files_is_refused_naming_it(tmp_path, given):
    run_dir = tmp_path / "out" / "runs" / "mine"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n')
    value = "mine" if given == "RUN_NAME" else str(run_dir)
    start = time.monotonic()
    proc = _run([], tmp_path, timeout=60, **{given: value})
    assert time.monotonic() - start < 10  # refused before anything is built or started
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        (f"RUN_DIR: {run_dir} already holds a run's files; set OVERWRITE=true to delete them first, RESUME=true to "
         "continue that run, or leave RUN_NAME and RUN_DIR unset for a new directory")]
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "data": {}}\n'  # untouched
    proc = _run([], tmp_path, timeout=60, **{given: value, "OVERWRITE": "maybe"})
    assert proc.returncode == 2 and "OVERWRITE: expected true or false, got 'maybe'" in proc.stderr


def test_the_run_directory_helpers_never_share_a_directory(tmp_path):
    """Two runs in the same second get two directories; latest names the second; a given empty one is used."""
    script = tmp_path / "dirs.sh"
    script.write_text(
        "set -euo pipefail\n"
        f"source {REPO_ROOT / 'examples' / 'common' / 'recipe.sh'}\n"
        f"parent={tmp_path / 'runs'}\n"
        "for i in 1 2; do\n"
        "  unset RUN_NAME RUN_DIR\n"
        "  recipe_run_dir \"$parent\" same_name\n"
        "  recipe_claim_run_dir\n"
        "  touch \"$RUN_DIR/metrics.jsonl\"\n"
        "  echo \"$RUN_NAME $RUN_DIR\"\n"
        "done\n"
        "RUN_NAME=given; unset RUN_DIR; recipe_run_dir \"$parent\" x; recipe_claim_run_dir; echo \"$RUN_DIR\"\n"
    )
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "OVERWRITE": "false", "RESUME": "false"})
    assert proc.returncode == 0, proc.stderr
    first, second, given = proc.stdout.splitlines()
    (name1, dir1), (name2, dir2) = first.split(), second.split()
    assert dir1 != dir2 and pathlib.Path(dir1).is_dir() and pathlib.Path(dir2).is_dir()
    assert name1.startswith("same_name_") and pathlib.Path(dir1).name == name1 and pathlib.Path(dir2).name == name2
    assert given == str(tmp_path / "runs" / "given")
    assert os.readlink(tmp_path / "runs" / "latest") == "given"


@pytest.mark.slow  # builds the tiny model and data, runs one GRPO step through verl, Ray and the server, then fails a run
def test_a_second_run_with_an_override_leaves_the_first_runs_files_intact(tmp_path):
    first = _run([], tmp_path, STEPS="1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    runs = tmp_path / "out" / "runs"
    (run1,) = [p for p in runs.iterdir() if p.name != "latest"]
    assert run1.name.startswith("grpo_zorro_false_seed0_")
    files1 = {p.name: p.read_bytes() for p in run1.iterdir() if p.is_file()}
    assert {"run.log", "metrics.jsonl", "metrics.csv", "reward_curve.png", "summary.json"} <= set(files1)
    # the closing lines name only what the run wrote: one step is fewer than the summary's 5-step window
    summary = json.loads(files1["summary.json"])
    assert summary["steps"] == 1 and "gain" not in summary
    assert "summary.json     steps logged (fewer than 5: no first-5 / last-5 means)" in first.stdout
    assert f"python examples/common/export_hf.py {run1} --out <dir>" in first.stdout  # the server saved step 1
    assert re.search(rf"^reverse-text GRPO finished\. \d+ min \d+ s in all\. Results in {re.escape(str(run1))}:$",
                     first.stdout, re.MULTILINE), first.stdout

    start = time.monotonic()
    second = _run(["actor_rollout_ref.actor.optim.lr=abc"], tmp_path, STEPS="1")
    assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
    assert time.monotonic() - start < 60  # model and data are cached: only verl's config is composed
    assert "actor_rollout_ref.actor.optim.lr: expected a float, got 'abc'" in second.stderr
    run2 = runs / os.readlink(runs / "latest")
    assert run2 != run1 and run2.name.startswith("grpo_zorro_false_seed0_")
    assert "optim.lr=abc" in (run2 / "run.log").read_text()
    assert {p.name: p.read_bytes() for p in run1.iterdir() if p.is_file()} == files1  # every file as it was
