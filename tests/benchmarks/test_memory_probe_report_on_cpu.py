"""``benchmarks/memory_probe_report.py``: the table and the allocation sites it prints from a probe file that the
server's own :class:`~arctic_rl.server.memory_probe.MemoryProbe` wrote (from snapshots in torch's layout)."""

from __future__ import annotations

import pytest

from arctic_rl.server.memory_probe import MemoryProbe
from tests.support.scripts import load_script

GIB = 1 << 30


@pytest.fixture
def report():
    return load_script("benchmarks/memory_probe_report.py")


def _segment(pool, total, live, where):
    frames = [{"filename": f"/x/site-packages/{where}.py", "line": 1, "name": "f"}]
    blocks = [{"size": live, "state": "active_allocated", "frames": frames}]
    if total > live:
        blocks.append({"size": total - live, "state": "inactive", "frames": []})
    return {"total_size": total, "segment_pool_id": pool, "blocks": blocks}


def test_the_report_prints_a_row_per_call_and_the_sites_at_both_extremes(tmp_path, report, capsys):
    path = tmp_path / "probe.jsonl"
    probe = MemoryProbe(path)
    awake = {"segments": [_segment((0, 0), 3 * GIB, 2 * GIB, "deepspeed/opt"), _segment((1, 0), 4 * GIB, 4 * GIB, "vllm/kv")]}
    asleep = {"segments": [_segment((0, 0), 2 * GIB, 2 * GIB, "deepspeed/opt"), _segment((1, 0), 4 * GIB, 4 * GIB, "vllm/kv")]}
    probe.record("POST /v2/generate", awake, in_use=8 * GIB, total=80 * GIB)
    probe.record("POST /sleep-inference", asleep, in_use=3 * GIB, total=80 * GIB)
    with path.open("a") as fh:
        fh.write('{"cut off')  # a server killed mid-line
    assert report.main([str(path), "--sites", "1"]) == 0
    out = capsys.readouterr().out
    assert "| s | call | in use | reserved | pool 0,0 | pool 1,0 | cached free | outside |" in out
    assert "| POST /v2/generate | 8.00 | 7.00 | 3.00 | 4.00 | 1.00 | 1.00 |" in out
    assert "| POST /sleep-inference | 3.00 | 6.00 | 2.00 | 4.00 | 0.00 | -3.00 |" in out  # vLLM's pool unmapped
    assert "### the most in use: 8.00 GiB" in out and "### the least in use: 3.00 GiB" in out
    assert "* 4.00 GiB in 1 blocks: [1,0] vllm/kv.py:1 f" in out
    assert "2.00 GiB at smaller sites" in out


def test_a_side_stream_gets_its_own_cached_free_column(tmp_path, report, capsys):
    path = tmp_path / "probe.jsonl"
    probe = MemoryProbe(path)
    side = {**_segment((0, 0), 6 * GIB, 1 * GIB, "arctic_rl/zorro"), "stream": 93824}  # --training-stream on's
    probe.record("POST /v2/step", {"segments": [_segment((0, 0), 3 * GIB, 2 * GIB, "vllm/sampler"), side]},
                 in_use=10 * GIB, total=80 * GIB)
    assert report.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| reserved | pool 0,0 | cached free | cached free, default stream | cached free, stream 1 | outside |" in out
    assert "| POST /v2/step | 10.00 | 9.00 | 9.00 | 6.00 | 1.00 | 5.00 | 1.00 |" in out


def test_an_empty_file_is_an_error(tmp_path, report, capsys):
    path = tmp_path / "probe.jsonl"
    path.write_text("")
    assert report.main([str(path)]) == 1
    assert "no probe lines" in capsys.readouterr().err
