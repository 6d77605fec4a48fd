"""Coalesce verl's one-sample ``generate`` calls into batched backend calls.

verl's agent loop calls the rollout server once per sample (``n`` times per prompt, concurrently).
A remote sampler wants few large requests instead, so :class:`RequestCoalescer` queues the
concurrent calls and hands them to one ``run_batch(prompts, params)`` coroutine per batch:

* calls are grouped by their sampling parameters (only identical parameters share a batch);
* a group is sent when it holds ``max_batch_size`` calls, or ``max_wait_ms`` after its oldest
  call arrived, whichever comes first;
* at most ``max_in_flight`` batches run at once; while they do, waiting groups keep growing
  (up to ``max_batch_size``), so a busy backend gets larger batches rather than more of them;
* each caller gets its own result, in order; when a batch fails every one of its callers gets
  the exception; :meth:`abort_pending` fails the calls not yet sent;
* every batch logs one line: its calls, the span over which they arrived, how long the oldest
  waited before the batch was sent, and how long the batch ran -- what a ``max_wait_ms`` choice
  is tuned from.

This module is plain asyncio: it knows nothing of Ray, verl or HTTP (the rollout server in
``replica.py`` plugs the adapter's ``generate`` in), which keeps it unit-testable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestAborted", "RequestCoalescer", "params_key"]

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))  # as the rollout server's own logger (replica.py)

BatchFn = Callable[[list[list[int]], dict[str, Any]], Awaitable[Sequence[Any]]]


class RequestAborted(Exception):
    """The call was dropped by :meth:`RequestCoalescer.abort_pending` before it was sent."""


def params_key(params: Mapping[str, Any]) -> Hashable:
    """A hashable key equal for equal parameter mappings (order-insensitive, nested values ok)."""
    return json.dumps(params, sort_keys=True, default=repr)


@dataclass
class _Call:
    prompt: list[int]
    future: asyncio.Future
    arrived: float


@dataclass
class _Group:
    params: dict[str, Any]
    calls: list[_Call] = field(default_factory=list)


class RequestCoalescer:
    """Queue single-prompt calls and send them as bounded batches (see the module docstring).

    Args:
        run_batch: ``await run_batch(prompts, params)`` returns one result per prompt, in order.
        max_batch_size: most prompts in one batch (>= 1).
        max_wait_ms: longest time the oldest call of a group waits for company (>= 0).
        max_in_flight: most batches running at once (>= 1).
    """

    def __init__(self, run_batch: BatchFn, *, max_batch_size: int, max_wait_ms: float, max_in_flight: int = 1):
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected an integer >= 1, received {max_batch_size!r}")
        if not isinstance(max_wait_ms, (int, float)) or isinstance(max_wait_ms, bool) or max_wait_ms < 0:
            raise ValueError(f"max_wait_ms: expected a number >= 0, received {max_wait_ms!r}")
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ValueError(f"max_in_flight: expected an integer >= 1, received {max_in_flight!r}")
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_in_flight = max_in_flight
        self._groups: dict[Hashable, _Group] = {}  # insertion order = age of each group's oldest call
        self._changed: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._dispatcher: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._closed = False
        #: (batch size, params) of every batch sent, most recent last; bounded, for tests and logs
        self.sent_batches: list[tuple[int, dict[str, Any]]] = []

    # ------------------------------------------------------------------ public API
    async def submit(self, prompt: Sequence[int], params: Mapping[str, Any]) -> Any:
        """Queue one prompt; return its result once its batch has run (or raise its error)."""
        if self._closed:
            raise RuntimeError("RequestCoalescer is closed")
        self._start()
        future = asyncio.get_running_loop().create_future()
        key = params_key(params)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(params=dict(params))
        group.calls.append(_Call(prompt=list(prompt), future=future, arrived=time.monotonic()))
        self._changed.set()
        return await future

    def pending(self) -> int:
        """Calls queued and not yet sent."""
        return sum(len(g.calls) for g in self._groups.values())

    def in_flight(self) -> int:
        """Batches running now."""
        return len(self._running)

    def abort_pending(self, reason: str = "aborted") -> int:
        """Fail every call not yet sent with :class:`RequestAborted`; return how many."""
        groups, self._groups = self._groups, {}
        count = 0
        for group in groups.values():
            for call in group.calls:
                if not call.future.done():
                    call.future.set_exception(RequestAborted(reason))
                    count += 1
        return count

    async def close(self) -> None:
        """Abort queued calls, wait for running batches, stop the dispatcher."""
        self._closed = True
        self.abort_pending("coalescer closed")
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            try:
                await self._dispatcher
            except asyncio.CancelledError:
                pass
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    # ------------------------------------------------------------------ internals
    def _start(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            self._changed = asyncio.Event()
            self._slots = asyncio.Semaphore(self.max_in_flight)
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch_forever())

    def _ready_key(self, now: float) -> tuple[Hashable | None, float | None]:
        """The oldest group that is full or has waited long enough; else the next deadline."""
        next_deadline = None
        for key, group in self._groups.items():
            if not group.calls:
                continue
            deadline = group.calls[0].arrived + self.max_wait_s
            if len(group.calls) >= self.max_batch_size or deadline <= now:
                return key, None
            next_deadline = deadline if next_deadline is None else min(next_deadline, deadline)
        return None, next_deadline

    async def _dispatch_forever(self) -> None:
        while True:
            self._changed.clear()
            key, deadline = self._ready_key(time.monotonic())
            if key is None:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            await self._slots.acquire()  # while we wait, the group may grow up to max_batch_size
            group = self._groups.get(key)
            if group is None or not group.calls:  # aborted meanwhile
                self._slots.release()
                continue
            batch = group.calls[: self.max_batch_size]
            del group.calls[: len(batch)]
            if not group.calls:
                del self._groups[key]
            task = asyncio.get_running_loop().create_task(self._run(batch, group.params))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[_Call], params: dict[str, Any]) -> None:
        try:
            live = [c for c in batch if not c.future.done()]  # a caller may have been cancelled
            if not live:
                return
            self.sent_batches.append((len(live), params))
            del self.sent_batches[:-256]
            sent = time.monotonic()
            try:
                results = await self._run_batch([c.prompt for c in live], dict(params))
                results = list(results)
                if len(results) != len(live):
                    raise RuntimeError(
                        f"generate batch: expected {len(live)} results (one per prompt), received {len(results)}"
                    )
            except asyncio.CancelledError:
                for call in live:
                    call.future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - every waiting caller must hear about it
                for call in live:
                    if not call.future.done():
                        call.future.set_exception(exc)
                return
            arrivals = [c.arrived for c in live]
            logger.info(
                "generate batch: %d calls arrived over %.0f ms, the oldest waited %.0f ms, ran %.3f s; %d queued",
                len(live),
                1000 * (max(arrivals) - min(arrivals)),
                1000 * (sent - min(arrivals)),
                time.monotonic() - sent,
                self.pending(),
            )
            for call, result in zip(live, results):
                if not call.future.done():
                    call.future.set_result(result)
        finally:
            self._slots.release()
            if self._changed is not None:
                self._changed.set()
