"""Hydra composition of ``python -m verl.remote_backend.main_ppo`` and the plugin route.

A stock GRPO recipe's overrides plus ``remote_backend=arctic`` (no ``+``) must compose to a config
with every derived setting in place, whatever the recipe said about them; the stock entry point
must refuse a remote backend it would silently ignore.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.settings import (
    TRAINER_MODE,
    apply_forced_settings,
    ensure_ray_cpus,
    forced_settings,
    required_ray_cpus,
    rewrite_overrides,
    selected_backend,
)

REPO = Path(__file__).resolve().parents[2]

# what examples/grpo_trainer/run_qwen2-7b.sh-style recipes pass (model/data paths are not read by --cfg)
STOCK_GRPO = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=/data/gsm8k/train.parquet",
    "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=512",
    "data.max_response_length=128",
    "actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "trainer.logger=[console]",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.total_epochs=15",
]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env.update(OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0", **extra)
    return env


def _run(args: list[str], *, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=300,
        check=False,
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------ pure functions
def test_rewrite_replaces_forced_keys_reports_them_and_keeps_the_rest():
    args = [*STOCK_GRPO, "remote_backend=arctic", "--cfg", "job"]
    new, notes = rewrite_overrides(args, has_accelerator=False)
    forced = forced_settings("arctic", has_accelerator=False)
    assert new[-2:] == ["--cfg", "job"]  # flags stay after the overrides (Hydra's argparse)
    for key, value in forced.items():
        assert f"{key}={value}" in new
        assert sum(t.startswith(key + "=") for t in new) == 1
    assert "data.train_batch_size=16" in new and "actor_rollout_ref.rollout.n=5" in new
    replaced = {n.split("=", 1)[0] for n in notes}
    assert replaced == {"actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.name", "trainer.n_gpus_per_node"}


def test_rewrite_without_a_backend_changes_nothing_and_plus_syntax_is_recognised():
    assert rewrite_overrides(STOCK_GRPO, has_accelerator=False) == (STOCK_GRPO, [])
    assert selected_backend(["+remote_backend=arctic"]) == "arctic"
    assert selected_backend(["remote_backend=arctic", "~remote_backend=arctic"]) == "arctic"
    assert "trainer.device" not in forced_settings("arctic", has_accelerator=True)


def test_apply_forced_settings_edits_in_place_and_refuses_a_strict_mismatch():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "tensor_model_parallel_size": 4}},
                            "trainer": {"n_gpus_per_node": 8, "nnodes": 2, "device": "cuda", "v1": {"trainer_mode": "sync"}}})
    with pytest.raises(RemoteBackendConfigError, match="actor_rollout_ref.rollout.name") as info:
        apply_forced_settings(cfg, "arctic", has_accelerator=False, strict_keys=("actor_rollout_ref.rollout.name",))
    assert info.value.allowed == "arctic" and info.value.received == "vllm"
    cfg.actor_rollout_ref.rollout.name = "arctic"
    notes = apply_forced_settings(cfg, "arctic", has_accelerator=False)
    assert cfg.trainer.n_gpus_per_node == 1 and cfg.trainer.nnodes == 1 and cfg.trainer.device == "cpu"
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    assert cfg.trainer.v1.trainer_mode == TRAINER_MODE
    assert any("n_gpus_per_node" in n for n in notes)


def test_ray_cpus_cover_the_transfer_queue_units_and_leave_clusters_alone():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"trainer": {"use_v1": True}, "ray_kwargs": {"ray_init": {"num_cpus": 2}},
                            "transfer_queue": {"backend": {"SimpleStorage": {"num_data_storage_units": 8}}}})
    assert required_ray_cpus(cfg) == 1 + 2 + 1 + 8
    assert "num_cpus" in ensure_ray_cpus(cfg) and cfg.ray_kwargs.ray_init.num_cpus == 12
    assert ensure_ray_cpus(cfg) is None  # already enough
    cluster = OmegaConf.create({"trainer": {"use_v1": False}, "ray_kwargs": {"ray_init": {"num_cpus": 1, "address": "ray://head:10001"}}})
    assert ensure_ray_cpus(cluster) is None and cluster.ray_kwargs.ray_init.num_cpus == 1


def test_ray_cpus_are_left_alone_inside_a_submitted_job(monkeypatch):
    """A Ray job's driver gets RAY_ADDRESS; ray.init then refuses num_cpus (it joins the cluster)."""
    from omegaconf import OmegaConf

    def config():
        return OmegaConf.create({"trainer": {"use_v1": True}, "ray_kwargs": {"ray_init": {"num_cpus": 1}}})

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = config()
    assert ensure_ray_cpus(cfg) is not None and cfg.ray_kwargs.ray_init.num_cpus == required_ray_cpus(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    cfg = config()
    assert ensure_ray_cpus(cfg) is None and cfg.ray_kwargs.ray_init.num_cpus == 1
    monkeypatch.setenv("RAY_ADDRESS", "local")  # Ray's own word for "start a new local instance"
    cfg = config()
    assert ensure_ray_cpus(cfg) is not None and cfg.ray_kwargs.ray_init.num_cpus > 1


def test_stock_command_line_check_names_each_problem():
    from hydra_plugins.verl_remote_backend_searchpath import check_stock_command_line

    argv = ["main_ppo.py", "+remote_backend=arctic", "actor_rollout_ref.rollout.name=arctic"]
    problems = check_stock_command_line(argv, {})
    assert any("VERL_USE_EXTERNAL_MODULES" in p for p in problems)
    assert any("trainer.v1.trainer_mode=sync" in p for p in problems)
    ok_env = {"VERL_USE_EXTERNAL_MODULES": "other.mod,verl.remote_backend.register"}
    assert check_stock_command_line([*argv, "trainer.v1.trainer_mode=remote_backend"], ok_env) == []
    assert check_stock_command_line(["main_ppo.py", "--config-name", "remote_backend_ppo_trainer", "remote_backend=arctic"], ok_env) == []
    assert check_stock_command_line(["main_ppo.py", *STOCK_GRPO], {}) == []  # no backend: not our business


# ------------------------------------------------------------------ the entry point
@pytest.mark.slow  # a subprocess that imports verl and ray: tens of seconds on two cores
def test_cfg_job_of_our_entry_point_has_every_derived_value():
    proc = _run(["-m", "verl.remote_backend.main_ppo", *STOCK_GRPO, "remote_backend=arctic", "--cfg", "job"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:"):])
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert rollout["name"] == "arctic"
    assert rollout["tensor_model_parallel_size"] == rollout["data_parallel_size"] == rollout["pipeline_model_parallel_size"] == 1
    assert rollout["agent"]["num_workers"] == 1
    assert cfg["trainer"]["n_gpus_per_node"] == 1 and cfg["trainer"]["nnodes"] == 1
    assert cfg["trainer"]["v1"]["trainer_mode"] == TRAINER_MODE
    assert cfg["trainer"]["device"] == ("cuda" if _has_cuda() else "cpu")
    assert cfg["data"]["dataloader_num_workers"] == 0
    assert cfg["transfer_queue"]["backend"]["SimpleStorage"]["num_data_storage_units"] == 1
    assert cfg["reward"]["num_workers"] == 1
    assert cfg["remote_backend"]["name"] == "arctic"
    assert "server" in cfg["remote_backend"] and "rollout" in cfg["remote_backend"]
    # the recipe's own values survive
    assert cfg["data"]["train_batch_size"] == 16 and rollout["n"] == 5 and cfg["trainer"]["total_epochs"] == 15
    assert "actor_rollout_ref.rollout.name=vllm replaced by actor_rollout_ref.rollout.name=arctic" in proc.stderr


@pytest.mark.slow  # a subprocess that imports verl and ray: tens of seconds on two cores
def test_our_entry_point_without_a_backend_fails_naming_the_option():
    proc = _run(["-m", "verl.remote_backend.main_ppo", *STOCK_GRPO])
    assert proc.returncode != 0
    assert "remote_backend" in proc.stderr and "no remote backend selected" in proc.stderr
    assert "arctic" in proc.stderr  # the registered backends are listed
    assert "ray init kwargs" not in proc.stdout  # failed before Ray started


@pytest.mark.slow
def test_stock_main_ppo_refuses_a_backend_without_the_plugin():
    proc = _run(["-m", "verl.trainer.main_ppo", *STOCK_GRPO, "+remote_backend=arctic", "--cfg", "job"])
    assert proc.returncode != 0
    assert "VERL_USE_EXTERNAL_MODULES=verl.remote_backend.register" in proc.stderr
    assert "trainer.v1.trainer_mode=sync" in proc.stderr


@pytest.mark.slow
def test_stock_main_ppo_plugin_route_composes():
    env = _env(VERL_USE_EXTERNAL_MODULES="verl.remote_backend.register")
    proc = _run(["-m", "verl.trainer.main_ppo", "--config-name", "remote_backend_ppo_trainer", *STOCK_GRPO,
                 "remote_backend=arctic", "actor_rollout_ref.rollout.name=arctic", "--cfg", "job"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:"):])
    assert cfg["remote_backend"]["name"] == "arctic" and cfg["trainer"]["v1"]["trainer_mode"] == TRAINER_MODE


# ------------------------------------------------------------------ what the trainer accepts (plugin route)
def _full_config(**overrides):
    from tests.support.arctic import verl_main_config

    return verl_main_config({"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"name": "arctic"}}, **overrides})


def test_trainer_refuses_another_rollout_engine_by_name():
    from verl.remote_backend.trainer import prepare_remote_backend_config

    with pytest.raises(RemoteBackendConfigError, match="actor_rollout_ref.rollout.name") as info:
        prepare_remote_backend_config(_full_config(actor_rollout_ref={"rollout": {"name": "vllm"}}))
    assert (info.value.allowed, info.value.received) == ("arctic", "vllm")


@pytest.mark.parametrize("overrides, field", [
    ({"algorithm": {"adv_estimator": "gae"}}, "algorithm.adv_estimator"),
    ({"reward": {"reward_model": {"enable": True}}}, "reward.reward_model.enable"),
])
def test_trainer_refuses_what_a_forwarder_cannot_do(overrides, field):
    from verl.remote_backend.trainer import prepare_remote_backend_config

    with pytest.raises(RemoteBackendConfigError, match=field.replace(".", r"\.")):
        prepare_remote_backend_config(_full_config(**overrides))


def test_trainer_derives_the_pool_settings_and_needs_a_backend():
    from omegaconf import open_dict

    from verl.remote_backend.trainer import prepare_remote_backend_config

    cfg = _full_config(trainer={"n_gpus_per_node": 8, "nnodes": 2}, actor_rollout_ref={"rollout": {"name": "arctic", "tensor_model_parallel_size": 4}})
    assert prepare_remote_backend_config(cfg) == "arctic"
    assert cfg.trainer.n_gpus_per_node == 1 and cfg.trainer.nnodes == 1
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    with open_dict(cfg):
        del cfg["remote_backend"]
    with pytest.raises(RemoteBackendConfigError, match="no remote backend selected"):
        prepare_remote_backend_config(cfg)
