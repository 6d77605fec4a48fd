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
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.remote_backend.logs import module_logger

__all__ = ["PendingCalls", "RequestAborted", "RequestCoalescer", "params_key"]

logger = module_logger(__name__)

BatchFn = Callable[[list[list[int]], dict[str, Any]], Awaitable[Sequence[Any]]]


class RequestAborted(Exception):
    """The call was dropped by :meth:`RequestCoalescer.abort_pending` before it was sent."""


def params_key(params: Mapping[str, Any]) -> Hashable:
    """A hashable key equal for equal parameter mappings (order-insensitive, nested values ok)."""
    return json.dumps(params, sort_keys=True, default=repr)


class PendingCalls:
    """What :class:`RequestCoalescer` and :class:`~.sample_groups.SampleGrouper` share: groups of calls not yet
    sent (``_groups``; a group's ``waiting()`` are its callers' futures, ``drop()`` stops its timer), the tasks
    of the requests running (``_running``), counting, aborting and closing, and handing a request's results
    to its callers (:meth:`_answer`).

    Args:
        max_wait_ms: longest time a group waits for more calls (>= 0).
        max_in_flight: most requests running at once (>= 1).
    """

    def __init__(self, *, max_wait_ms: float, max_in_flight: int) -> None:
        if not isinstance(max_wait_ms, (int, float)) or isinstance(max_wait_ms, bool) or max_wait_ms < 0:
            raise ValueError(f"max_wait_ms: expected a number >= 0, received {max_wait_ms!r}")
        check_count("max_in_flight", max_in_flight)
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_in_flight = max_in_flight
        self._groups: dict[Hashable, Any] = {}  # insertion order = age of each group's oldest call
        self._running: set[asyncio.Task] = set()
        self._closed = False

    def pending(self) -> int:
        """Calls queued and not yet sent."""
        return sum(len(g.waiting()) for g in self._groups.values())

    def in_flight(self) -> int:
        """Requests (batches) running now."""
        return len(self._running)

    def abort_pending(self, reason: str = "aborted") -> int:
        """Fail every call not yet sent with :class:`RequestAborted`; return how many."""
        groups, self._groups = self._groups, {}
        count = 0
        for group in groups.values():
            group.drop()
            for future in group.waiting():
                if not future.done():
                    future.set_exception(RequestAborted(reason))
                    count += 1
        return count

    async def close(self) -> None:
        """Abort the calls not yet sent, stop sending, wait for the requests running."""
        self._closed = True
        self.abort_pending(f"{type(self).__name__} closed")
        await self._stop()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def _stop(self) -> None:
        """What a subclass stops on :meth:`close` before the running requests are awaited (nothing here)."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _launch(self, request: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(request)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    @staticmethod
    async def _answer(live: list[asyncio.Future], request: Callable[[], Awaitable[Sequence[Any]]],
                      expected: str) -> bool:
        """Run ``request()``; each future of ``live`` gets its result, in order. When the request fails, or answers
        another number of results than ``live`` (``expected`` says what was asked, for the error), each gets the
        exception; a cancelled request cancels them. Whether the results were handed out."""
        try:
            results = list(await request())
            if len(results) != len(live):
                raise RuntimeError(f"{expected}, received {len(results)}")
        except asyncio.CancelledError:
            for future in live:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every waiting caller must hear about it
            for future in live:
                if not future.done():
                    future.set_exception(exc)
            return False
        for future, result in zip(live, results):
            if not future.done():
                future.set_result(result)
        return True


def check_count(name: str, value: Any) -> None:
    """Refuse ``value`` unless it is an integer >= 1 (``ValueError`` naming ``name``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, received {value!r}")


@dataclass
class _Call:
    prompt: list[int]
    future: asyncio.Future
    arrived: float


@dataclass
class _Group:
    params: dict[str, Any]
    calls: list[_Call] = field(default_factory=list)

    def waiting(self) -> list[asyncio.Future]:
        return [call.future for call in self.calls]

    def drop(self) -> None:
        """Nothing to stop: the dispatcher finds the group gone."""


class RequestCoalescer(PendingCalls):
    """Queue single-prompt calls and send them as bounded batches (see the module docstring).

    Args:
        run_batch: ``await run_batch(prompts, params)`` returns one result per prompt, in order.
        max_batch_size: most prompts in one batch (>= 1).
        max_wait_ms: longest time the oldest call of a group waits for company (>= 0).
        max_in_flight: most batches running at once (>= 1).
    """

    def __init__(self, run_batch: BatchFn, *, max_batch_size: int, max_wait_ms: float, max_in_flight: int = 1):
        check_count("max_batch_size", max_batch_size)
        super().__init__(max_wait_ms=max_wait_ms, max_in_flight=max_in_flight)
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self._changed: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._dispatcher: asyncio.Task | None = None
        #: (batch size, params) of every batch sent, most recent last; bounded, for tests and logs
        self.sent_batches: list[tuple[int, dict[str, Any]]] = []

    # ------------------------------------------------------------------ public API
    async def submit(self, prompt: Sequence[int], params: Mapping[str, Any]) -> Any:
        """Queue one prompt; return its result once its batch has run (or raise its error)."""
        self._check_open()
        self._start()
        future = asyncio.get_running_loop().create_future()
        key = params_key(params)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(params=dict(params))
        group.calls.append(_Call(prompt=list(prompt), future=future, arrived=time.monotonic()))
        self._changed.set()
        return await future

    # ------------------------------------------------------------------ internals
    async def _stop(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            try:
                await self._dispatcher
            except asyncio.CancelledError:
                pass

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
            self._launch(self._run(batch, group.params))

    async def _run(self, batch: list[_Call], params: dict[str, Any]) -> None:
        try:
            live = [c for c in batch if not c.future.done()]  # a caller may have been cancelled
            if not live:
                return
            self.sent_batches.append((len(live), params))
            del self.sent_batches[:-256]
            sent = time.monotonic()
            prompts = [c.prompt for c in live]
            expected = f"generate batch: expected {len(live)} results (one per prompt)"
            if not await self._answer([c.future for c in live], lambda: self._run_batch(prompts, dict(params)),
                                      expected):
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
        finally:
            self._slots.release()
            if self._changed is not None:
                self._changed.set()
