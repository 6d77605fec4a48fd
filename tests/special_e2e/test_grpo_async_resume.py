"""A checkpoint saved in the asynchronous mode resumes with the same policy-version bookkeeping.

Run 1: one asynchronous GRPO step with a checkpoint (``trainer.save_freq=1``). verl's async mode saves its
TransferQueue with the checkpoint: the batch prefetched during step 1 (sent with the weights of version 0)
and its tags. Run 2: the same command with ``trainer.total_training_steps=2``: verl resumes at step 2
(``resume_mode=auto``), the reference server restores the training job and the sampler gets version 1, and
step 2 trains the restored batch -- one version old, as in an uninterrupted run
(tests/special_e2e/test_grpo_async.py: step 2's ``trajectory_staleness_worst`` is 1).

Run by hand::

    pytest -m e2e tests/special_e2e/test_grpo_async_resume.py -s
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.e2e import build_task, check_steps, run_recipe, tiny_grpo_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run(tmp_path: Path, task: dict[str, Path], out: Path, steps: int, name: str) -> tuple[dict, str]:
    return run_recipe([
        *tiny_grpo_overrides(task, out, steps=steps, micro_batch=4, save_freq=1),
        "remote_backend=arctic",
        "remote_backend.train.deepspeed.bf16=false",
        "trainer.v1.remote_backend.async_mode=true",
        "trainer.resume_mode=auto",
    ], cwd=tmp_path, timeout=900, name=name)


def test_async_checkpoint_resumes_with_the_same_versions(tmp_path):
    task = build_task(tmp_path / "task")
    out = tmp_path / "run"
    first, _ = run(tmp_path, task, out, steps=1, name="first")
    check_steps(first, [1])
    assert (out / "checkpoints" / "global_step_1" / "transfer_queue").exists(), "verl's async TransferQueue state"

    second, output = run(tmp_path, task, out, steps=2, name="second")
    assert "Resuming from" in output and "global_step_1" in output
    assert "Restored" in output and "training prompt groups from TransferQueue" in output
    check_steps(second, [2])  # the steps logged after the resume
    metrics = second[2]
    assert metrics["training/off_policy/async_mode"] == 1.0
    # the restored batch was sent at step 1 with the weights of version 0: one version old, as without the restart
    assert metrics["training/off_policy/trajectory_staleness_worst/max"] == 1
    assert metrics["training/off_policy/trajectory_staleness/max"] <= 1
