"""The sampler sleeps while a training or log-prob job is built (:mod:`arctic_rl.server.jobs.setup_hold`).

Real jobs in a real :class:`ServerState` (tiny Qwen3, the ``transformers`` sampler, DeepSpeed on CPU): the
sampler's own ``sleep`` / ``wake_up`` / ``submit_generate`` are wrapped only to record the order in which they run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.jobs.service import ServerState
from arctic_rl.server.settings import ServerSettings

TRAIN_DS = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0}


def record(engine: Any, events: list[tuple[str, float]]) -> None:
    """Log each call of the sampler's sleep, wake and generate submission, then run the engine's own."""
    for name in ("sleep", "wake_up", "submit_generate"):
        real = getattr(engine, name)

        def spy(*args, _real=real, _name=name):
            events.append((_name, time.monotonic()))
            return _real(*args)

        setattr(engine, name, spy)


async def sampling_job(state: ServerState, model_dir) -> Any:
    job_id = (await state.initialize(JobConfig(model_name=str(model_dir), job_type=JobType.SAMPLING)))["job_id"]
    return state.jobs.get(job_id, JobType.SAMPLING)


async def until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_the_sampler_sleeps_while_a_job_is_built_and_a_generate_sent_then_waits(tiny_model_dir, tmp_path, caplog):
    async def scenario() -> tuple[list[tuple[str, float]], dict, bool]:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck", warm_up="on"))
        try:
            sampler = await sampling_job(state, tiny_model_dir)
            events: list[tuple[str, float]] = []
            record(sampler.engine, events)
            building = asyncio.create_task(state.initialize(JobConfig(
                model_name=str(tiny_model_dir), job_type=JobType.TRAINING, checkpoint_path="train",
                ds_config=TRAIN_DS)))
            await until(lambda: not sampler.engine.awake or building.done())
            assert not building.done(), "the training job was built before the sampler slept"
            asleep_while_building = not sampler.engine.awake
            body = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 3, "ignore_eos": True, "seed": 1}}
            answer = await state.generate(sampler.job_id, body)  # sent while the sampler sleeps: waits, then runs
            await building
            assert sampler.engine.awake and sampler.admitting.is_set() and not sampler.lock.locked()
            return events, answer, asleep_while_building
        finally:
            state.shutdown()

    with caplog.at_level("INFO", logger="arctic_rl.server"):
        events, answer, asleep = asyncio.run(scenario())
    assert asleep
    assert [name for name, _ in events] == ["sleep", "wake_up", "submit_generate"]  # no call reached it asleep
    assert len(answer["results"]) == 1 and answer["results"][0]["generation_len"] == 3
    assert answer["weight_version"] == 0
    assert "asleep while a training job is built" in caplog.text and "awake again" in caplog.text


def test_a_sampler_the_client_put_to_sleep_stays_asleep(tiny_model_dir, tmp_path):
    async def scenario() -> tuple[list[str], bool]:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck"))
        try:
            sampler = await sampling_job(state, tiny_model_dir)
            await state.run_on_job(sampler, sampler.engine.sleep, 1)  # what /sleep-inference does
            events: list[tuple[str, float]] = []
            record(sampler.engine, events)
            await state.initialize(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.LOG_PROB))
            return [name for name, _ in events], sampler.engine.awake
        finally:
            state.shutdown()

    names, awake = asyncio.run(scenario())
    assert names == [] and not awake


def test_a_failed_build_wakes_the_sampler_and_lets_its_calls_in(tiny_model_dir, tmp_path):
    async def scenario() -> tuple[list[str], Any]:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck"))
        try:
            sampler = await sampling_job(state, tiny_model_dir)
            events: list[tuple[str, float]] = []
            record(sampler.engine, events)
            with pytest.raises(Exception):  # noqa: B017 - whatever loading a missing model raises
                await state.initialize(JobConfig(model_name=str(tmp_path / "no-such-model"),
                                                 job_type=JobType.LOG_PROB))
            assert sampler.engine.awake and sampler.admitting.is_set() and not sampler.lock.locked()
            assert [j.job_type for j in state.jobs.all()] == [JobType.SAMPLING]  # the failed job is gone
            body = {"prompts": [[5, 6]], "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
            answer = await state.generate(sampler.job_id, body)
            return [name for name, _ in events], answer
        finally:
            state.shutdown()

    names, answer = asyncio.run(scenario())
    assert names == ["sleep", "wake_up", "submit_generate"]
    assert answer["results"][0]["generation_len"] == 2


def test_building_a_sampling_job_puts_no_sampler_to_sleep(tiny_model_dir, tmp_path):
    """Only training and log-prob jobs hold the samplers; a second sampling job is refused (one per type) and
    the first never slept for it."""
    from arctic_rl.server.errors import Conflict

    async def scenario() -> list[str]:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck"))
        try:
            sampler = await sampling_job(state, tiny_model_dir)
            events: list[tuple[str, float]] = []
            record(sampler.engine, events)
            with pytest.raises(Conflict):
                await state.initialize(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.SAMPLING))
            return [name for name, _ in events]
        finally:
            state.shutdown()

    assert asyncio.run(scenario()) == []
