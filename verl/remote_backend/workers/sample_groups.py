"""verl's one-sample ``generate`` calls sent as they come, the samples of one prompt as one request.

Against a server that batches continuously (it lists ``continuous_batching``: calls join its running batch and
each is answered when its own sequences end), gathering calls into batches only adds waiting. So
:class:`SampleGrouper` sends each call as it comes -- no batching window across prompts, no one-batch-in-flight
limit -- except that the samples of one prompt travel together:

* calls with the same prompt ids and the same sampling parameters form a group (verl's agent loop asks for the
  ``rollout.n`` samples of a prompt as ``n`` such calls, one right after the other);
* with ``use_n`` (the server lists ``n_samples``) a group is sent as one request with ``n`` = its size -- the
  prompt once, one HTTP exchange -- as soon as it holds ``group_size`` calls, or ``max_wait_ms`` after its first
  call arrived, whichever comes first; its ``n`` results go back to its callers in order;
* without ``use_n`` every call is sent at once on its own (``n`` = 1);
* at most ``max_in_flight`` requests run at once; :meth:`abort_pending` fails the calls not yet sent.

Plain asyncio, like :mod:`.coalescer` (the rollout server in ``replica.py`` picks one of the two from the
backend's features).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.remote_backend.workers.coalescer import RequestAborted, params_key

__all__ = ["SampleGrouper"]

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

#: ``await run_group(prompt, params)``: ``params["n"]`` samples of ``prompt``, in order
GroupFn = Callable[[list[int], dict[str, Any]], Awaitable[Sequence[Any]]]


@dataclass
class _Group:
    prompt: list[int]
    params: dict[str, Any]
    futures: list[asyncio.Future] = field(default_factory=list)
    first: float = 0.0
    timer: asyncio.TimerHandle | None = None


class SampleGrouper:
    """Send calls as they come, one request per prompt's samples (see the module docstring).

    Args:
        run_group: ``await run_group(prompt, params)`` returns ``params["n"]`` results for ``prompt``.
        group_size: the samples verl asks per prompt (``rollout.n``); a group this large is sent at once.
        max_wait_ms: longest time a smaller group waits for the rest of its samples (>= 0).
        max_in_flight: most requests running at once (>= 1).
        use_n: whether the server takes ``n`` > 1 (else each call is its own request).
    """

    def __init__(self, run_group: GroupFn, *, group_size: int, max_wait_ms: float, max_in_flight: int,
                 use_n: bool = True) -> None:
        for name, value, low in (("group_size", group_size, 1), ("max_in_flight", max_in_flight, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, received {value!r}")
        if not isinstance(max_wait_ms, (int, float)) or isinstance(max_wait_ms, bool) or max_wait_ms < 0:
            raise ValueError(f"max_wait_ms: expected a number >= 0, received {max_wait_ms!r}")
        self._run_group = run_group
        self.group_size = group_size if use_n else 1
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_in_flight = max_in_flight
        self.use_n = use_n
        self._groups: dict[Hashable, _Group] = {}
        self._slots: asyncio.Semaphore | None = None
        self._running: set[asyncio.Task] = set()
        self._closed = False
        #: (n, params) of every request sent, most recent last; bounded, for tests and logs
        self.sent_requests: list[tuple[int, dict[str, Any]]] = []

    # ------------------------------------------------------------------ public API
    async def submit(self, prompt: Sequence[int], params: Mapping[str, Any]) -> Any:
        """One sample of ``prompt``; returns its result once its group's request has run (or raises its error)."""
        if self._closed:
            raise RuntimeError("SampleGrouper is closed")
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        future = loop.create_future()
        prompt = [int(t) for t in prompt]
        key = (tuple(prompt), params_key(params))
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(prompt, dict(params), first=time.monotonic())
            if self.group_size > 1:
                group.timer = loop.call_later(self.max_wait_s, self._send, key, group)
        group.futures.append(future)
        if len(group.futures) >= self.group_size:
            self._send(key, group)
        return await future

    def pending(self) -> int:
        """Calls waiting for the rest of their group (not yet sent)."""
        return sum(len(g.futures) for g in self._groups.values())

    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._running)

    def abort_pending(self, reason: str = "aborted") -> int:
        """Fail every call not yet sent with :class:`~.coalescer.RequestAborted`; return how many."""
        groups, self._groups = self._groups, {}
        count = 0
        for group in groups.values():
            if group.timer is not None:
                group.timer.cancel()
            for future in group.futures:
                if not future.done():
                    future.set_exception(RequestAborted(reason))
                    count += 1
        return count

    async def close(self) -> None:
        """Abort waiting calls and wait for the requests in flight."""
        self._closed = True
        self.abort_pending("grouper closed")
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    # ------------------------------------------------------------------ internals
    def _send(self, key: Hashable, group: _Group) -> None:
        if self._groups.get(key) is not group:
            return  # already sent (full), or aborted
        del self._groups[key]
        if group.timer is not None:
            group.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._run(group))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, group: _Group) -> None:
        async with self._slots:
            live = [f for f in group.futures if not f.done()]  # a caller may have been cancelled
            if not live:
                return
            params = {**group.params, "n": len(live)} if self.use_n else dict(group.params)
            self.sent_requests.append((len(live), params))
            del self.sent_requests[:-256]
            sent = time.monotonic()
            try:
                results = list(await self._run_group(list(group.prompt), params))
                if len(results) != len(live):
                    raise RuntimeError(f"generate: expected {len(live)} samples of one prompt (n={len(live)}), "
                                       f"received {len(results)}")
            except asyncio.CancelledError:
                for future in live:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - every waiting caller must hear about it
                for future in live:
                    if not future.done():
                        future.set_exception(exc)
                return
            logger.debug("generate: %d samples of one prompt, waited %.0f ms, ran %.3f s", len(live),
                         1000 * (sent - group.first), time.monotonic() - sent)
            for future, result in zip(live, results):
                if not future.done():
                    future.set_result(result)
