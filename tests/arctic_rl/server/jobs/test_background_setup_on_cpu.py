"""A job's warm-up after ``/initialize`` has answered (:mod:`arctic_rl.server.jobs.background_setup`).

Real jobs in a real :class:`ServerState` (tiny Qwen3, the ``transformers`` sampler, DeepSpeed on CPU, the real
warm-up): only the warm-up's start is held on an event, so that the test decides when it may run. While it is
held, ``/initialize`` has answered, the job says ``warming_up``, and the calls that must wait -- the job's own
``/forward-backward``, another job's ``/forward``, the sampler's ``/generate`` and a ``/weight-sync`` -- wait; once
it ends they run, and their answers are those of a server whose warm-up had ended before they were sent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from arctic_rl.protocol import JobConfig, JobType, WeightSyncRequest
from arctic_rl.server.engines import warmup
from arctic_rl.server.jobs.background_setup import BackgroundSetups
from arctic_rl.server.jobs.service import ServerState
from arctic_rl.server.settings import ServerSettings

TRAIN_DS = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0}
SHAPE = (2, 3, 7, 5)  # prompts, rows per prompt, prompt and response length of the test's calls
VOCAB = 99  # the tiny model's character vocabulary


REAL_WARM_UP = warmup.warm_up


def training_config(model_dir) -> JobConfig:
    return JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING, checkpoint_path="train", seed=5,
                     ds_config=TRAIN_DS)


class HeldWarmUp:
    """The real warm-up; a training job's starts only once :meth:`release` is called, and records when it began
    and ended (other jobs' run at once)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.began: float | None = None
        self.ended: float | None = None

    def __call__(self, engine: Any, settings: ServerSettings, *args: Any) -> float | None:
        if engine.job_type != JobType.TRAINING:
            return REAL_WARM_UP(engine, settings, *args)
        self.began = time.monotonic()
        assert self.gate.wait(120), "the test never released the warm-up"
        try:
            return REAL_WARM_UP(engine, settings, *args)
        finally:
            self.ended = time.monotonic()

    def release(self) -> None:
        self.gate.set()


def gradients(engine: Any) -> list[torch.Tensor]:
    """The training job's parameter gradients after a ``/forward-backward`` (ZeRO-0: on the parameters)."""
    return [p.grad.detach().clone() for p in engine.model.parameters() if p.grad is not None]


async def settle(seconds: float = 0.3) -> None:
    """Give the event loop and the worker threads time to run whatever is not held."""
    await asyncio.sleep(seconds)


def test_initialize_answers_before_the_warm_up_and_the_calls_that_must_wait_wait(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    held = HeldWarmUp()
    monkeypatch.setattr(warmup, "warm_up", held)  # what ServerState.initialize imports when it runs
    train_body = warmup.synthetic_body(VOCAB, SHAPE, train=True, zorro=False, seed=3)
    forward_body = warmup.synthetic_body(VOCAB, SHAPE, train=False, zorro=False, seed=4)
    generate_body = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 3, "ignore_eos": True, "seed": 1}}

    async def scenario(state: ServerState) -> dict[str, Any]:
        sampler = (await state.initialize(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.SAMPLING)))
        log_prob = (await state.initialize(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.LOG_PROB)))
        answer = await asyncio.wait_for(state.initialize(training_config(tiny_model_dir)), 120)
        train_id, sampler_id, log_prob_id = answer["job_id"], sampler["job_id"], log_prob["job_id"]
        await settle()
        info = state.job_info(train_id)
        assert answer["running"] and info["running"] and info["warming_up"] and info["warm_up_s"] is None
        assert held.began is not None and held.ended is None and state.setups.running() == [train_id]
        assert not state.jobs.get(sampler_id, JobType.SAMPLING).engine.awake  # asleep for the warm-up
        calls = {
            "forward_backward": asyncio.create_task(state.forward_backward(train_id, train_body)),
            "forward": asyncio.create_task(state.forward(log_prob_id, forward_body)),
            "generate": asyncio.create_task(state.generate(sampler_id, generate_body)),
            "weight_sync": asyncio.create_task(state.weight_sync(None, WeightSyncRequest(
                source_sub_job_id=train_id, target_sub_job_ids=[sampler_id, log_prob_id]))),
        }
        await settle(1.0)
        waiting = sorted(name for name, task in calls.items() if not task.done())
        held.release()
        answers = {name: await asyncio.wait_for(task, 120) for name, task in calls.items()}
        info = state.job_info(train_id)
        return {"waiting": waiting, "answers": answers, "info": info, "ended": held.ended,
                "grads": gradients(state.jobs.get(train_id, JobType.TRAINING).engine),
                "sampler_awake": state.jobs.get(sampler_id, JobType.SAMPLING).engine.awake}

    state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck", warm_up="on"))
    try:
        out = asyncio.run(scenario(state))
    finally:
        state.shutdown()
    assert out["waiting"] == ["forward", "forward_backward", "generate", "weight_sync"]
    assert out["info"]["warming_up"] is False and out["info"]["warm_up_s"] > 0 and out["sampler_awake"]
    assert out["answers"]["generate"]["results"][0]["generation_len"] == 3

    # the same /forward-backward sent to a server once its warm-up had ended: the same loss and gradients
    monkeypatch.setattr(warmup, "warm_up", REAL_WARM_UP)

    async def reference(state: ServerState) -> dict[str, Any]:
        job = await state.initialize(training_config(tiny_model_dir))
        await state.setups.idle()
        out = await state.forward_backward(job["job_id"], train_body)
        return {"answer": out, "grads": gradients(state.jobs.get(job["job_id"], JobType.TRAINING).engine)}

    state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck2", warm_up="on"))
    try:
        expected = asyncio.run(reference(state))
    finally:
        state.shutdown()
    assert out["answers"]["forward_backward"]["metrics"]["loss"] == expected["answer"]["metrics"]["loss"]
    assert len(out["grads"]) == len(expected["grads"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(out["grads"], expected["grads"]))


def test_a_destroy_sent_during_the_warm_up_runs_after_it(tiny_model_dir, tmp_path, monkeypatch):
    held = HeldWarmUp()
    monkeypatch.setattr(warmup, "warm_up", held)

    async def scenario(state: ServerState) -> tuple[bool, float | None, list]:
        job_id = (await state.initialize(training_config(tiny_model_dir)))["job_id"]
        destroying = asyncio.create_task(state.destroy(job_id, None))
        await settle()
        waited = not destroying.done()
        held.release()
        await asyncio.wait_for(destroying, 120)
        return waited, held.ended, state.jobs.all()

    state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck", warm_up="on"))
    try:
        waited, ended, jobs = asyncio.run(scenario(state))
    finally:
        state.shutdown()
    assert waited and ended is not None and jobs == []


def test_a_job_without_a_warm_up_is_set_up_inside_initialize(tiny_model_dir, tmp_path):
    """``--warm-up auto`` on the CPU (no torch.compile): nothing runs after ``/initialize`` has answered."""
    async def scenario(state: ServerState) -> tuple[dict, list[int]]:
        job_id = (await state.initialize(training_config(tiny_model_dir)))["job_id"]
        return state.job_info(job_id), state.setups.running()

    state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck"))
    try:
        info, running = asyncio.run(scenario(state))
    finally:
        state.shutdown()
    assert info["warming_up"] is False and info["warm_up_s"] is None and running == []


def test_the_setups_hand_a_build_error_to_the_caller_and_log_a_later_one(caplog):
    async def scenario() -> tuple[str, list[int], bool]:
        setups = BackgroundSetups()

        async def fails_building(built) -> None:
            raise ValueError("model_name: no such model")

        with pytest.raises(ValueError, match="no such model"):
            await setups.run(1, fails_building)
        release = asyncio.Event()

        async def fails_warming(built) -> None:
            built()
            await release.wait()
            raise RuntimeError("a warm-up bug")

        await setups.run(2, fails_warming)  # returns once built
        running = setups.running()
        gate = asyncio.create_task(setups.idle())
        await asyncio.sleep(0.01)
        closed = not gate.done()
        release.set()
        await asyncio.wait_for(gate, 5)
        return caplog.text, running, closed

    with caplog.at_level("ERROR", logger="arctic_rl.server"):
        text, running, closed = asyncio.run(scenario())
    assert running == [2] and closed
    assert "job 2: warm-up ended with an error; the job runs on" in text and "a warm-up bug" in text


def test_cancelling_the_setups_ends_them(caplog):
    async def scenario() -> list[int]:
        setups = BackgroundSetups()

        async def forever(built) -> None:
            built()
            await asyncio.Event().wait()

        await setups.run(3, forever)
        await setups.cancel()
        await asyncio.wait_for(setups.idle(), 5)
        return setups.running()

    with caplog.at_level("INFO", logger="arctic_rl.server"):
        assert asyncio.run(scenario()) == []
    assert "job 3: warm-up cancelled" in caplog.text


def test_a_caller_that_goes_away_before_the_job_is_built_ends_its_setup():
    async def scenario() -> tuple[bool, list[int]]:
        setups = BackgroundSetups()
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def slow_build(built) -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        caller = asyncio.create_task(setups.run(4, slow_build))
        await started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait_for(setups.idle(), 5)
        return cancelled.is_set(), setups.running()

    assert asyncio.run(scenario()) == (True, [])


def test_two_setups_that_wait_together_run_one_after_the_other():
    """Two ``/initialize`` calls that waited for the same setup: once it ends, one starts and the other waits again."""
    async def scenario() -> list[str]:
        setups = BackgroundSetups()
        events: list[str] = []
        first_done = asyncio.Event()

        async def setup_of(name: str, hold: asyncio.Event | None):
            async def setup(built) -> None:
                events.append(f"{name} starts")
                built()
                if hold is not None:
                    await hold.wait()
                await asyncio.sleep(0.01)
                events.append(f"{name} ends")
            return setup

        async def initialize(name: str, job_id: int) -> None:
            await setups.idle()
            await setups.run(job_id, await setup_of(name, None))

        await setups.run(1, await setup_of("first", first_done))
        waiting = [asyncio.create_task(initialize(name, i)) for i, name in ((2, "second"), (3, "third"))]
        await asyncio.sleep(0.01)
        first_done.set()
        await asyncio.gather(*waiting)
        await setups.idle()
        return events

    events = asyncio.run(scenario())
    assert events[:2] == ["first starts", "first ends"]
    assert sorted(events[2:]) == sorted(["second starts", "second ends", "third starts", "third ends"])
    assert events[2].split()[0] == events[3].split()[0]  # the second setup started only after the other ended
