"""Two GRPO steps of stock verl 0.9.1 on the Arctic RL reference server, on CPU, ZoRRO on and off.

The command is exactly what a user types (``python -m verl.remote_backend.main_ppo <stock GRPO
overrides> remote_backend=arctic``); the recipe even says ``rollout.name=vllm``, tensor parallel 2
and 8 GPUs per node, which the entry point replaces. ``remote_backend.server.url`` is left null,
so the adapter starts a local reference server (real generation with transformers, real DeepSpeed
training, real log-probs) and stops it at the end.

The tiny task: ``a+b=`` prompts, a custom reward function file (``reward.custom_reward_function``),
a char-level Qwen3 built on the spot. The run is parsed from verl's console logger.

Run by hand (prints the command it runs)::

    pytest -m e2e tests/special_e2e/test_grpo_two_steps_on_cpu.py -s
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers_e2e import build_task, parse_console_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def grpo_command(task: dict[str, Path], out: Path, *, zorro: bool) -> list[str]:
    overrides = [
        # a stock GRPO recipe, shrunk
        "algorithm.adv_estimator=grpo",
        f"data.train_files={task['train']}",
        f"data.val_files={task['val']}",
        "data.train_batch_size=2",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={task['model']}",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"reward.custom_reward_function.path={task['reward']}",
        "trainer.logger=[console]",
        "trainer.n_gpus_per_node=8",
        "trainer.val_before_train=False",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        f"hydra.run.dir={out / 'hydra'}",
        # the remote backend
        "remote_backend=arctic",
        f"remote_backend.train.zorro_train.enable={str(zorro).lower()}",
        "remote_backend.train.deepspeed.bf16=false",
    ]
    if zorro:  # checkpointed layers re-run without ZoRRO's shared prompt keys: ZoRRO needs it off
        overrides.append("actor_rollout_ref.model.enable_gradient_checkpointing=False")
    return [sys.executable, "-m", "verl.remote_backend.main_ppo", *overrides]


@pytest.mark.parametrize("zorro", [False, True], ids=["zorro_off", "zorro_on"])
def test_two_grpo_steps_on_the_reference_server(tmp_path, zorro):
    task = build_task(tmp_path / "task")
    cmd = grpo_command(task, tmp_path / "run", zorro=zorro)
    print("running:", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_DEDUP_LOGS="0")
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500,
                          check=False)
    wall = time.monotonic() - start
    output = proc.stdout + proc.stderr
    (tmp_path / "run.log").write_text(output)
    print(f"wall time {wall:.0f} s, log {tmp_path / 'run.log'}", flush=True)
    assert proc.returncode == 0, output[-6000:]

    steps = parse_console_metrics(output)
    assert sorted(steps) == [1, 2], f"steps logged: {sorted(steps)}"
    for step, metrics in steps.items():
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
                    "actor/entropy", "actor/kl_loss", "perf/mfu/actor", "critic/score/mean",
                    "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/ref"):
            assert key in metrics, f"step {step}: {key} not logged"
            assert math.isfinite(metrics[key]), f"step {step}: {key}={metrics[key]}"
        assert metrics["actor/lr"] == pytest.approx(1e-3)
        assert 0 < metrics["response_length/mean"] <= 8
        if metrics["critic/advantages/max"] > metrics["critic/advantages/min"]:
            assert metrics["actor/grad_norm"] > 0  # a real backward pass on the server
        elif step == 1:  # every sample of every group scored the same, and the actor is still the reference:
            assert metrics["actor/grad_norm"] == 0  # GRPO and the KL loss have nothing to push
        assert metrics["training/global_step"] == step
        # the adapter reports the tokens the server really computed: ZoRRO runs each GRPO group's
        # shared prompt once (fewer than the batch holds); the plain pass every row, padding included
        computed, total = metrics["actor/arctic/tokens_computed"], metrics["global_seqlen/mean"]
        assert (computed < total) if zorro else (computed >= total), (computed, total)
    assert "[remote_backend] actor_rollout_ref.rollout.name=vllm replaced by actor_rollout_ref.rollout.name=arctic" in output
    assert "remote backend 'arctic' destroyed" in output
    server_logs = list((tmp_path / "run" / "checkpoints" / "arctic_server").glob("*.log"))
    assert server_logs, "the local reference server wrote no log"
    server_log = "\n".join(p.read_text(errors="replace") for p in server_logs)
    assert "loss_fn=verl_grpo" in server_log and "step job=" in server_log
    if zorro:
        assert "ZoRRO requested but not possible" not in server_log
    assert re.search(r"\[remote_backend\] step 2/2 \| reward -?\d", output), "no progress line"
