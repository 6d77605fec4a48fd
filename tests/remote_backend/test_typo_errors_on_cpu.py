"""A typo in the backend's name or in a ``remote_backend.*`` key fails before Hydra composes, in one line.

The checks themselves (``verl.remote_backend.command_line``) on the real option groups, then the three
routes a user types them on -- ``remote_backend=``, ``+remote_backend=`` through our entry point, and
stock ``verl.trainer.main_ppo`` with the plugin hook -- as real processes: each must end in seconds with
exit status 2 and one ``[remote_backend] error:`` line naming what was given, what exists and the
closest match, and nothing of Hydra's override errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.remote_backend.command_line import (
    check_backend_keys,
    check_backend_name,
    check_command_line,
    is_stock_main_ppo,
    option_group_file,
    stock_main_ppo_overrides,
)
from verl.remote_backend.errors import RemoteBackendConfigError

REPO = Path(__file__).resolve().parents[2]
REGISTERED = ["arctic", "tinker"]


def _group(name: str):
    path = option_group_file(name)
    assert path is not None and path.parent.name == "remote_backend", path
    return OmegaConf.load(path)


# ------------------------------------------------------------------ the checks


@pytest.mark.parametrize("token", ["remote_backend=arctc", "+remote_backend=arctc", "++remote_backend=arctc"])
def test_unknown_backend_names_the_input_the_registered_ones_and_the_closest(token):
    with pytest.raises(RemoteBackendConfigError) as info:
        check_backend_name(["data.train_batch_size=4", token], REGISTERED)
    message = str(info.value)
    assert "\n" not in message
    assert "'arctc'" in message and "allowed: arctic, tinker" in message
    assert "did you mean 'arctic'?" in message
    assert info.value.field == "remote_backend" and info.value.received == "arctc"


def test_a_name_far_from_every_backend_gets_no_guess_and_the_last_choice_wins():
    with pytest.raises(RemoteBackendConfigError) as info:
        check_backend_name(["remote_backend=zzzzzz"], REGISTERED)
    assert "did you mean" not in str(info.value) and "allowed: arctic, tinker" in str(info.value)
    assert check_backend_name(["remote_backend=arctc", "remote_backend=tinker"], REGISTERED) == "tinker"
    assert check_backend_name(["trainer.nnodes=1"], REGISTERED) is None
    assert check_backend_name(["~remote_backend=arctc"], REGISTERED) is None  # a deletion selects nothing


def test_registered_names_come_from_the_registry():
    assert check_command_line(["remote_backend=arctic"]) == "arctic"
    assert check_command_line(["remote_backend=tinker", "remote_backend.server.url=http://h:1"]) == "tinker"
    with pytest.raises(RemoteBackendConfigError, match="allowed: arctic, tinker"):
        check_command_line(["remote_backend=tinkr"])


@pytest.mark.parametrize(
    ("key", "unknown", "nearest", "siblings"),
    [
        ("remote_backend.server.urll", "urll", "remote_backend.server.url", "url, token, protocol"),
        ("remote_backend.sever.url", "sever", "remote_backend.server.url", "name, server, timeouts"),
        ("remote_backend.train.zorro_train.enabel", "enabel", "remote_backend.train.zorro_train.enable", "enable"),
    ],
)
def test_unknown_key_names_the_key_the_nearest_valid_keys_and_its_siblings(key, unknown, nearest, siblings):
    with pytest.raises(RemoteBackendConfigError) as info:
        check_backend_keys(["remote_backend.server.url=null", f"{key}=1"], _group("arctic"))
    message = str(info.value)
    assert message.startswith(f"{key}: unknown key {unknown!r}")
    assert f"did you mean {nearest}" in message
    assert f"allowed: {siblings}" in message and f"received: {unknown!r}" in message
    assert "\n" not in message


def test_valid_added_and_free_form_keys_pass():
    group = _group("arctic")
    check_backend_keys([
        "remote_backend.server.url='http://h:7000'",
        "remote_backend.train.zorro_train.enable=true",
        "+remote_backend.server.extra_key=1",  # added on purpose: the backend's own config judges it
        "remote_backend.train.deepspeed.extra.zero_optimization.stage=3",  # a free-form mapping ({})
        "trainer.not_ours=1",
    ], group)
    with pytest.raises(RemoteBackendConfigError, match="did you mean remote_backend.server.url"):
        check_backend_keys(["remote_backend.server.ulr=x"], _group("tinker"))


@pytest.mark.parametrize(
    ("orig_argv", "stock", "overrides"),
    [
        (["python", "-m", "verl.trainer.main_ppo", "+remote_backend=x"], True, ["+remote_backend=x"]),
        (["python", "-u", "/venv/lib/verl/trainer/main_ppo.py", "a=1"], True, ["a=1"]),
        (["python", "-m", "verl.remote_backend.main_ppo", "remote_backend=x"], False, ["remote_backend=x"]),
        (["python", "/venv/ray/_private/workers/default_worker.py", "--x"], False, ["--x"]),
        (["python", "-m", "pytest", "tests"], False, ["tests"]),
    ],
)
def test_stock_main_ppo_is_recognised_from_the_interpreter_command_line(orig_argv, stock, overrides):
    assert is_stock_main_ppo(orig_argv) is stock
    assert stock_main_ppo_overrides(orig_argv) == overrides


# ------------------------------------------------------------------ the three routes, as processes


def _run(args: list[str], **env_extra: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env.update(OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", **env_extra)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    return proc, time.monotonic() - start


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[remote_backend] error:")]
    assert len(errors) == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Could not override" not in proc.stderr, proc.stderr
    assert "replaced by" not in proc.stderr  # stopped before the overrides were rewritten
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["-m", "verl.remote_backend.main_ppo", "trainer.nnodes=1", "remote_backend=arctc"], {}),
        (["-m", "verl.remote_backend.main_ppo", "+remote_backend=arctc", "trainer.nnodes=1"], {}),
        (["-m", "verl.trainer.main_ppo", "+remote_backend=arctc", "trainer.v1.trainer_mode=remote_backend",
          "actor_rollout_ref.rollout.name=arctc"], {"VERL_USE_EXTERNAL_MODULES": "verl.remote_backend.register"}),
    ],
    ids=["entry_point", "entry_point_plus", "stock_main_ppo_plugin"],
)
def test_a_misspelt_backend_fails_in_seconds_on_every_route(args, env):
    proc, elapsed_s = _run(args, **env)
    line = _one_error_line(proc)
    assert "unknown remote backend 'arctc' (did you mean 'arctic'?)" in line
    assert "allowed: arctic, tinker" in line and "received: 'arctc'" in line
    assert elapsed_s < 120  # the imports only: no Hydra composition, no Ray


@pytest.mark.slow
def test_a_misspelt_key_fails_in_seconds_naming_the_nearest_key():
    proc, _ = _run(["-m", "verl.remote_backend.main_ppo", "remote_backend=arctic", "remote_backend.server.urll=x"])
    line = _one_error_line(proc)
    assert "remote_backend.server.urll: unknown key 'urll'" in line
    assert "did you mean remote_backend.server.url" in line
