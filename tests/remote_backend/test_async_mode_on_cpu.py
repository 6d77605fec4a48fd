"""The switch of the asynchronous remote trainer mode and what it refuses (verl/remote_backend/async_trainer.py).

* ``trainer.v1.remote_backend.async_mode`` takes a boolean only, named in the error;
* a backend class that cannot say whether its sampler answers while it trains is refused before anything is
  created, with an error naming the key; Tinker's adapter says it can;
* the config the entry point composes carries the switch off and the one-step staleness bound.

The runs of the mode itself: tests/special_e2e/test_grpo_async.py (our server, async),
tests/special_e2e/test_grpo_async_tinker.py (Tinker, async) and
tests/conformance/test_vendor_async_on_cpu.py (the vendor's server: async with fenced weight syncs, and the
fall-back to sync).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.remote_backend.async_trainer import ASYNC_KEY, async_requested, lag_metrics
from verl.remote_backend.errors import RemoteBackendConfigError


def test_the_switch_takes_a_boolean_only():
    assert async_requested(OmegaConf.create({})) is False
    assert async_requested(OmegaConf.create({"trainer": {"v1": {"remote_backend": {"async_mode": True}}}})) is True
    with pytest.raises(RemoteBackendConfigError) as err:
        async_requested(OmegaConf.create({"trainer": {"v1": {"remote_backend": {"async_mode": "yes"}}}}))
    assert err.value.field == ASYNC_KEY and "yes" in str(err.value)


def test_the_legacy_trainer_route_is_refused():
    from verl.remote_backend.async_trainer import check_async_declared

    config = OmegaConf.create({"trainer": {"use_v1": False, "v1": {"remote_backend": {"async_mode": True}}}})
    with pytest.raises(RemoteBackendConfigError) as err:
        check_async_declared(config, "arctic")
    assert err.value.field == ASYNC_KEY and "trainer.use_v1" in str(err.value)
    config.trainer.v1.remote_backend.async_mode = False
    check_async_declared(config, "arctic")  # off: nothing to check


def test_the_dropped_share_counts_verls_evicted_samples():
    assert lag_metrics({"training/off_policy/evicted_samples": 4}, trained_samples=12) == {
        "training/off_policy/dropped_share": 0.25}
    assert lag_metrics({}, trained_samples=8) == {"training/off_policy/dropped_share": 0.0}


def test_a_backend_that_cannot_say_is_refused_naming_the_key():
    from verl.remote_backend.async_trainer import check_async_declared
    from verl.remote_backend.base import RemoteBackend
    from verl.workers.remote_client.tinker.client import TinkerClient

    config = OmegaConf.create({"trainer": {"v1": {"remote_backend": {"async_mode": True}}}})
    with pytest.raises(RemoteBackendConfigError) as err:
        check_async_declared(config, "acme", RemoteBackend)  # the bare ABC declares nothing
    assert err.value.field == ASYNC_KEY and "'acme'" in str(err.value) and "does not say whether" in str(err.value)
    check_async_declared(config, "tinker")  # declares concurrent_jobs(): accepted
    assert TinkerClient.concurrent_jobs(None)[0] is True


def test_the_entry_points_config_carries_the_switch_off():
    from hydra import compose, initialize_config_dir

    from verl.remote_backend.main_ppo import register_searchpath_plugin

    register_searchpath_plugin()
    config_dir = str(Path(sys.modules["verl.remote_backend"].__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="remote_backend_ppo_trainer", overrides=["remote_backend=arctic"])
    assert config.trainer.v1.remote_backend.async_mode is False
    assert config.trainer.v1.remote_backend.num_warmup_batches == 1
    assert config.trainer.v1.sampler.max_off_policy_threshold == 2  # one step of lag
    assert config.trainer.v1.sampler.max_off_policy_strategy == "drop"


@pytest.mark.slow
@pytest.mark.parametrize("value", ["true", "false", "yes"])
def test_the_example_scripts_take_ASYNC(tmp_path, value):
    import os
    import subprocess

    import yaml

    script = Path(__file__).resolve().parents[2] / "examples" / "grpo" / "run_reverse_text_grpo_arl_local.sh"
    env = {k: v for k, v in os.environ.items() if k not in {"ZORRO", "OUT_DIR", "RUN_NAME", "RUN_DIR", "ARCTIC_RL_URL"}}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHON=sys.executable,
               OUT_DIR=str(tmp_path / "rt"), ASYNC=value)
    proc = subprocess.run(["bash", str(script), "--cfg", "job"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    if value == "yes":
        assert proc.returncode != 0 and "ASYNC: expected true or false, got 'yes'" in proc.stderr
        return
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert yaml.safe_load(proc.stdout)["trainer"]["v1"]["remote_backend"]["async_mode"] is (value == "true")
