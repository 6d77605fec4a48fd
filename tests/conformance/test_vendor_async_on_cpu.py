"""The asynchronous mode against the vendor's own Arctic RL v2 server, on CPU.

The vendor's ``/health`` answers ``{"status": "OK"}`` and lists no features; its routes await the training job's
workers and the sampling job's replica pool, which are separate (``verl/workers/remote_client/arctic/
concurrency.py``), so ``trainer.v1.remote_backend.async_mode=true`` runs asynchronously against it. It does not
promise that a weight sync leaves the ``/generate`` calls in flight alone, so each weight sync is fenced: the
rollout server holds new calls and waits for those in flight (``verl/remote_backend/workers/weight_fence.py``).

* ``test_two_async_grpo_steps_against_the_vendor``: two GRPO steps, asynchronous (verl's replay buffer; step 1
  trains the warm-up batch, on-policy; step 2 a batch at most one version old), every weight sync fenced, nothing
  dropped.
* ``test_concurrent_jobs_false_falls_back_to_sync``: ``remote_backend.server.concurrent_jobs=false`` (a user who
  wants the jobs to take turns): verl's sync semantics, one log line saying why.

The vendor harness runs a route's worker calls in the server's event loop (its S1 substitution), so there the two
jobs take turns on the server even in this mode; what is tested is the protocol and verl's bookkeeping, not the
overlap (that is tests/arctic_rl/server/jobs/test_concurrent_jobs_on_cpu.py on the reference server).

Run by hand::

    pytest -m e2e tests/conformance/test_vendor_async_on_cpu.py -s
"""

from __future__ import annotations

import pytest

from tests.support.e2e import check_steps, check_trained, run_recipe, tiny_grpo_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN_TIMEOUT_S = 900
FALLBACK = "falling back to verl's sync mode"


def _run(vendor_server, task, tmp_path, *extra: str):
    out = tmp_path / "run"
    return run_recipe([
        *tiny_grpo_overrides(task, out, micro_batch=2),
        "remote_backend=arctic",
        f"remote_backend.server.url={vendor_server.url}",
        f"remote_backend.train.checkpoint_path={out / 'vendor_checkpoints'}",
        "trainer.v1.remote_backend.async_mode=true",
        *extra,
    ], cwd=tmp_path, timeout=RUN_TIMEOUT_S, explain=lambda: f"--- vendor log:\n{vendor_server.log_tail()}")


@pytest.mark.timeout(RUN_TIMEOUT_S + 180)
def test_two_async_grpo_steps_against_the_vendor(vendor_server, reverse_text_task, tmp_path):
    steps, output = _run(vendor_server, reverse_text_task, tmp_path)

    assert FALLBACK not in output
    on = [line for line in output.splitlines() if "asynchronous remote mode on" in line]
    assert len(on) == 1 and "the server lists no features" in on[0], on
    assert "each weight sync waits for the samples in flight" in output  # the worker fences its syncs
    assert "fenced: waited" in output
    check_steps(steps, [1, 2])
    for step, metrics in steps.items():
        assert metrics["training/off_policy/async_mode"] == 1.0, step
        worst = metrics["training/off_policy/trajectory_staleness_worst/max"]
        assert worst in ((0,) if step == 1 else (0, 1)), (step, worst)  # step 1: the warm-up batch
        assert metrics["training/off_policy/trajectory_staleness/min"] >= 0, step
        assert metrics["training/off_policy/dropped_share"] == 0.0, step
        check_trained(metrics, step)


@pytest.mark.timeout(RUN_TIMEOUT_S + 180)
def test_concurrent_jobs_false_falls_back_to_sync(vendor_server, reverse_text_task, tmp_path):
    steps, output = _run(vendor_server, reverse_text_task, tmp_path, "remote_backend.server.concurrent_jobs=false")

    lines = [line for line in output.splitlines() if FALLBACK in line]
    assert len(lines) == 1, lines
    assert "trainer.v1.remote_backend.async_mode=true but remote_backend.server.concurrent_jobs=false" in lines[0]
    assert "asynchronous remote mode on" not in output
    assert "each weight sync waits" not in output  # sync mode: nothing generates while the weights move
    check_steps(steps, [1, 2])
    for step, metrics in steps.items():
        assert metrics["training/off_policy/async_mode"] == 0.0
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] == 0, step  # sync: on-policy
