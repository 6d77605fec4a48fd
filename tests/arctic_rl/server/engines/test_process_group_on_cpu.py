"""The server's world-size-1 process group binds no device, so that NCCL makes communicators lazily.

With ``device_id`` PyTorch makes the default group's NCCL communicator at once, and one for every group split
from it: vLLM's engine creates six groups in the server's process, and each eager communicator held ~0.45 GiB
of GPU memory outside PyTorch's allocator (benchmarks/RESULTS.md §2q). On CUDA the group names gloo for CPU beside
nccl, so that a barrier (DeepSpeed's checkpoint save and load begin with one) runs on gloo rather than making an
NCCL communicator (§2t, §2u; the save's one other collective is turned off in its DeepSpeed config, checked in
tests/arctic_rl/server/test_memory_on_cpu.py). A CUDA device cannot be had here, so ``torch.distributed``'s entry
points record the call instead of making the group; the barrier's routing is checked on a real gloo group."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from arctic_rl.server.engines.common import ensure_process_group, process_group_backend


@pytest.fixture
def recorded(monkeypatch):
    calls: list[tuple[tuple, dict]] = []
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "0")  # put back after the test: ensure_process_group sets them
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(dist, "get_backend", lambda *a: calls[-1][0][0])
    return calls


@pytest.mark.parametrize("device, backend", [(torch.device("cuda", 0), "cpu:gloo,cuda:nccl"), (torch.device("cpu"), "gloo")])
def test_the_group_is_made_once_without_a_bound_device(recorded, device, backend):
    ensure_process_group(device)
    ensure_process_group(device)  # a second job of the process: the group is there
    assert len(recorded) == 1
    args, kwargs = recorded[0]
    assert args == (backend,) and process_group_backend(device) == backend
    assert "device_id" not in kwargs  # bound, NCCL would make every group's communicator eagerly
    assert kwargs["rank"] == 0 and kwargs["world_size"] == 1
    assert isinstance(kwargs["store"], dist.HashStore)  # in-process rendezvous, no port


def test_a_barrier_on_a_group_that_names_gloo_for_cpu_runs_on_the_cpu():
    """PyTorch picks a barrier's device from the group's backends: with ``cpu:gloo`` among them, the CPU (no
    CUDA tensor, so no NCCL communicator). A CPU build has no NCCL to name beside it; the rule is the same."""
    code = (
        "import torch.distributed as dist\n"
        "from torch.distributed.distributed_c10d import _get_object_coll_device\n"
        "dist.init_process_group('cpu:gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "dist.barrier()\n"
        "print(_get_object_coll_device(dist.group.WORLD))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "cpu"
