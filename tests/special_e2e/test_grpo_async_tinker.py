"""Two asynchronous GRPO steps through ``remote_backend=tinker`` against a real Tinker server (the session's peer).

The recipe of tests/special_e2e/test_grpo_two_steps_tinker.py (SkyRL's Tinker API server on CPU, the
peer's fixed shapes, a KL penalty in the reward) with ``trainer.v1.remote_backend.async_mode=true``: Tinker's
adapter says its sampling client answers while its training client computes (separate SDK clients, futures), so
the run is asynchronous -- step 2 trains the batch sampled before step 1's update (one version old) and hardly
waits for generation.

Run by hand::

    pytest -m e2e tests/special_e2e/test_grpo_async_tinker.py -s
"""

from __future__ import annotations

import pytest

from tests.support.tinker import check_tinker_grpo, run_tinker_grpo

# the peer compiles one XLA program per new shape (sample, forward, forward_backward, compute_logprobs):
# on two shared cores that alone takes minutes, so this test gets more than the suite's 900 s default
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]


def test_two_async_grpo_steps_through_tinker(tmp_path, tinker_peer):
    steps, output = run_tinker_grpo(tmp_path, tinker_peer, "trainer.v1.remote_backend.async_mode=true")
    check_tinker_grpo(steps, tmp_path)
    assert "asynchronous remote mode on (Tinker's sampling and training clients" in output
    assert all(metrics["training/off_policy/async_mode"] == 1.0 for metrics in steps.values())
    assert steps[1]["training/off_policy/trajectory_staleness_worst/max"] == 0
    assert steps[2]["training/off_policy/trajectory_staleness_worst/max"] == 1  # sampled before step 1's update
    assert steps[2]["training/off_policy/trajectory_staleness/max"] <= 1
