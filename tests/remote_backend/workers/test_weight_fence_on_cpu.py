"""The weight fence of the asynchronous mode (``verl/remote_backend/workers/weight_fence.py``).

* :class:`GenerationFence`: a hold waits for every call in flight and admits no new one; the calls that arrive
  meanwhile wait (none is dropped) and run after the release; a hold with nothing in flight returns at once.
* :func:`fenced`: holds every server before the body and releases them all after it, also when the body raises;
  disabled (or with no servers) it holds nothing.

The rollout server and the worker using it against the vendor's server: tests/conformance/test_vendor_async_on_cpu.py.
"""

from __future__ import annotations

import asyncio

import pytest

from verl.remote_backend.workers.weight_fence import GenerationFence, fenced


def run(coro):
    return asyncio.run(coro)


async def _call(fence: GenerationFence, log: list[str], name: str, seconds: float) -> None:
    async with fence.admitted():
        log.append(f"start {name}")
        await asyncio.sleep(seconds)
        log.append(f"end {name}")


def test_a_hold_waits_for_the_calls_in_flight_and_holds_the_new_ones():
    async def scenario():
        fence, log = GenerationFence(), []
        first = asyncio.create_task(_call(fence, log, "a", 0.2))
        second = asyncio.create_task(_call(fence, log, "b", 0.3))
        await asyncio.sleep(0.05)
        assert fence.in_flight == 2
        hold = asyncio.create_task(fence.hold())
        await asyncio.sleep(0.05)
        late = asyncio.create_task(_call(fence, log, "late", 0.0))  # arrives while held
        waited = await hold
        log.append("held")
        assert waited == 2 and fence.in_flight == 0
        await asyncio.sleep(0.1)
        assert "start late" not in log  # still held: not admitted, not dropped
        fence.release()
        await asyncio.gather(first, second, late)
        return log

    log = run(scenario())
    assert log.index("held") > log.index("end a") and log.index("held") > log.index("end b")
    assert log.index("start late") > log.index("held")
    assert log[-1] == "end late"


def test_a_hold_with_nothing_in_flight_returns_at_once():
    async def scenario():
        fence = GenerationFence()
        waited = await asyncio.wait_for(fence.hold(), timeout=1)
        fence.release()
        await asyncio.wait_for(_call(fence, [], "after", 0.0), timeout=1)
        return waited, fence.holds

    assert run(scenario()) == (0, 1)


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Server:
    """Stands in for a rollout server actor handle: ``hold_generation.remote()`` / ``release_generation.remote()``
    are awaitables, as Ray's are."""

    def __init__(self, log: list[str], name: str):
        self.fence = GenerationFence()
        self.hold_generation = _Method(self._hold)
        self.release_generation = _Method(self._release)
        self.log, self.name = log, name

    async def _hold(self) -> int:
        self.log.append(f"hold {self.name}")
        return await self.fence.hold()

    async def _release(self) -> None:
        self.log.append(f"release {self.name}")
        self.fence.release()


def test_fenced_holds_every_server_and_releases_them_also_on_error():
    async def scenario():
        log: list[str] = []
        servers = [_Server(log, "0"), _Server(log, "1")]
        busy = asyncio.create_task(_call(servers[1].fence, log, "in flight", 0.2))
        await asyncio.sleep(0.05)
        async with fenced(servers, enabled=True) as held:
            log.append("sync")
            assert held["calls"] == 1 and held["wait_s"] >= 0.1
        with pytest.raises(RuntimeError, match="sync failed"):
            async with fenced(servers, enabled=True):
                raise RuntimeError("sync failed")
        await busy
        after = asyncio.wait_for(_call(servers[0].fence, log, "after", 0.0), timeout=1)
        await after  # released after the failed sync too
        return log

    log = run(scenario())
    assert log[:7] == ["start in flight", "hold 0", "hold 1", "end in flight", "sync", "release 0", "release 1"]
    assert log.count("release 0") == log.count("release 1") == 2
    assert log[-1] == "end after"


def test_fenced_disabled_holds_nothing():
    async def scenario():
        log: list[str] = []
        server = _Server(log, "0")
        async with fenced([server], enabled=False) as held:
            assert held == {}
        async with fenced([], enabled=True) as held:
            assert held == {}
        return log

    assert run(scenario()) == []
