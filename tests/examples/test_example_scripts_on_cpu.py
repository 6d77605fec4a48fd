"""The example GRPO scripts compose the config they promise, through our real entry point.

Each script is run as a user runs it, with Hydra's ``--cfg job`` appended (the scripts pass ``"$@"``
through to ``python -m verl.remote_backend.main_ppo``), so the YAML on stdout is exactly the job
config the run would use -- after the entry point derived its remote-backend settings. Nothing is
trained and no server starts.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch
import yaml

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GRPO_DIR = REPO_ROOT / "examples" / "grpo"
SECRET = "tok-3f9c-never-print-me"


def _compose(script: str, env_extra: dict[str, str], tmp_path: pathlib.Path) -> tuple[dict, str]:
    """Run ``bash <script> --cfg job``; return the composed config and the whole output."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"ZORRO", "STEPS", "SEED", "MODEL_DIR", "DATA_DIR", "OUT_DIR", "ARCTIC_RL_URL",
                        "ARCTIC_RL_TOKEN", "RUN_NAME", "RUN_DIR", "DEVICE", "VERL_FILE_LOGGER_PATH"}}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env.update(env_extra)
    proc = subprocess.run(["bash", str(GRPO_DIR / script), "--cfg", "job"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return yaml.safe_load(proc.stdout), output  # Hydra prints only the config on stdout


def _get(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


@pytest.fixture(scope="module")
def gsm8k_configs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gsm8k")
    common = {"DATA_DIR": "/data/gsm8k", "MODEL_DIR": "/models/qwen3-0.6b", "OUT_DIR": str(tmp / "out")}
    yes, yes_out = _compose("run_gsm8k_grpo_arl.sh",
                            {**common, "ARCTIC_RL_URL": "http://10.1.2.3:7000", "ARCTIC_RL_TOKEN": SECRET}, tmp)
    no, no_out = _compose("run_gsm8k_grpo_arl.sh", {**common, "ZORRO": "false"}, tmp)
    return yes, no, yes_out + no_out


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_gsm8k_scripts_select_the_arctic_backend(gsm8k_configs):
    for cfg in gsm8k_configs[:2]:
        assert _get(cfg, "remote_backend.name") == "arctic"
        assert _get(cfg, "actor_rollout_ref.rollout.name") == "arctic"
        assert _get(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size") == 1  # derived, not in the script
        assert _get(cfg, "trainer.v1.trainer_mode") == "remote_backend"
        assert _get(cfg, "algorithm.adv_estimator") == "grpo"
        assert _get(cfg, "actor_rollout_ref.rollout.n") == 5
        assert _get(cfg, "actor_rollout_ref.actor.use_kl_loss") is False
        assert _get(cfg, "data.train_files") == "/data/gsm8k/train.parquet"
        assert _get(cfg, "data.val_files") == "/data/gsm8k/test.parquet"
        assert _get(cfg, "actor_rollout_ref.model.path") == "/models/qwen3-0.6b"
        assert _get(cfg, "remote_backend.train.deepspeed.zero_stage") == 2
        assert _get(cfg, "remote_backend.train.deepspeed.bf16") is True
        assert _get(cfg, "remote_backend.train.deepspeed.offload_optimizer") is False
        assert "file" in _get(cfg, "trainer.logger")
    if not torch.cuda.is_available():
        assert _get(cfg, "trainer.device") == "cpu"  # derived by the entry point


def test_gsm8k_zorro_must_be_true_or_false(tmp_path):
    env = {**os.environ, "ZORRO": "yes"}
    proc = subprocess.run(["bash", str(GRPO_DIR / "run_gsm8k_grpo_arl.sh"), "--cfg", "job"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "ZORRO: expected true or false, got 'yes'" in proc.stderr


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_gsm8k_zorro_flag_is_the_only_difference(gsm8k_configs):
    yes, no, _ = gsm8k_configs
    assert _get(yes, "remote_backend.train.zorro_train.enable") is True
    assert _get(no, "remote_backend.train.zorro_train.enable") is False

    def normalised(cfg: dict) -> dict:
        cfg = yaml.safe_load(yaml.safe_dump(cfg))
        cfg["remote_backend"]["train"]["zorro_train"]["enable"] = None
        cfg["remote_backend"]["server"]["url"] = None  # given to one script only (next test)
        name = cfg["trainer"]["experiment_name"]
        cfg["trainer"]["experiment_name"] = None
        cfg["trainer"]["default_local_dir"] = cfg["trainer"]["default_local_dir"].replace(name, "RUN")
        env_vars = cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
        env_vars["VERL_FILE_LOGGER_PATH"] = env_vars["VERL_FILE_LOGGER_PATH"].replace(name, "RUN")
        return cfg

    assert normalised(yes) == normalised(no)


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_gsm8k_server_url_comes_from_the_environment(gsm8k_configs):
    yes, no, output = gsm8k_configs
    assert _get(yes, "remote_backend.server.url") == "http://10.1.2.3:7000"
    assert _get(no, "remote_backend.server.url") is None  # unset: the adapter starts the reference server
    assert _get(no, "remote_backend.server.local.device") == "cuda"
    # the token is read from the environment by the adapter; it is never put on a command line or in the config
    assert _get(yes, "remote_backend.server.token") is None
    assert SECRET not in output


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_reverse_text_script_maps_the_measured_recipe(tmp_path):
    cfg, _output = _compose("run_reverse_text_grpo_arl_local.sh", {"OUT_DIR": str(tmp_path / "rt"), "ZORRO": "true",
                                                                 "STEPS": "12", "SEED": "0"}, tmp_path)
    assert not (tmp_path / "rt").exists()  # --cfg job builds, runs and deletes nothing
    expected = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": True,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "data.train_batch_size": 32,
        "actor_rollout_ref.rollout.n": 8,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "actor_rollout_ref.actor.optim.betas": [0.9, 0.99],
        "actor_rollout_ref.actor.optim.weight_decay": 0.0,
        "actor_rollout_ref.actor.clip_ratio": 0.2,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.rollout.temperature": 1.0,
        "data.dataloader_num_workers": 0,
        "trainer.val_before_train": False,
        "trainer.total_training_steps": 12,
        "trainer.save_freq": 12,  # one checkpoint on the server, at the last step (examples/common/export_hf.py)
        "reward.custom_reward_function.name": "compute_score",
        "remote_backend.server.url": None,
        "remote_backend.train.zorro_train.enable": True,
        "remote_backend.train.deepspeed.bf16": False,
        "actor_rollout_ref.rollout.name": "arctic",
        "remote_backend.rollout.max_batch_size": 256,  # one /generate call for all 32 x 8 samples
        "data.seed": 0,
        "actor_rollout_ref.rollout.seed": 0,
        "actor_rollout_ref.actor.data_loader_seed": 0,
    }
    got = {key: _get(cfg, key) for key in expected}
    assert got == expected
    assert 10 <= _get(cfg, "data.max_response_length") <= 16
    reward_path = pathlib.Path(_get(cfg, "reward.custom_reward_function.path"))
    assert reward_path == REPO_ROOT / "examples" / "reverse_text" / "reward.py"
    assert _get(cfg, "actor_rollout_ref.model.path") == str(tmp_path / "rt" / "model_warm_seed0")
    # verl's file logger runs in a Ray worker: on a running cluster the path must travel in the runtime_env
    # a directory of its own for every run (no RUN_NAME given): what it is plus a time stamp
    metrics = pathlib.Path(_get(cfg, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"))
    assert metrics.name == "metrics.jsonl" and metrics.parent.parent == tmp_path / "rt" / "runs"
    assert re.fullmatch(r"grpo_zorro_true_seed0_\d{8}-\d{6}", metrics.parent.name), metrics
    assert _get(cfg, "trainer.experiment_name") == metrics.parent.name
    assert "file" in _get(cfg, "trainer.logger")
    if not torch.cuda.is_available():
        assert _get(cfg, "trainer.device") == "cpu"  # derived by the entry point


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_reverse_text_failure_reaches_the_terminal_with_the_log_path(tmp_path):
    """Quiet by default: a failing run prints its header, the failing command's last lines and the log path."""
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    data.mkdir()
    (model / "warm_start.json").write_text("{}")  # cached: the script builds no model, warm start or data
    for name in ("train.parquet", "val.parquet"):
        (data / name).write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k not in {"VERBOSE", "RUN_DIR", "ARCTIC_RL_URL"}}
    env.update(PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHON=sys.executable,
               OUT_DIR=str(tmp_path / "out"), MODEL_DIR=str(model), DATA_DIR=str(data), RUN_NAME="bad")
    proc = subprocess.run(["bash", str(GRPO_DIR / "run_reverse_text_grpo_arl_local.sh"), "trainer.no_such_key=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    terminal = proc.stdout + proc.stderr
    log = tmp_path / "out" / "runs" / "bad" / "run.log"
    assert proc.returncode != 0, terminal
    assert f"log:     {log}" in proc.stdout  # named in the header
    assert f"full log: {log}" in proc.stderr and "FAILED (exit status" in proc.stderr
    assert "no_such_key" in proc.stderr  # the error itself, from the log's tail
    assert len(terminal.splitlines()) <= 60, terminal
    assert not [line for line in terminal.splitlines() if line.startswith("+")]  # no shell trace on the terminal
    assert "no_such_key" in log.read_text() and "+ console_run" in log.read_text()  # the trace went to the log


@pytest.mark.slow  # the command under test sleeps 20 s between its two progress lines
def test_console_shows_progress_lines_as_they_come(tmp_path):
    """examples/common/console.sh: matching lines reach the terminal at once (not at the end), once each,
    without Ray's "(Actor pid=N)" prefix; the rest only reaches the log."""
    script = tmp_path / "run.sh"
    script.write_text(
        "set -euo pipefail\n"
        f"source {REPO_ROOT / 'examples' / 'common' / 'console.sh'}\n"
        f"console_init {tmp_path / 'run.log'}\n"
        "console_run '^\\[p\\] step' bash -c 'printf \"\\033[36m(Runner pid=7)\\033[0m [p] step 1\\n\"; "
        "echo \"[p] step 1\"; echo noise; sleep 20; echo \"[p] step 2\"'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERBOSE"}
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        start = time.monotonic()
        first = proc.stdout.readline()
        assert time.monotonic() - start < 15, "the first progress line waited for the command to end"
        assert first == "[p] step 1\n"
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert rest == "[p] step 2\n"  # the repeated line once, no noise
    assert "noise" in (tmp_path / "run.log").read_text()


# ---- the Tinker scripts (examples/grpo/*tinker*.sh): the same recipes, remote_backend=tinker ----

_TINKER_KNOBS = {"TINKER_URL": "", "TINKER_API_KEY": "", "LORA_RANK": "", "BASE_MODEL": "", "MODEL": "",
                 "PEER_PORT": ""}


def _shared_recipe(cfg: dict) -> dict:
    """The reverse-text recipe's keys that do not depend on the backend (examples/common/reverse_text.sh)."""
    drop = {"actor_rollout_ref.actor.optim.lr", "trainer.project_name", "trainer.experiment_name",
            "trainer.default_local_dir", "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH",
            "trainer.save_freq"}  # the Arctic script saves its last step on the server (for export_hf)
    keys = [f"{group}.{k}" for group in ("data", "algorithm", "trainer") for k in cfg[group] if k != "v1"]
    keys += [f"actor_rollout_ref.{group}.{k}" for group in ("actor", "rollout") for k in
             ("optim", "ppo_mini_batch_size", "ppo_epochs", "clip_ratio", "loss_agg_mode", "use_kl_loss",
              "entropy_coeff", "data_loader_seed", "n", "temperature", "top_p", "top_k", "seed")
             if k in cfg["actor_rollout_ref"][group]]
    keys += ["reward.custom_reward_function", "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"]
    out = {key: _get(cfg, key) for key in keys if key not in drop}
    out["actor_rollout_ref.actor.optim"] = {k: v for k, v in out["actor_rollout_ref.actor.optim"].items() if k != "lr"}
    return out


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_reverse_text_tinker_script_runs_the_arctic_recipe_through_tinker(tmp_path):
    common = {"OUT_DIR": str(tmp_path / "rt"), "STEPS": "12", "SEED": "0", "RUN_NAME": "same"}
    tinker, output = _compose("run_reverse_text_grpo_tinker_local.sh",
                              {**_TINKER_KNOBS, **common, "LORA_RANK": "16", "PEER_PORT": "8799"}, tmp_path)
    arctic, _ = _compose("run_reverse_text_grpo_arl_local.sh", common, tmp_path)
    assert not (tmp_path / "rt").exists()  # --cfg job builds, starts and deletes nothing
    expected = {
        "remote_backend.name": "tinker",
        "actor_rollout_ref.rollout.name": "tinker",  # derived by the entry point
        "trainer.v1.trainer_mode": "remote_backend",
        "actor_rollout_ref.model.lora_rank": 16,
        "actor_rollout_ref.actor.optim.lr": 2e-3,
        "remote_backend.server.url": "http://127.0.0.1:8799",  # the peer the script starts
        "remote_backend.server.base_model": None,  # = the model path
        "remote_backend.rollout.max_batch_size": 256,
        "trainer.total_training_steps": 12,
        "trainer.project_name": "reverse_text_grpo_tinker",
        "actor_rollout_ref.model.path": str(tmp_path / "rt" / "model_warm_seed0"),
    }
    assert {key: _get(tinker, key) for key in expected} == expected
    # one recipe (examples/common/reverse_text.sh), two backends: the learning rate is the only recipe difference
    assert _shared_recipe(tinker) == _shared_recipe(arctic)
    assert _get(arctic, "actor_rollout_ref.actor.optim.lr") == 1e-3
    assert _get(arctic, "trainer.save_freq") == 12 and _get(tinker, "trainer.save_freq") == -1
    metrics = tmp_path / "rt" / "runs" / "same" / "metrics.jsonl"
    assert _get(tinker, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH") == str(metrics)
    assert "tml-local-peer" not in output


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_gsm8k_tinker_script_selects_the_service_and_keeps_the_key_out(tmp_path):
    env = {**_TINKER_KNOBS, "TINKER_API_KEY": SECRET, "TINKER_URL": "https://tinker.example:443",
           "BASE_MODEL": "Qwen/Qwen3-8B", "MODEL": "/models/qwen3-8b", "DATA_DIR": "/data/gsm8k",
           "OUT_DIR": str(tmp_path / "out")}
    cfg, output = _compose("run_gsm8k_grpo_tinker.sh", env, tmp_path)
    expected = {
        "remote_backend.name": "tinker",
        "actor_rollout_ref.rollout.name": "tinker",
        "remote_backend.server.url": "https://tinker.example:443",
        "remote_backend.server.base_model": "Qwen/Qwen3-8B",
        "actor_rollout_ref.model.path": "/models/qwen3-8b",
        "actor_rollout_ref.model.lora_rank": 32,
        "data.train_files": "/data/gsm8k/train.parquet",
        "data.val_files": "/data/gsm8k/test.parquet",
        "data.train_batch_size": 32,
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.actor.use_kl_loss": False,
        "trainer.save_freq": 20,
    }
    assert {key: _get(cfg, key) for key in expected} == expected
    assert SECRET not in output  # read by the SDK from the environment; never in the config or on a command line
    assert not (tmp_path / "out").exists()
    default, _ = _compose("run_gsm8k_grpo_tinker.sh", {**_TINKER_KNOBS, "TINKER_API_KEY": SECRET}, tmp_path)
    assert _get(default, "remote_backend.server.url") is None  # the SDK's default: the hosted service
    assert _get(default, "remote_backend.server.base_model") is None


def test_gsm8k_tinker_script_without_an_api_key_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TINKER_API_KEY"}
    proc = subprocess.run(["bash", str(GRPO_DIR / "run_gsm8k_grpo_tinker.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "TINKER_API_KEY is not set" in proc.stderr


def test_async_adds_verls_rollout_correction_and_nothing_else():
    """``recipe_async_correction``: ASYNC=true adds verl's decoupled token-level IS (threshold 2) for the lagged
    samples; ASYNC=false adds nothing."""
    def lines(value: str) -> list[str]:
        out = subprocess.run(["bash", "-c", f'source examples/common/recipe.sh && recipe_async_correction {value}'],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True).stdout
        return out.splitlines()

    assert lines("true") == ["actor_rollout_ref.rollout.calculate_log_probs=true",
                             "algorithm.rollout_correction.rollout_is=token",
                             "algorithm.rollout_correction.rollout_is_threshold=2.0"]
    assert lines("false") == []


@pytest.mark.slow  # the script composes verl's config in a Python process that imports verl: ~20 s and more
def test_reverse_text_async_switch_reaches_the_config_with_its_correction(tmp_path):
    cfg, _ = _compose("run_reverse_text_grpo_arl_local.sh", {"ASYNC": "true", "OUT_DIR": str(tmp_path / "out")},
                      tmp_path)
    assert _get(cfg, "trainer.v1.remote_backend.async_mode") is True
    assert _get(cfg, "algorithm.rollout_correction.rollout_is") == "token"
    assert _get(cfg, "algorithm.rollout_correction.rollout_is_threshold") == 2.0
    assert _get(cfg, "actor_rollout_ref.rollout.calculate_log_probs") is True
