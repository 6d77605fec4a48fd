"""The rollout server's sampler sleep (``verl.remote_backend.workers.sampler_sleep``): verl's ``sleep()`` after a
generation phase puts a backend declaring ``SamplerSleep`` to sleep, the next ``generate`` wakes it once (all
parts) before its call goes out; a backend without the capability, ``free_cache_engine=false`` or the
asynchronous mode: no call. The mode is the one the trainer runs: a run that asked for the asynchronous mode and
fell back to sync sleeps its sampler. A backend whose server keeps the sampler resident (its sleep answers
``skipped``) reports no sleep timings."""

from __future__ import annotations

import asyncio
import threading

import pytest
from omegaconf import OmegaConf

from verl.remote_backend.async_trainer import CONCURRENT_JOBS_FEATURE, AsyncModeMixin, async_running
from verl.remote_backend.context import BackendContext, install_context, read_context
from verl.remote_backend.errors import RemoteServerError
from verl.remote_backend.protocols import SamplerSleep
from verl.remote_backend.workers import replica as replica_mod
from verl.remote_backend.workers.replica import RemoteRolloutServer
from verl.remote_backend.workers.sampler_sleep import DECLINED_METRIC, RELEASED, SKIPPED, sleep_settings


class _Plain:
    """A sampler without the capability; records the calls in order."""

    features = frozenset({"continuous_batching"})

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate(self, prompts, sampling_params=None):
        self.calls.append(("generate", len(prompts)))
        n = int((sampling_params or {}).get("n", 1))
        return [{"token_ids": [7], "logprobs": None, "finish_reason": "stop"} for _ in prompts for _ in range(n)]


class _Sleepy(_Plain):
    def sleep_sampler(self, level):
        self.calls.append(("sleep", level))
        return {"status": "sleeping"}

    def wake_sampler(self, tags=None):
        self.calls.append(("wake", tags))
        return {"status": "awake"}


def _main_config(**rollout) -> dict:
    return {"actor_rollout_ref": {"rollout": {"prompt_length": 8, "response_length": 4, "n": 2, **rollout}},
            "remote_backend": {"name": "fake"}}


def _server(monkeypatch, backend, main: dict) -> RemoteRolloutServer:
    monkeypatch.setattr(replica_mod, "attach_backend", lambda context: backend)
    return RemoteRolloutServer({"name": "fake", "handle": None, "main_config": main})


async def _phase(server: RemoteRolloutServer, prompts: int = 3) -> None:
    await asyncio.gather(*[server.generate(f"r{i}", [1, 2, i], {"temperature": 1.0}) for i in range(prompts)])


async def _phase_sleep_phase(server: RemoteRolloutServer) -> None:
    """A generation phase, verl's ``sleep()`` after it, and the next phase."""
    await _phase(server)
    await server.sleep()
    await _phase(server)


def test_sleep_after_a_phase_and_one_wake_before_the_next(monkeypatch):
    backend = _Sleepy()
    assert isinstance(backend, SamplerSleep) and not isinstance(_Plain(), SamplerSleep)
    server = _server(monkeypatch, backend, _main_config())

    async def main():
        await _phase(server)
        await server.sleep()
        await server.sleep()  # verl may sleep twice (start-up, then after a phase): one call
        await server.wake_up()  # verl's wake_up: the next generate wakes
        assert server.nap.asleep
        await _phase(server)
        await server.sleep()
        await server.nap.settled()  # verl's sleep() does not wait for the backend's

    asyncio.run(main())
    verbs = [c[0] for c in backend.calls]
    first_sleep = verbs.index("sleep")
    assert set(verbs[:first_sleep]) == {"generate"}
    assert backend.calls[first_sleep] == ("sleep", 1)
    assert backend.calls[first_sleep + 1] == ("wake", None)  # before any generate of the second phase
    assert verbs.count("wake") == 1 and verbs.count("sleep") == 2 and verbs[-1] == "sleep"
    timings = server.collect_generation_timings()
    assert timings["gen/sampler_sleep"] >= 0.0 and timings["gen/sampler_wake"] >= 0.0


def test_a_backend_without_the_capability_is_never_slept(monkeypatch, caplog):
    backend = _Plain()
    server = _server(monkeypatch, backend, _main_config())

    asyncio.run(_phase_sleep_phase(server))
    assert {c[0] for c in backend.calls} == {"generate"}
    assert "gen/sampler_sleep" not in server.collect_generation_timings()


@pytest.mark.parametrize("main", [
    _main_config(free_cache_engine=False),
    {**_main_config(), "trainer": {"v1": {"remote_backend": {"async_mode": True}}}},
])
def test_off_with_free_cache_engine_false_or_in_async_mode(monkeypatch, main):
    assert sleep_settings(main)[0] is False
    backend = _Sleepy()
    server = _server(monkeypatch, backend, main)

    asyncio.run(_phase_sleep_phase(server))
    assert {c[0] for c in backend.calls} == {"generate"}


def test_on_by_default_in_sync_mode():
    assert sleep_settings(_main_config())[0] is True
    assert sleep_settings(_main_config(free_cache_engine=True))[0] is True


class _Resident(_Plain):
    """The Arctic adapter against a server that does not list ``sampler_sleep`` (the vendor's): it declares the
    capability, but its server keeps the sampler resident and the calls are skipped."""

    def sleep_sampler(self, level):
        self.calls.append(("sleep", level))
        return {SKIPPED: True}

    def wake_sampler(self, tags=None):
        self.calls.append(("wake", tags))
        return {SKIPPED: True}


def test_a_sampler_kept_resident_reports_no_sleep_timings(monkeypatch):
    backend = _Resident()
    server = _server(monkeypatch, backend, _main_config())

    async def main():
        await _phase_sleep_phase(server)
        await server.sleep()

    asyncio.run(main())
    verbs = [c[0] for c in backend.calls]
    assert verbs.count("sleep") == 1 and "wake" not in verbs  # asked once, then taken as resident
    assert not server.nap.asleep and server.nap.resident
    timings = server.collect_generation_timings()
    assert not [key for key in timings if key.startswith("gen/sampler_")], timings  # absent, not 0 s


# ------------------------------------------------------------------ the mode actually run decides


class _Concurrent(_Sleepy):
    features = frozenset({"continuous_batching", CONCURRENT_JOBS_FEATURE})


class _Owner:
    def __init__(self, backend) -> None:
        self.backend = backend


class _TrainerBase:
    """What :class:`AsyncModeMixin` takes from the remote-backend trainer: its config, the backend it owns and
    verl's replay buffer."""

    backend_name = "fake"

    def __init__(self, config) -> None:
        self.config = config

    def _init_resource_pool_mgr(self) -> None:
        pass

    def _build_replay_buffer(self):
        return "verl's ReplayBufferAsync"


class _Trainer(AsyncModeMixin, _TrainerBase):
    pass


def _decided_context(backend, free_cache_engine: bool = True) -> tuple[_Trainer, BackendContext]:
    """A run asking for the asynchronous mode, its trainer's decision taken against ``backend``: the trainer and the
    backend context verl's worker and rollout servers are then created with."""
    config = OmegaConf.create({
        **_main_config(free_cache_engine=free_cache_engine),
        "trainer": {"v1": {"trainer_mode": "sync", "remote_backend": {"async_mode": True},
                           "sampler": {"max_off_policy_threshold": 2, "max_off_policy_strategy": "drop"}}},
    })
    install_context(config, name="fake", handle={"url": "http://fake"})  # what the entry point does, before
    trainer = _Trainer(config)
    trainer._owner = _Owner(backend)
    trainer._init_resource_pool_mgr()
    return trainer, read_context(trainer.config)


def test_an_async_request_that_fell_back_to_sync_sleeps_the_sampler(monkeypatch, caplog):
    backend = _Sleepy()  # lists no concurrent_jobs: the run falls back to sync
    trainer, context = _decided_context(backend)
    assert not trainer.async_active
    assert [r for r in caplog.records if "falling back to verl's sync mode" in r.getMessage()]
    server = _server(monkeypatch, backend, context.main_config)
    assert async_running(context.main_config) is False
    assert sleep_settings(context.main_config)[0] is True  # what the Arctic client's weight sync reads too

    asyncio.run(_phase_sleep_phase(server))
    verbs = [c[0] for c in backend.calls]
    assert verbs.count("sleep") == 1 and verbs.count("wake") == 1, verbs  # as in a plain sync run
    assert "gen/sampler_sleep" in server.collect_generation_timings()

    _, off = _decided_context(_Sleepy(), free_cache_engine=False)  # the config setting still decides
    assert sleep_settings(off.main_config)[0] is False


def test_a_run_that_is_asynchronous_never_sleeps_the_sampler(monkeypatch):
    backend = _Concurrent()
    trainer, context = _decided_context(backend)
    assert trainer.async_active
    server = _server(monkeypatch, backend, context.main_config)
    assert async_running(context.main_config) is True and sleep_settings(context.main_config)[0] is False

    asyncio.run(_phase_sleep_phase(server))
    assert {c[0] for c in backend.calls} == {"generate"}
    assert not [key for key in server.collect_generation_timings() if key.startswith("gen/sampler_")]


class _Releasing(_Sleepy):
    """Says how much device memory its server released around each sleep and wake."""

    def sleep_sampler(self, level):
        return {**super().sleep_sampler(level), RELEASED: 1 << 30}

    def wake_sampler(self, tags=None):
        return {**super().wake_sampler(tags), RELEASED: 2 << 30}


def test_the_memory_a_backend_released_is_reported_only_where_it_says(monkeypatch):
    for backend, want in ((_Releasing(), float(3 << 30)), (_Sleepy(), None)):
        server = _server(monkeypatch, backend, _main_config())
        asyncio.run(_phase_sleep_phase(server))
        timings = server.collect_generation_timings()
        assert timings.get("gen/sampler_released_bytes") == want, (type(backend).__name__, timings)
        assert "gen/sampler_released_bytes" not in server.collect_generation_timings()  # reset by the collect


# ------------------------------------------------------------------ the sleep runs beside the step, not in it


class _SlowSleep(_Sleepy):
    """A sleep that runs until the test lets it end."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def sleep_sampler(self, level):
        self.calls.append(("sleep started", level))
        assert self.release.wait(30), "the test never let the sleep end"
        return super().sleep_sampler(level)


def test_verl_sleep_returns_at_once_and_the_next_generate_waits_for_the_sleep(monkeypatch):
    backend = _SlowSleep()
    server = _server(monkeypatch, backend, _main_config())

    async def main():
        await _phase(server)
        await asyncio.wait_for(server.sleep(), timeout=5)  # returns while the backend's sleep still runs
        for _ in range(1000):  # the sleep's thread starts (at most 10 s on a loaded machine)
            if backend.calls[-1] == ("sleep started", 1):
                break
            await asyncio.sleep(0.01)
        assert backend.calls[-1] == ("sleep started", 1) and server.nap.asleep
        phase = asyncio.ensure_future(_phase(server))
        await asyncio.sleep(0.1)
        assert not phase.done() and [c[0] for c in backend.calls].count("generate") == 3  # it waits for the sleep
        backend.release.set()
        await asyncio.wait_for(phase, timeout=10)

    asyncio.run(main())
    verbs = [c[0] for c in backend.calls]
    assert verbs[3:6] == ["sleep started", "sleep", "wake"] and verbs[6:] == ["generate"] * 3, verbs
    timings = server.collect_generation_timings()
    assert timings["gen/sampler_sleep"] >= 0.1  # the sleep's own seconds, run beside the step


class _FailingSleep(_Sleepy):
    def sleep_sampler(self, level):
        self.calls.append(("sleep", level))
        raise RuntimeError("sleep-inference: HTTP 503 from the server")


def test_a_failed_sleep_is_raised_by_the_next_generate_once(monkeypatch, caplog):
    backend = _FailingSleep()
    server = _server(monkeypatch, backend, _main_config())

    async def main():
        await _phase(server)
        await server.sleep()  # does not raise: the sleep has not run yet
        with pytest.raises(RuntimeError, match="HTTP 503"):
            await _phase(server)
        await _phase(server)  # raised once; the sampler was never asleep: no wake

    asyncio.run(main())
    verbs = [c[0] for c in backend.calls]
    assert verbs.count("sleep") == 1 and "wake" not in verbs and verbs.count("generate") >= 6, verbs
    assert [r for r in caplog.records if "the sampler's sleep failed" in r.getMessage()]
    assert "gen/sampler_sleep" not in server.collect_generation_timings()


class _DecliningSleep(_Sleepy):
    """The server answers the sleep ``status`` (after the transport's retries), then sleeps normally."""

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status

    def sleep_sampler(self, level):
        self.calls.append(("sleep", level))
        if sum(1 for c in self.calls if c[0] == "sleep") == 1:
            raise RemoteServerError("/sleep-inference?job_id=1", self.status, "the vLLM sampler could not be put to "
                                    "sleep: ... it stays awake and usable")
        return {"status": "sleeping"}


def test_a_sleep_the_server_declined_leaves_the_sampler_awake_and_the_run_going(monkeypatch, caplog):
    backend = _DecliningSleep(503)
    server = _server(monkeypatch, backend, _main_config())

    async def main():
        await _phase_sleep_phase(server)  # declined: the next phase runs on the awake sampler, no wake
        first = server.collect_generation_timings()
        assert first[DECLINED_METRIC] == 1.0 and "gen/sampler_sleep" not in first
        await server.sleep()  # the next sleep is asked for again, and goes through
        await _phase(server)

    asyncio.run(main())
    verbs = [c[0] for c in backend.calls]
    assert verbs.count("sleep") == 2 and verbs.count("wake") == 1 and verbs.index("wake") > verbs.index("sleep", 4)
    assert [r for r in caplog.records if "declined the sampler's sleep" in r.getMessage()]
    timings = server.collect_generation_timings()
    assert DECLINED_METRIC not in timings and "gen/sampler_sleep" in timings


def test_a_sleep_that_failed_otherwise_is_still_raised(monkeypatch):
    server = _server(monkeypatch, _DecliningSleep(500), _main_config())

    async def main():
        await _phase(server)
        await server.sleep()
        with pytest.raises(RemoteServerError, match="HTTP 500"):
            await _phase(server)

    asyncio.run(main())
