"""The asynchronous mode against the vendor's own Arctic RL v2 server: it falls back to sync, saying why once.

The vendor's ``/health`` answers ``{"status": "OK"}`` and lists no features, so it does not say that its
sampling job answers while its training job computes (``concurrent_jobs``). A run asked to be asynchronous
(``trainer.v1.remote_backend.async_mode=true``) must then run verl's sync semantics and log exactly one line
naming the missing feature -- and still finish its two GRPO steps against the vendor.

Run by hand::

    pytest -m e2e tests/conformance/test_vendor_async_fallback_on_cpu.py -s
"""

from __future__ import annotations

import pytest

from tests.support.e2e import check_steps, run_recipe, tiny_grpo_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN_TIMEOUT_S = 900


@pytest.mark.timeout(RUN_TIMEOUT_S + 180)
def test_async_mode_falls_back_to_sync_against_the_vendor(vendor_server, reverse_text_task, tmp_path):
    out = tmp_path / "run"
    steps, output = run_recipe([
        *tiny_grpo_overrides(reverse_text_task, out, micro_batch=2),
        "remote_backend=arctic",
        f"remote_backend.server.url={vendor_server.url}",
        f"remote_backend.train.checkpoint_path={out / 'vendor_checkpoints'}",
        "trainer.v1.remote_backend.async_mode=true",
    ], cwd=tmp_path, timeout=RUN_TIMEOUT_S, explain=lambda: f"--- vendor log:\n{vendor_server.log_tail()}")

    lines = [line for line in output.splitlines() if "falling back to verl's sync mode" in line]
    assert len(lines) == 1, lines
    assert "trainer.v1.remote_backend.async_mode=true" in lines[0]
    assert "does not list the 'concurrent_jobs' feature" in lines[0]
    assert "asynchronous remote mode on" not in output
    check_steps(steps, [1, 2])
    for step, metrics in steps.items():
        assert metrics["training/off_policy/async_mode"] == 0.0
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] == 0, step  # sync: on-policy
