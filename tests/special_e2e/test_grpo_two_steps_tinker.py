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

import math
import time
from pathlib import Path

import pytest

from tests.support.e2e import (
    build_task,
    entry_point_command,
    entry_point_env,
    parse_console_metrics,
    run_in_own_session,
)
from tests.support.tinker import PEER_API_KEY, tinker_grpo_overrides

# the peer compiles one XLA program per new shape (sample, forward, forward_backward, compute_logprobs):
# on two shared cores that alone takes minutes, so this test gets more than the suite's 900 s default
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]


def grpo_command(task: dict[str, Path], out: Path, url: str) -> list[str]:
    return entry_point_command(tinker_grpo_overrides(task, out, url))


def test_two_grpo_steps_through_tinker(tmp_path, tinker_peer):
    # the task's model and the peer's are the same tiny Qwen3; the service only trains the one it serves
    task = {**build_task(tmp_path / "task"), "model": tinker_peer.model}
    cmd = grpo_command(task, tmp_path / "run", tinker_peer.url)
    print("running:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    returncode, output = run_in_own_session(cmd, cwd=tmp_path, env=entry_point_env(TINKER_API_KEY=PEER_API_KEY),
                                            timeout=2100)
    (tmp_path / "run.log").write_text(output)
    print(f"wall time {time.monotonic() - t0:.0f} s, log {tmp_path / 'run.log'}", flush=True)
    assert returncode == 0, output[-6000:]
    steps = parse_console_metrics(output)
    assert sorted(steps) == [1, 2], f"steps logged: {sorted(steps)}"
    for step, metrics in steps.items():
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/lr", "actor/entropy",
                    "critic/score/mean", "response_length/mean", "timing_s/gen", "timing_s/update_actor"):
            assert key in metrics, f"step {step}: {key} not logged"
            assert math.isfinite(metrics[key]), f"step {step}: {key}={metrics[key]}"
        assert metrics["actor/lr"] == pytest.approx(1e-3)
        assert 0 < metrics["response_length/mean"] <= 8
        assert metrics["training/global_step"] == step
    assert "actor_rollout_ref.rollout.name=vllm replaced by actor_rollout_ref.rollout.name=tinker" in output
    index = tmp_path / "run" / "checkpoints" / "tinker_state_index.json"
    assert index.exists() and '"2": "tinker://' in index.read_text(), "no Tinker checkpoint recorded for step 2"
