"""The server's request-id cache keeps exactly ``capacity`` ids per scope: not one fewer, not one more.

A client re-sends an unanswered call with the same ``X-Request-Id``; the server answers it from the
cache only while the id is still there. ``capacity`` is the promise: the newest ``capacity`` ids of a
scope replay (nothing re-applied), the one before them runs again.
"""

from __future__ import annotations

import asyncio

import pytest

from arctic_rl.server.http.idempotency import CachedResponse, IdempotencyCache


@pytest.mark.parametrize("capacity", [1, 3])
def test_the_cache_keeps_exactly_its_capacity(capacity):
    cache = IdempotencyCache(capacity=capacity)
    applied: list[str] = []

    def compute_for(rid: str):
        async def compute() -> CachedResponse:
            applied.append(rid)
            return CachedResponse(200, rid.encode(), "text/plain")

        return compute

    ids = [f"id-{i}" for i in range(capacity + 2)]

    async def scenario() -> tuple[int, list[bool], int, bool]:
        for rid in ids[:capacity]:
            await cache.run("job:1", rid, rid, compute_for(rid))
        full = len(cache)  # exactly capacity ids, none evicted yet
        for rid in ids[capacity:]:
            await cache.run("job:1", rid, rid, compute_for(rid))
        kept = len(cache)
        # the newest `capacity` ids replay (replays never evict); checked newest first
        replays = []
        for rid in reversed(ids[-capacity:]):
            answer, replayed = await cache.run("job:1", rid, rid, compute_for(rid))
            assert answer.body == rid.encode()
            replays.append(replayed)
        before = len(applied)
        _, evicted_replayed = await cache.run("job:1", ids[1], ids[1], compute_for(ids[1]))
        return full, replays, kept, evicted_replayed and len(applied) == before

    full, replays, kept, evicted_replayed = asyncio.run(scenario())
    assert full == capacity
    assert kept == capacity, f"the cache holds {kept} ids, its capacity is {capacity}"
    assert replays == [True] * capacity, "an id among the newest `capacity` was evicted"
    assert not evicted_replayed, "an id older than the newest `capacity` was still replayed"
    assert applied[: capacity + 2] == ids  # every first call applied once


def test_scopes_keep_their_capacity_apart():
    cache = IdempotencyCache(capacity=2)

    async def compute() -> CachedResponse:
        return CachedResponse(200, b"x", "text/plain")

    async def scenario() -> int:
        for scope in ("job:1", "job:2", "server"):
            for rid in ("a", "b", "c"):
                await cache.run(scope, rid, "h", compute)
        return len(cache)

    assert asyncio.run(scenario()) == 3 * 2
