"""The GPU memory probe (arctic_rl/server/memory_probe.py): its summary of an allocator snapshot, its pacing, its
file and its middleware. The snapshots are built in the layout ``torch.cuda.memory._snapshot()`` documents (a
CUDA device is needed for a real one); the middleware runs in a real FastAPI app."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.testclient import TestClient

from arctic_rl.server.__main__ import parse_args
from arctic_rl.server.memory_probe import (
    PROBE_ENV,
    MemoryProbe,
    MemoryProbeMiddleware,
    allocation_site,
    summarize_snapshot,
)

MIB = 1 << 20


def _frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


TORCH_FRAME = _frame("/x/site-packages/torch/nn/modules/linear.py", 125, "forward")
VLLM_FRAME = _frame("/x/site-packages/vllm/v1/worker/gpu_model_runner.py", 3000, "_allocate_kv_cache")
DS_FRAME = _frame("/x/site-packages/deepspeed/runtime/bf16_optimizer.py", 200, "_setup_for_real_optimizer")
OURS_FRAME = _frame("/repo/arctic_rl/server/engines/training.py", 80, "__init__")


def _block(size: int, state: str = "active_allocated", frames: list | None = None) -> dict:
    return {"size": size, "requested_size": size, "address": 0, "state": state, "frames": frames or []}


def _snapshot() -> dict:
    return {"segments": [
        {"total_size": 40 * MIB, "segment_pool_id": (0, 0), "blocks": [
            _block(20 * MIB, frames=[TORCH_FRAME, DS_FRAME, OURS_FRAME]),
            _block(8 * MIB, frames=[TORCH_FRAME, DS_FRAME, OURS_FRAME]),
            _block(12 * MIB, state="inactive"),
        ]},
        {"total_size": 64 * MIB, "segment_pool_id": (1, 0), "blocks": [
            _block(64 * MIB, frames=[VLLM_FRAME]),
        ]},
        {"total_size": 2 * MIB, "segment_pool_id": (0, 0), "stream": 94000, "blocks": [
            _block(2 * MIB, state="inactive"),
        ]},
    ]}


def test_a_site_is_the_innermost_frame_outside_torch_with_ours_beside_it():
    assert allocation_site([TORCH_FRAME, DS_FRAME, OURS_FRAME]) == (
        "deepspeed/runtime/bf16_optimizer.py:200 _setup_for_real_optimizer <- /repo/arctic_rl/server/engines/training.py:80 __init__"
    )
    assert allocation_site([VLLM_FRAME]) == "vllm/v1/worker/gpu_model_runner.py:3000 _allocate_kv_cache"
    assert allocation_site([OURS_FRAME]) == "/repo/arctic_rl/server/engines/training.py:80 __init__"
    assert allocation_site([TORCH_FRAME]) == "torch/nn/modules/linear.py:125 forward"
    assert allocation_site([]) == "?"


def test_the_summary_splits_pools_sites_and_the_cached_free_bytes():
    summary = summarize_snapshot(_snapshot())
    assert summary["reserved"] == 106 * MIB
    assert summary["allocated"] == 92 * MIB
    assert summary["pools"] == {
        "0,0": {"reserved": 42 * MIB, "allocated": 28 * MIB, "segments": 2},
        "1,0": {"reserved": 64 * MIB, "allocated": 64 * MIB, "segments": 1},
    }
    assert summary["cached_free"] == 14 * MIB  # the default pool's inactive blocks; the vLLM pool's are not empty_cache's
    # per stream: a segment without a stream is the default stream's (0); the other one is a side stream's
    assert summary["streams"] == {"0": {"reserved": 40 * MIB, "cached_free": 12 * MIB},
                                  "94000": {"reserved": 2 * MIB, "cached_free": 2 * MIB}}
    assert [(s["bytes"], s["blocks"]) for s in summary["sites"]] == [(64 * MIB, 1), (28 * MIB, 2)]
    assert summary["sites"][0]["site"].startswith("[1,0] vllm/")
    assert summary["sites_left_out_bytes"] == 0
    assert summarize_snapshot(_snapshot(), top=1)["sites_left_out_bytes"] == 28 * MIB


def test_an_event_is_probed_once_per_interval():
    now = [100.0]
    probe = MemoryProbe(path="unused.jsonl", min_interval_s=2.0, clock=lambda: now[0])
    assert probe.due("POST /v2/generate")
    assert not probe.due("POST /v2/generate")
    assert probe.due("POST /v2/step")  # each path keeps its own clock
    now[0] += 2.5
    assert probe.due("POST /v2/generate")


def test_a_record_is_one_json_line_with_what_the_allocator_does_not_see(tmp_path):
    path = tmp_path / "sub" / "probe.jsonl"
    path.parent.mkdir()
    probe = MemoryProbe(path)
    probe.record("POST /v2/step", _snapshot(), in_use=300 * MIB, total=1000 * MIB)
    probe.record("POST /v2/forward", {"segments": []}, in_use=50 * MIB, total=1000 * MIB)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["POST /v2/step", "POST /v2/forward"]
    assert lines[0]["outside_allocator"] == 300 * MIB - 106 * MIB
    assert lines[0]["device_total"] == 1000 * MIB
    assert lines[1]["reserved"] == 0 and lines[1]["outside_allocator"] == 50 * MIB


def test_on_cpu_the_probe_does_not_start_and_writes_nothing(tmp_path):
    probe = MemoryProbe(tmp_path / "probe.jsonl")
    assert probe.start() is False
    probe.probe("POST /v2/step")
    assert not (tmp_path / "probe.jsonl").exists()


class _Seen(MemoryProbe):
    """The real probe's pacing, with the device part replaced by a list (there is no CUDA device here)."""

    def __init__(self) -> None:
        super().__init__(path="unused.jsonl", min_interval_s=60.0)
        self.events: list[str] = []

    def probe(self, event: str) -> None:
        self.events.append(event)


def test_the_middleware_probes_after_each_answer_by_method_and_path():
    app = FastAPI()

    @app.post("/v2/step")
    def step() -> dict:
        return {"ok": True}

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    seen = _Seen()
    app.add_middleware(MemoryProbeMiddleware, probe=seen)
    with TestClient(app) as client:
        assert client.post("/v2/step").json() == {"ok": True}
        assert client.post("/v2/step").status_code == 200  # within the interval: not probed again
        assert client.get("/health").status_code == 200
        assert client.get("/nowhere").status_code == 404  # an error answer is a call too
    assert seen.events == ["POST /v2/step", "GET /health", "GET /nowhere"]


def test_the_flag_takes_its_default_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(PROBE_ENV, raising=False)
    assert parse_args([]).memory_probe is None
    monkeypatch.setenv(PROBE_ENV, str(tmp_path / "p.jsonl"))
    assert str(parse_args([]).memory_probe) == str(tmp_path / "p.jsonl")
    assert str(parse_args(["--memory-probe", "other.jsonl"]).memory_probe) == "other.jsonl"
