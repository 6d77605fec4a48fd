"""A pass waits for a sampler that is falling asleep (:mod:`arctic_rl.server.jobs.sleep_gate`).

The gate on its own, then real jobs in a real :class:`ServerState` (tiny Qwen3, the ``transformers`` sampler, a
log-prob job): a ``/sleep-inference`` (the control service's) that takes a while -- the sampler's own ``sleep`` is
wrapped to wait for the test's signal -- and a ``/forward`` sent meanwhile, which runs its pass only once the sleep
is over; with no sleep running a ``/forward`` does not wait."""

from __future__ import annotations

import asyncio
import threading
import time

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.http.control import ControlService
from arctic_rl.server.jobs.service import ServerState
from arctic_rl.server.jobs.sleep_gate import SleepGate
from arctic_rl.server.settings import ServerSettings
from tests.support.server import make_batch


def test_the_gate_opens_when_the_last_sleep_ends():
    gate = SleepGate()
    assert gate.wait_settled() < 0.05 and gate.running == 0
    started, ended = threading.Event(), threading.Event()

    def sleep_twice():
        with gate.sleeping(), gate.sleeping():
            started.set()
            time.sleep(0.2)
        ended.set()

    worker = threading.Thread(target=sleep_twice)
    worker.start()
    assert started.wait(30) and gate.running == 2
    waited = gate.wait_settled()
    assert ended.is_set() and 0.1 <= waited < 5 and gate.running == 0
    worker.join()
    with gate.sleeping():
        assert 0.05 <= gate.wait_settled(timeout=0.05) < 1  # the bound: a pass runs anyway after it
    try:
        with gate.sleeping():
            raise RuntimeError("a failed sleep")
    except RuntimeError:
        pass
    assert gate.running == 0  # a failed sleep leaves the gate open


def _forward_body() -> dict:
    return {"batch": make_batch([[5, 6, 7], [8, 9]], [[20, 21], [22]]), "meta": {}}


def test_a_forward_sent_during_a_sleep_runs_its_pass_after_it(tiny_model_dir, tmp_path, caplog):
    async def scenario() -> tuple[list[str], bool]:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / "ck"))
        control = ControlService(state)
        try:
            sampling = (await state.initialize(JobConfig(model_name=str(tiny_model_dir),
                                                         job_type=JobType.SAMPLING)))["job_id"]
            log_prob = (await state.initialize(JobConfig(model_name=str(tiny_model_dir),
                                                         job_type=JobType.LOG_PROB)))["job_id"]
            before = await state.forward(log_prob, _forward_body())  # no sleep running: no wait
            events: list[str] = []
            release = threading.Event()
            sampler = state.jobs.get(sampling, JobType.SAMPLING).engine
            lp_engine = state.jobs.get(log_prob, JobType.LOG_PROB).engine
            real_sleep, real_forward = sampler.sleep, lp_engine.forward

            def slow_sleep(level):
                events.append("sleep started")
                assert release.wait(60), "the test never let the sleep end"
                out = real_sleep(level)
                events.append("sleep ended")
                return out

            def forward(batch):
                events.append("pass")
                return real_forward(batch)

            sampler.sleep, lp_engine.forward = slow_sleep, forward
            sleeping = asyncio.create_task(control.sleep_inference(sampling, 1))
            while not events:
                await asyncio.sleep(0.01)
            fwd = asyncio.create_task(state.forward(log_prob, _forward_body()))
            await asyncio.sleep(0.3)
            waiting = not fwd.done() and events == ["sleep started"]
            release.set()
            await sleeping
            after = await fwd
            torch_equal = bool((before["batch"]["logprobs"] == after["batch"]["logprobs"]).all())
            return events, waiting and torch_equal
        finally:
            state.shutdown()

    with caplog.at_level("INFO", logger="arctic_rl.server"):
        events, ok = asyncio.run(scenario())
    assert ok  # the forward waited, then answered what it answers without a sleep
    assert events == ["sleep started", "sleep ended", "pass"]
    assert "waited" in caplog.text and "for the sampler to fall asleep" in caplog.text
