"""A short run of ``benchmarks/load.py``: 32 generation clients + a training loop for 15 s.

Against the real reference server (CPU, one torch thread, 127.0.0.1): every call succeeds, the
training loop keeps stepping, ``GET /health`` stays responsive under the load (p99 bounded), and the
server's resident memory stays bounded (no growth from the first third of the run to its end beyond
a margin). The 60 s version with a table is ``python benchmarks/load.py``.
"""

from __future__ import annotations

import pytest

from tests.support.scripts import load_script
from tests.support.server import running_server

pytestmark = pytest.mark.slow

SECONDS = 15.0
CLIENTS = 32


def _load_module():
    return load_script("benchmarks/load.py")


def test_32_generate_clients_and_training_for_15_s(tmp_path, tiny_model_dir):
    load = _load_module()
    with running_server(tmp_path / "server") as srv:
        result = load.run_load(tiny_model_dir, srv.url, srv.proc.pid, clients=CLIENTS, seconds=SECONDS)
    print(load.table(result))
    lat = result["latencies"]
    assert result["errors"] == []
    assert len(lat["generate"]) >= CLIENTS  # every client got answers
    assert len(lat["update_actor"]) >= 1 and result["optimizer_steps"] >= 2
    health = lat["health"]
    assert len(health) >= SECONDS / 0.2 / 4  # the prober was not starved
    assert load.percentile(health, 0.99) < 2.0, sorted(health)[-5:]
    mem = [m for _, m in result["rss"]]
    third = mem[len(mem) // 3]
    assert max(mem) < mem[0] + 1024  # MiB: bounded by the tiny_model_dir, batches and threads
    assert mem[-1] < third + 256, mem  # no steady growth once warm
    assert load.percentile([1.0, 2.0, 3.0], 0.5) == 2.0 and load.percentile([], 0.5) != load.percentile([], 0.5)
