"""Helpers for the end-to-end GRPO runs (``tests/special_e2e/``, the vendor e2e in ``tests/conformance/``).

:func:`build_task` writes what a stock verl GRPO command needs for the ``a+b=`` task: a char-level
Qwen3 built on the spot, train/val parquet files in verl's RL format and a reward-function file
(``reward.custom_reward_function``). :func:`tiny_grpo_overrides` is the shrunk stock GRPO recipe the
runs share, :func:`entry_point_env` the environment they run in, :func:`run_in_own_session` runs a
command and stops all it started on a timeout, :func:`parse_console_metrics` reads the per-step lines
of verl's console logger back and :func:`read_metrics_file` those of its file logger. :func:`run_recipe`
puts these together (one verl run through the remote backend's entry point, its log kept, its metrics
returned), :func:`check_steps` checks what every run must have logged and :func:`bundled_server_log` reads the
logs of the server a run started.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 for the right sum in the answer, plus a small bonus per distinct character (varied rewards)."""
    text = solution_str.strip()
    return (1.0 if ground_truth in text else 0.0) + 0.05 * len(set(text))
'''
_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
_NUMBER = re.compile(r"-?\d+(\.\d+)?(e-?\d+)?")


def build_task(root: Path, *, n_val: int = 4) -> dict[str, Path]:
    """8 ``a+b=`` training rows (the first ``n_val`` also as validation), the model and the reward file."""
    import pandas as pd

    from arctic_rl.tiny_models import build_tiny_model

    root.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(root / "model", "qwen3", seed=0)
    rows = []
    for i in range(8):
        a, b = i % 5, (3 * i) % 7
        rows.append({
            "data_source": "tiny/add",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": i},
        })
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:n_val]).to_parquet(root / "val.parquet")
    (root / "reward.py").write_text(REWARD_FN)
    return {"model": Path(model), "train": root / "train.parquet", "val": root / "val.parquet", "reward": root / "reward.py"}


def parse_console_metrics(text: str) -> dict[int, dict[str, float]]:
    """verl's console logger lines ``step:N - key:value - ...`` -> {N: {key: value}}."""
    steps: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        match = _STEP_LINE.search(line)
        if not match:
            continue
        metrics = {}
        for item in match.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            number = _NUMBER.search(value)
            if key and number:
                metrics[key.strip()] = float(number.group(0))
        steps[int(match.group(1))] = metrics
    return steps


def read_metrics_file(path: Path) -> dict[int, dict[str, float]]:
    """verl's file logger (``trainer.logger`` with ``file``; one JSON line ``{"step": N, "data": {...}}`` per step,
    written unbuffered by the trainer's own process) -> {N: {key: value}} for the numeric values. Unlike the console
    lines, which reach the driver through Ray's log streaming and may be cut off when the run ends, every step the
    trainer logged is in the file."""
    steps: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        steps[int(record["step"])] = {key: float(value) for key, value in record["data"].items()
                                      if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return steps


def tiny_grpo_overrides(task: dict[str, Path], out: Path, *, steps: int = 2, response_length: int = 8,
                        lr: float = 1e-3, micro_batch: int = 2, save_freq: int = -1) -> list[str]:
    """A stock verl GRPO recipe shrunk to the tiny task: 2 prompts x n=2 per step, one mini-batch of 4
    rows (``micro_batch`` rows per micro-batch), the KL loss on, console metrics, outputs under ``out``."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={task['train']}",
        f"data.val_files={task['val']}",
        "data.train_batch_size=2",
        "data.max_prompt_length=32",
        f"data.max_response_length={response_length}",
        f"actor_rollout_ref.model.path={task['model']}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"reward.custom_reward_function.path={task['reward']}",
        "trainer.logger=[console,file]",  # the file: every step's metrics (run_recipe reads them back)
        "trainer.val_before_train=False",
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={save_freq}",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        f"hydra.run.dir={out / 'hydra'}",
    ]


def entry_point_command(overrides: Sequence[str]) -> list[str]:
    """``python -m verl.remote_backend.main_ppo <overrides>`` with this interpreter."""
    return [sys.executable, "-m", "verl.remote_backend.main_ppo", *overrides]


def entry_point_env(**extra: str) -> dict[str, str]:
    """This process's environment for a run: one thread per process (the cores are shared), Ray's
    log lines not deduplicated (tests read them), and no inherited setting that changes what runs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1")
    for name in ("VERL_USE_EXTERNAL_MODULES", "ARCTIC_RL_TOKEN"):
        env.pop(name, None)
    env.update(extra)
    return env


def run_in_own_session(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own and return its exit status and output (stderr folded in).
    On a timeout the whole session -- the trainer, Ray, a server it started -- gets SIGTERM (the entry
    point destroys its backend on it), then SIGKILL, and the test fails with the output's tail."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} ... did not finish in {timeout} s:\n{output[-6000:]}")


def run_recipe(overrides: Sequence[str], *, cwd: Path, timeout: float, name: str = "run",
               env: dict[str, str] | None = None,
               explain: Callable[[], str] | None = None) -> tuple[dict[int, dict[str, float]], str]:
    """Run ``python -m verl.remote_backend.main_ppo <overrides>`` in ``cwd`` (its own session, :func:`entry_point_env`
    plus ``env``), print the command and the wall time, keep the output in ``<cwd>/<name>.log`` and fail on a
    non-zero exit with the output's tail (and ``explain()``: a server's log, ...). Returns the metrics of each
    step and the whole output: the metrics from verl's file logger (``<cwd>/<name>.metrics.jsonl``) when the run
    logs to a file (:func:`tiny_grpo_overrides` does), else from its console lines."""
    cmd = entry_point_command(overrides)
    print(f"{name}: running:", " ".join(cmd), flush=True)
    start = time.monotonic()
    metrics_file = cwd / f"{name}.metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    run_env = entry_point_env(**{"VERL_FILE_LOGGER_PATH": str(metrics_file), **(env or {})})
    returncode, output = run_in_own_session(cmd, cwd=cwd, env=run_env, timeout=timeout)
    log = cwd / f"{name}.log"
    log.write_text(output)
    print(f"{name}: exit {returncode}, wall time {time.monotonic() - start:.0f} s, log {log}", flush=True)
    assert returncode == 0, output[-6000:] + (f"\n{explain()}" if explain else "")
    if metrics_file.exists():
        return read_metrics_file(metrics_file), output
    return parse_console_metrics(output), output


def bundled_server_log(run_out: Path) -> str:
    """The logs of the reference server a run under ``run_out`` started itself (``remote_backend.server.url`` null;
    it writes them under the run's ``checkpoints/arctic_server/``), as one text; fails when there are none."""
    logs = sorted((run_out / "checkpoints" / "arctic_server").glob("*.log"))
    assert logs, f"the local reference server wrote no log under {run_out}"
    return "\n".join(p.read_text(errors="replace") for p in logs)


def check_steps(steps: dict[int, dict[str, float]], expected: Sequence[int], keys: Sequence[str] = ()) -> None:
    """verl logged exactly the steps ``expected``, each under its own ``training/global_step`` and with every
    metric of ``keys`` as a finite number."""
    assert sorted(steps) == list(expected), f"steps logged: {sorted(steps)}"
    for step, metrics in steps.items():
        assert metrics["training/global_step"] == step
        for key in keys:
            assert key in metrics, f"step {step}: {key} not logged"
            assert math.isfinite(metrics[key]), f"step {step}: {key}={metrics[key]}"


def check_trained(metrics: dict[str, float], step: int) -> None:
    """The step's update ran on the server: ``actor/grad_norm`` logged, and above 0 wherever an advantage was not 0.
    A step whose samples all scored alike within each group (often all 0 for an untrained tiny model) has every
    advantage 0, and at step 1 the KL term is at its minimum: its gradient is 0, rightly."""
    assert metrics["actor/grad_norm"] >= 0, (step, metrics["actor/grad_norm"])
    if metrics["critic/advantages/max"] != 0 or metrics["critic/advantages/min"] != 0:
        assert metrics["actor/grad_norm"] > 0, (step, "advantages not all 0, yet no gradient")
