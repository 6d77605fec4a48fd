"""Two GRPO steps of stock verl 0.9.1 through ``remote_backend=tinker``, against a real Tinker server.

The server is the session's ``tinker_peer`` (SkyRL's Tinker API server on CPU, see
``tests/support/tinker.py``), shared with the peer tests; it serves the same tiny Qwen3 as the
``a+b=`` task's model, and the run keeps to the peer's fixed shapes (4 rows of <= 32 tokens, 8 new
tokens, LoRA rank 8), so programs it compiled for the peer tests are reused. verl talks to it only
through the official SDK. The
command is what a user types (``python -m verl.remote_backend.main_ppo <stock GRPO overrides>
remote_backend=tinker remote_backend.server.url=...``) with the API key in ``TINKER_API_KEY``.
A KL penalty in the reward (``algorithm.use_kl_in_reward``) makes verl ask the LoRA actor for
reference log-probs (``no_lora_adapter``), which the adapter serves from a base-model sampler.

Run by hand::

    pytest -m e2e tests/special_e2e/test_grpo_two_steps_tinker.py -s
"""

from __future__ import annotations

import pytest

from tests.support.tinker import check_tinker_grpo, run_tinker_grpo

# the peer compiles one XLA program per new shape (sample, forward, forward_backward, compute_logprobs):
# on two shared cores that alone takes minutes, so this test gets more than the suite's 900 s default
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]


def test_two_grpo_steps_through_tinker(tmp_path, tinker_peer):
    steps, output = run_tinker_grpo(tmp_path, tinker_peer)
    check_tinker_grpo(steps, tmp_path)
    assert "actor_rollout_ref.rollout.name=vllm replaced by actor_rollout_ref.rollout.name=tinker" in output
