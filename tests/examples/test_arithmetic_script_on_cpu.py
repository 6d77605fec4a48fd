"""The arithmetic GRPO script composes the recipe it promises, on each device, through our real entry point.

``examples/grpo/run_arithmetic_grpo_smollm2.sh`` is run as a user runs it, with Hydra's ``--cfg job`` appended:
the YAML on stdout is the job config a run would use. Nothing is built, trained or started. The recipe's
values come from ``examples/common/arithmetic.sh`` (shared with the stock-verl script), sized by device.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import yaml

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "examples" / "grpo" / "run_arithmetic_grpo_smollm2.sh"
KNOBS = {"ZORRO", "STEPS", "SEED", "MODEL_DIR", "DATA_DIR", "OUT_DIR", "ARCTIC_RL_URL", "RUN_NAME", "RUN_DIR",
         "DEVICE", "PROMPT_STYLE", "BATCH", "N", "MINI_BATCH", "MICRO", "RESP_LEN", "PROMPT_LEN", "LR",
         "TEMPERATURE", "N_TRAIN", "N_VAL", "AGENT_WORKERS", "VERL_FILE_LOGGER_PATH", "SMOLLM2_WHEEL",
         "KV_CACHE_BYTES", "GPU_MEMORY_UTILIZATION"}


def _run(env_extra: dict[str, str], tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "out"), **env_extra})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _compose(env_extra: dict[str, str], tmp_path: pathlib.Path, *overrides: str) -> dict:
    proc = _run(env_extra, tmp_path, *overrides, "--cfg", "job")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return yaml.safe_load(proc.stdout)  # Hydra prints only the config on stdout


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


RECIPE = {  # the same on every device and backend
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.optim.lr": 1e-5,
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.weight_decay": 0.0,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "reward.custom_reward_function.name": "compute_score",
}


@pytest.mark.slow  # each composition runs a Python process that imports verl: ~20 s and more
def test_cpu_and_gpu_sizes_and_backend_keys(tmp_path):
    cpu = _compose({"DEVICE": "cpu"}, tmp_path)
    gpu = _compose({"DEVICE": "cuda", "PROMPT_STYLE": "fewshot", "ZORRO": "true"}, tmp_path)
    for cfg in (cpu, gpu):
        for key, value in RECIPE.items():
            assert _get(cfg, key) == value, key
        assert _get(cfg, "reward.custom_reward_function.path") == str(REPO_ROOT / "examples/arithmetic/reward.py")
        assert _get(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size") == _get(cfg, "data.train_batch_size")
        assert _get(cfg, "remote_backend.server.url") is None  # the local reference server
        assert _get(cfg, "remote_backend.rollout.max_batch_size") == (
            _get(cfg, "data.train_batch_size") * _get(cfg, "actor_rollout_ref.rollout.n"))
    sizes = ("data.train_batch_size", "actor_rollout_ref.rollout.n", "data.max_response_length",
             "data.max_prompt_length")
    assert [_get(cpu, k) for k in sizes] == [8, 4, 48, 256]
    assert [_get(gpu, k) for k in sizes] == [64, 8, 128, 1600]
    # verl's agent-loop workers: one on a CPU (each is a process competing for the cores), four on a GPU host
    assert _get(cpu, "actor_rollout_ref.rollout.agent.num_workers") == 1
    assert _get(gpu, "actor_rollout_ref.rollout.agent.num_workers") == 4
    assert _get(cpu, "remote_backend.server.local.device") == "cpu"
    assert _get(cpu, "remote_backend.train.deepspeed.bf16") is False
    assert _get(cpu, "remote_backend.train.zorro_train.enable") is False
    assert _get(gpu, "remote_backend.server.local.device") == "cuda"
    assert _get(gpu, "remote_backend.server.local.sampler") == "vllm"
    assert _get(gpu, "remote_backend.train.deepspeed.bf16") is True
    assert _get(gpu, "remote_backend.train.zorro_train.enable") is True
    assert _get(gpu, "data.train_files") == str(tmp_path / "out" / "data_fewshot_seed0" / "train.parquet")


@pytest.mark.slow  # the composition runs a Python process that imports verl: ~20 s and more
def test_env_knobs_then_hydra_overrides_win(tmp_path):
    cfg = _compose({"DEVICE": "cpu", "BATCH": "6", "N": "3", "MINI_BATCH": "2", "RESP_LEN": "20", "LR": "3e-6",
                    "SEED": "5", "AGENT_WORKERS": "3"}, tmp_path, "actor_rollout_ref.rollout.n=5")
    assert _get(cfg, "data.train_batch_size") == 6
    assert _get(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size") == 2
    # the micro-batch divides a mini-batch's 2 x 3 rows: the largest such size up to the CPU default 32
    assert _get(cfg, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") == 2
    assert _get(cfg, "data.max_response_length") == 20
    assert _get(cfg, "actor_rollout_ref.actor.optim.lr") == 3e-6
    assert _get(cfg, "data.seed") == 5 and _get(cfg, "actor_rollout_ref.rollout.seed") == 5
    assert _get(cfg, "actor_rollout_ref.rollout.agent.num_workers") == 3
    assert _get(cfg, "actor_rollout_ref.rollout.n") == 5  # the command line's override comes last


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PROMPT_STYLE": "long"}, "PROMPT_STYLE: expected short or fewshot, got 'long'"),
        ({"DEVICE": "tpu"}, "DEVICE: expected auto, cuda or cpu, got 'tpu'"),
        ({"DEVICE": "cpu", "BATCH": "0"}, "BATCH: expected a positive integer, got '0'"),
        ({"DEVICE": "cpu", "BATCH": "8", "MINI_BATCH": "3"}, "MINI_BATCH: expected a divisor of BATCH=8, got 3"),
        ({"ZORRO": "yes"}, "ZORRO: expected true or false, got 'yes'"),
        ({"DEVICE": "cpu", "MICRO": "5"}, "MICRO: expected a positive divisor of MINI_BATCH x N = 32, got '5'"),
        ({"DEVICE": "cpu", "AGENT_WORKERS": "0"}, "AGENT_WORKERS: expected a positive integer, got '0'"),
        ({"DEVICE": "cuda", "KV_CACHE_BYTES": "4G"},
         "KV_CACHE_BYTES: expected a positive number of bytes, batch, shared, or nothing, got '4G'"),
    ],
)
def test_bad_knobs_stop_the_script_with_the_reason(tmp_path, env, message):
    proc = _run(env, tmp_path, "--cfg", "job")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was built


@pytest.mark.parametrize("knob", ["batch", "shared"])
def test_kv_cache_sized_to_the_batch_needs_the_models_config(tmp_path, knob):
    """KV_CACHE_BYTES=batch|shared read MODEL_DIR's config.json; without one the script stops naming the knob
    and file."""
    model_dir = tmp_path / "no_model"
    proc = _run({"DEVICE": "cuda", "KV_CACHE_BYTES": knob, "MODEL_DIR": str(model_dir)}, tmp_path, "--cfg", "job")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"KV_CACHE_BYTES={knob}" in proc.stderr and str(model_dir / "config.json") in proc.stderr
