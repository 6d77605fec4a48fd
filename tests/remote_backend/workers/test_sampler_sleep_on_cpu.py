"""The rollout server's sampler sleep (``verl.remote_backend.workers.sampler_sleep``): verl's ``sleep()`` after a
generation phase puts a backend declaring ``SamplerSleep`` to sleep, the next ``generate`` wakes it once (all
parts) before its call goes out; a backend without the capability, ``free_cache_engine=false`` or the
asynchronous mode: no call."""

from __future__ import annotations

import asyncio

import pytest

from verl.remote_backend.protocols import SamplerSleep
from verl.remote_backend.workers import replica as replica_mod
from verl.remote_backend.workers.replica import RemoteRolloutServer
from verl.remote_backend.workers.sampler_sleep import sleep_settings


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
