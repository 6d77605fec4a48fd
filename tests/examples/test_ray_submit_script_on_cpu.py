"""``examples/ray_cluster/submit_grpo.sh``'s submission retry, without a cluster.

A head started moments ago answers ``ray job submit`` with "No available agent to submit job, please
try again later" until its job agent registers; the script retries that answer (same submission id)
for up to ``SUBMIT_RETRY_S`` seconds and nothing else. Here a stand-in ``ray`` executable first on
``PATH`` plays the head's answers and records every call; the real cluster path is
``tests/special_e2e/test_ray_cluster_job.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SUBMIT = REPO_ROOT / "examples" / "ray_cluster" / "submit_grpo.sh"
NO_AGENT = "RuntimeError: Request failed with status code 500: No available agent to submit job, please try again later.."

# The stand-in: call k (1-based) prints the k-th of ANSWERS (stderr text, exit status) -- the last one
# repeats -- and records its arguments and whether a --runtime-env file it was given exists.
FAKE_RAY = r'''#!/usr/bin/env python3
import json, os, pathlib, sys
calls = pathlib.Path(os.environ["FAKE_RAY_CALLS"])
done = calls.read_text().splitlines() if calls.exists() else []
args = sys.argv[1:]
env_file = args[args.index("--runtime-env") + 1] if "--runtime-env" in args else None
record = {"args": args, "env_file": env_file, "env_file_exists": bool(env_file and os.path.exists(env_file))}
with calls.open("a") as f:
    f.write(json.dumps(record) + "\n")
answers = json.loads(os.environ["FAKE_RAY_ANSWERS"])
text, status = answers[min(len(done), len(answers) - 1)]
print("ray job submit: stdout line")
print(text, file=sys.stderr)
sys.exit(status)
'''


def _submit(tmp_path: pathlib.Path, answers: list[tuple[str, int]], **env_extra: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "ray"
    fake.write_text(FAKE_RAY.replace("/usr/bin/env python3", sys.executable, 1))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in {"ARCTIC_RL_TOKEN", "SUBMIT_RETRY_S", "NO_WAIT", "DRY_RUN"}}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=sys.executable, TMPDIR=str(tmp_path),
               ARCTIC_RL_URL="http://127.0.0.1:7000", SUBMISSION_ID="job_under_test", NO_WAIT="1",
               FAKE_RAY_CALLS=str(calls), FAKE_RAY_ANSWERS=json.dumps(answers))
    env.update(env_extra)
    proc = subprocess.run(["bash", str(SUBMIT)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    records = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return proc, records


def test_no_agent_yet_is_retried_with_the_same_submission_id(tmp_path):
    proc, calls = _submit(tmp_path, [(NO_AGENT, 1), ("Job 'job_under_test' submitted successfully", 0)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls) == 2
    for call in calls:
        assert call["args"][call["args"].index("--submission-id") + 1] == "job_under_test"
    assert "has no job agent yet" in proc.stderr and "SUBMIT_RETRY_S" in proc.stderr
    assert proc.stderr.count(NO_AGENT) == 1  # Ray's own answer is still shown
    assert proc.stdout.count("ray job submit: stdout line") == 2  # stdout is not swallowed


def test_any_other_failure_ends_at_once_with_rays_status(tmp_path):
    proc, calls = _submit(tmp_path, [("RuntimeError: Request failed with status code 400: bad runtime_env", 3)])
    assert proc.returncode == 3
    assert len(calls) == 1
    assert "bad runtime_env" in proc.stderr and "no job agent yet" not in proc.stderr


def test_retries_stop_after_submit_retry_s(tmp_path):
    proc, calls = _submit(tmp_path, [(NO_AGENT, 1)], SUBMIT_RETRY_S="0")
    assert proc.returncode == 1
    assert len(calls) == 1
    assert NO_AGENT in proc.stderr


def test_a_bad_submit_retry_s_names_the_knob_and_the_value(tmp_path):
    proc, calls = _submit(tmp_path, [("", 0)], SUBMIT_RETRY_S="2m")
    assert proc.returncode == 2
    assert calls == []
    assert "SUBMIT_RETRY_S" in proc.stderr and "whole number of seconds" in proc.stderr and "'2m'" in proc.stderr


def test_the_token_file_lives_through_the_retries_and_is_removed(tmp_path):
    proc, calls = _submit(tmp_path, [(NO_AGENT, 1), ("", 0)], ARCTIC_RL_TOKEN="tok-never-in-argv")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls) == 2
    assert all(call["env_file_exists"] for call in calls)
    assert len({call["env_file"] for call in calls}) == 1
    assert not pathlib.Path(calls[0]["env_file"]).exists()
    assert all("tok-never-in-argv" not in " ".join(call["args"]) for call in calls)
    assert list(tmp_path.glob("submit_err.*")) == []
