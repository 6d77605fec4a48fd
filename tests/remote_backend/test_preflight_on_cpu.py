"""Settings a run lacks, values verl cannot convert and an unreachable server end the run in seconds, with one
line naming the key to change (``verl/remote_backend/preflight.py``, wired into ``main_ppo``).

The first tests compose verl's config in this process (Hydra's compose API, as the entry point does) and call
the checks; the ``slow`` ones run the entry point as a user types it and time it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import DictConfig

from tests.support.e2e import build_task, entry_point_env, tiny_grpo_overrides
from verl.remote_backend.preflight import (
    PreflightError,
    check_server_reachable,
    check_settings,
    missing_settings,
    unconvertible_values,
)

BARE_MISSING = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=",
    "data.val_files=",
    "actor_rollout_ref.model.path=",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=",
    "trainer.logger=[console]",  # verl's default adds wandb, which has no login here (entry_point_env drops it)
]


@pytest.fixture(autouse=True)
def _no_wandb_login(monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl.remote_backend.main_ppo import CONFIG_DIR, CONFIG_NAME, register_searchpath_plugin
    from verl.remote_backend.settings import rewrite_overrides

    register_searchpath_plugin()
    args, _ = rewrite_overrides([*overrides, "remote_backend=arctic"], has_accelerator=False)
    args = [a for a in args if not a.startswith("hydra.")]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=args)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    return build_task(tmp_path_factory.mktemp("preflight") / "task")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bare_command_lists_every_missing_setting_at_once():
    problems = missing_settings(_compose([]))
    assert [next(k for k in BARE_MISSING if p.startswith(k)) for p in problems] == BARE_MISSING, problems
    with pytest.raises(PreflightError) as info:
        check_settings(_compose([]))
    message = str(info.value)
    assert message.startswith("command line: 7 settings to add or change: ")
    assert "\n" not in message and all(key.rstrip("=") in message for key in BARE_MISSING)
    assert "'gae'" in message and "train.parquet" in message  # what was given, next to what to set


def test_a_complete_recipe_passes_and_kl_asks_for_the_reference_micro_batch(task, tmp_path):
    overrides = tiny_grpo_overrides(task, tmp_path)
    check_settings(_compose(overrides))  # raises nothing
    without_ref = [o for o in overrides if not o.startswith("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")]
    problems = missing_settings(_compose(without_ref))  # the recipe has use_kl_loss=True
    assert len(problems) == 1 and problems[0].startswith("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=")
    dynamic = [*without_ref, "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True"]
    assert missing_settings(_compose(dynamic)) == []


@pytest.mark.parametrize(("override", "expected"), [
    ("actor_rollout_ref.actor.optim.lr=abc", "actor_rollout_ref.actor.optim.lr: expected a float, got 'abc'"),
    ("actor_rollout_ref.actor.ppo_epochs=two", "actor_rollout_ref.actor.ppo_epochs: expected an int, got 'two'"),
    ("actor_rollout_ref.actor.use_kl_loss=maybe", "actor_rollout_ref.actor.use_kl_loss: expected a bool, got 'maybe'"),
])
def test_a_value_verl_cannot_convert_is_named_with_its_key(task, tmp_path, override, expected):
    config = _compose([*tiny_grpo_overrides(task, tmp_path), override])
    assert unconvertible_values(config) == [expected]
    with pytest.raises(PreflightError, match=expected.split(":")[0]) as info:
        check_settings(config)
    assert expected in str(info.value)


def test_values_verl_converts_are_left_alone(task, tmp_path):
    config = _compose([*tiny_grpo_overrides(task, tmp_path), "actor_rollout_ref.actor.optim.lr='3e-4'",
                       "actor_rollout_ref.actor.ppo_epochs='2'"])
    assert unconvertible_values(config) == []


def test_an_unreachable_server_is_one_error_naming_the_key_the_address_and_null(task, tmp_path):
    port = _free_port()
    config = _compose([*tiny_grpo_overrides(task, tmp_path), f"remote_backend.server.url='http://127.0.0.1:{port}'"])
    start = time.monotonic()
    with pytest.raises(PreflightError) as info:
        check_server_reachable(config)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert message.startswith(f"remote_backend.server.url: cannot reach http://127.0.0.1:{port} (tried a TCP "
                              f"connection to 127.0.0.1:{port}: ")
    assert "remote_backend.server.url=null to start the bundled reference server" in message
    with socket.socket() as listening:  # a server there: the check passes
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        check_server_reachable(_compose([*tiny_grpo_overrides(task, tmp_path), f"remote_backend.server.url='{url}'"]))
    check_server_reachable(_compose(tiny_grpo_overrides(task, tmp_path)))  # null: the bundled server, nothing to try
    with pytest.raises(PreflightError, match="expected http://host:port"):
        check_server_reachable(_compose([*tiny_grpo_overrides(task, tmp_path), "remote_backend.server.url=localhost"]))


# ---------------------------------------------------------------- the entry point, as a user types it

def _run_entry_point(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = entry_point_env(HYDRA_FULL_ERROR="1", NETRC="/nonexistent/netrc")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        env.pop(name, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "verl.remote_backend.main_ppo", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return proc, time.monotonic() - start


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith("[remote_backend] error: ")
    return lines[0]


@pytest.mark.slow  # each case starts a Python process that imports verl: 10-20 s
def test_the_entry_point_fails_in_one_line_for_each_case(task, tmp_path):
    recipe = [o for o in tiny_grpo_overrides(task, tmp_path / "run") if not o.startswith("hydra.")]
    cases = {
        "bare": ["remote_backend=arctic"],
        "lr": [*recipe, "remote_backend=arctic", "actor_rollout_ref.actor.optim.lr=abc"],
        "url": [*recipe, "remote_backend=arctic", f"remote_backend.server.url=http://127.0.0.1:{_free_port()}"],
    }
    lines, walls = {}, {}
    for name, args in cases.items():
        proc, walls[name] = _run_entry_point(args, tmp_path)
        lines[name] = _one_line(proc)
        assert walls[name] < 30, f"{name}: {walls[name]:.0f} s"
    assert all(key.rstrip("=") in lines["bare"] for key in BARE_MISSING), lines["bare"]
    assert "actor_rollout_ref.actor.optim.lr: expected a float, got 'abc'" in lines["lr"]
    assert "remote_backend.server.url: cannot reach http://127.0.0.1:" in lines["url"]
    assert "remote_backend.server.url=null" in lines["url"] and "retry" not in lines["url"]
    print({name: round(wall, 1) for name, wall in walls.items()})


def test_a_logger_that_cannot_start_is_named_with_what_to_set(task, tmp_path, monkeypatch):
    recipe = tiny_grpo_overrides(task, tmp_path)
    (problem,) = missing_settings(_compose([*recipe, "trainer.logger=[console,wandb]"]))
    assert problem.startswith("trainer.logger=[console] (got ['console', 'wandb']: wandb has no login here")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert missing_settings(_compose([*recipe, "trainer.logger=[console,wandb]"])) == []
    assert missing_settings(_compose([*recipe, "trainer.logger=[console,file]"])) == []
