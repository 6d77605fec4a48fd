"""The garbage collector frozen after a job's setup (:mod:`arctic_rl.server.jobs.gc_freeze`).

What freezing means (objects alive at the freeze are skipped by later collections, new ones are not; a thaw gives
them back), the flag and its variable, and a real :class:`ServerState` (tiny Qwen3, DeepSpeed on CPU): a job's
warm-up freezes (a job without one does not), and a destroyed job's model -- held in a reference cycle -- is
collected, not kept frozen.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.jobs.gc_freeze import freeze_long_lived, thaw
from arctic_rl.server.jobs.service import ServerState
from arctic_rl.server.settings import GC_FREEZE_MODES, ServerSettings
from tests.support.server import check_server_flag


class Node:
    """An object in a reference cycle: only a collection frees it."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    return weakref.ref(Node())


def test_frozen_objects_are_skipped_until_thawed(caplog):
    gc.collect()
    kept = Node()
    held = weakref.ref(kept)
    with caplog.at_level("INFO", logger="arctic_rl.server"):
        assert freeze_long_lived("on", "in the test") > 0
    assert "objects frozen in the test" in caplog.text
    del kept  # garbage now, in a cycle, frozen: a collection skips it
    gc.collect()
    assert held() is not None
    new = _cycle()  # made after the freeze: collected as always
    gc.collect()
    assert new() is None
    assert thaw("on") and gc.get_freeze_count() == 0 and not thaw("on")
    gc.collect()
    assert held() is None


def test_off_leaves_the_collector_alone():
    assert freeze_long_lived("off", "in the test") == 0 and gc.get_freeze_count() == 0
    gc.freeze()
    assert not thaw("off") and gc.get_freeze_count() > 0  # not ours to thaw (the test's conftest does)


def test_the_flag_and_its_variable(monkeypatch):
    assert GC_FREEZE_MODES == ("on", "off") and ServerSettings().gc_freeze == "on"
    with pytest.raises(ValueError, match=r"gc_freeze: expected one of \['on', 'off'\], got 'yes'"):
        ServerSettings(gc_freeze="yes")
    check_server_flag(monkeypatch, "--gc-freeze", "ARCTIC_RL_GC_FREEZE", bad="yes", good=("on", "on"),
                      from_env=("off", "off"), bad_env="maybe")


@pytest.mark.slow
@pytest.mark.parametrize("mode", GC_FREEZE_MODES)
def test_a_job_setup_freezes_and_its_destroy_lets_the_job_go(tiny_model_dir, tmp_path, mode):
    async def run() -> tuple[int, int, bool]:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / mode, gc_freeze=mode, warm_up="on"))
        config = JobConfig(model_name=str(tiny_model_dir), job_type=JobType.TRAINING, checkpoint_path="train",
                           ds_config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        try:
            job_id = (await state.initialize(config))["job_id"]
            await state.setups.idle()
            frozen = gc.get_freeze_count()
            engine = state.jobs.get(job_id).engine
            model = weakref.ref(engine.model)
            engine.model.cycle = engine  # the model in a reference cycle with its engine (as hooks make them)
            del engine
            await state.destroy(job_id, None)
            after = gc.get_freeze_count()
            gc.collect()
            return frozen, after, model() is None
        finally:
            state.shutdown()

    gc.unfreeze()
    frozen, after, gone = asyncio.run(run())
    if mode == "on":
        assert frozen > 0 and after > 0  # frozen after the setup, and what was left after the destroy
    else:
        assert frozen == after == 0
    assert gone  # the destroyed job's model was collected, frozen or not


@pytest.mark.slow
def test_a_job_without_a_warm_up_freezes_nothing(tiny_model_dir, tmp_path):
    async def run() -> int:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / "auto"))  # CPU: no torch.compile, no warm-up
        try:
            job_id = (await state.initialize(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.LOG_PROB)))[
                "job_id"]
            await state.setups.idle()
            frozen = gc.get_freeze_count()
            await state.destroy(job_id, None)
            return frozen + gc.get_freeze_count()
        finally:
            state.shutdown()

    gc.unfreeze()
    assert asyncio.run(run()) == 0
