"""Logical CPUs on a running Ray cluster: a run refuses too few at once, naming ``ray start --num-cpus``.

A submitted job cannot size the cluster it joins (``ray.init`` refuses ``num_cpus`` there), so the
error must name the option of ``ray start`` that does -- never ``ray_kwargs.ray_init.num_cpus``.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.settings import (
    RAY_START_OPTION,
    check_cluster_cpus,
    joins_running_cluster,
    required_ray_cpus,
)


def _config(units: int = 1, address: str | None = None):
    return OmegaConf.create({"trainer": {"use_v1": True}, "ray_kwargs": {"ray_init": {"address": address}},
                             "transfer_queue": {"backend": {"SimpleStorage": {"num_data_storage_units": units}}}})


def test_a_two_cpu_head_is_refused_naming_the_ray_start_option():
    cfg = _config()
    needed = required_ray_cpus(cfg)
    assert needed == 5  # forwarder 1 + headroom 2 + TransferQueue controller 1 + one storage unit
    with pytest.raises(RemoteBackendConfigError) as info:
        check_cluster_cpus(cfg, total=2.0, free=2.0)
    message = str(info.value)
    assert info.value.field == RAY_START_OPTION == "ray start --num-cpus"
    assert f"`ray start --head --num-cpus={needed}`" in message and "2 of 2 logical CPUs free" in message
    assert "ray_kwargs" not in message


def test_a_busy_cluster_is_refused_with_the_other_remedy_and_enough_passes():
    cfg = _config(units=3)
    with pytest.raises(RemoteBackendConfigError, match="wait for the cluster's other jobs") as info:
        check_cluster_cpus(cfg, total=64.0, free=4.0)
    assert "--num-cpus=" not in str(info.value) and info.value.received == 4.0
    check_cluster_cpus(cfg, total=64.0, free=float(required_ray_cpus(cfg)))


def test_joining_a_cluster_is_read_from_the_address_or_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not joins_running_cluster(_config())
    assert joins_running_cluster(_config(address="ray://head:10001"))
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # what Ray sets in a submitted job's driver
    assert joins_running_cluster(_config())
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert not joins_running_cluster(_config())
