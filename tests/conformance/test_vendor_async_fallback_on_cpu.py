"""The asynchronous mode against the vendor's own Arctic RL v2 server: it falls back to sync, saying why once.

The vendor's ``/health`` answers ``{"status": "OK"}`` and lists no features, so it does not say that its
sampling job answers while its training job computes (``concurrent_jobs``). A run asked to be asynchronous
(``trainer.v1.remote_backend.async_mode=true``) must then run verl's sync semantics and log exactly one line
naming the missing feature -- and still finish its two GRPO steps against the vendor.

Run by hand::

    pytest -m e2e tests/conformance/test_vendor_async_fallback_on_cpu.py -s
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.e2e import (
    entry_point_command,
    entry_point_env,
    parse_console_metrics,
    run_in_own_session,
    tiny_grpo_overrides,
)
from tests.support.scripts import load_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_text"
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    """The reverse-text task, small: the example's untrained model, 8 training and 4 validation prompts."""
    root = tmp_path_factory.mktemp("reverse_text_vendor_async")
    model = load_script(EXAMPLE / "make_model.py").make_model(root / "model", seed=0)
    load_script(EXAMPLE / "make_data.py").write_dataset(root / "data", n_train=8, n_val=4, seed=0)
    return {"model": Path(model), "train": root / "data" / "train.parquet", "val": root / "data" / "val.parquet",
            "reward": EXAMPLE / "reward.py"}


@pytest.mark.timeout(RUN_TIMEOUT_S + 180)
def test_async_mode_falls_back_to_sync_against_the_vendor(vendor_server, task, tmp_path):
    out = tmp_path / "run"
    cmd = entry_point_command([
        *tiny_grpo_overrides(task, out, micro_batch=2),
        "remote_backend=arctic",
        f"remote_backend.server.url={vendor_server.url}",
        f"remote_backend.train.checkpoint_path={out / 'vendor_checkpoints'}",
        "trainer.v1.remote_backend.async_mode=true",
    ])
    print("running:", " ".join(cmd), flush=True)
    start = time.monotonic()
    returncode, output = run_in_own_session(cmd, cwd=tmp_path, env=entry_point_env(), timeout=RUN_TIMEOUT_S)
    (tmp_path / "run.log").write_text(output)
    print(f"wall time {time.monotonic() - start:.0f} s, log {tmp_path / 'run.log'}", flush=True)
    assert returncode == 0, f"{output[-6000:]}\n--- vendor log:\n{vendor_server.log_tail()}"

    lines = [line for line in output.splitlines() if "falling back to verl's sync mode" in line]
    assert len(lines) == 1, lines
    assert "trainer.v1.remote_backend.async_mode=true" in lines[0]
    assert "does not list the 'concurrent_jobs' feature" in lines[0]
    assert "asynchronous remote mode on" not in output
    steps = parse_console_metrics(output)
    assert sorted(steps) == [1, 2], f"steps logged: {sorted(steps)}"
    for step, metrics in steps.items():
        assert metrics["training/off_policy/async_mode"] == 0.0
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] == 0, step  # sync: on-policy
        assert metrics["training/global_step"] == step
