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
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.remote_backend.logs import module_logger
from verl.remote_backend.workers.coalescer import PendingCalls, check_count, params_key

__all__ = ["SampleGrouper"]

logger = module_logger(__name__)

#: ``await run_group(prompt, params)``: ``params["n"]`` samples of ``prompt``, in order
GroupFn = Callable[[list[int], dict[str, Any]], Awaitable[Sequence[Any]]]


@dataclass
class _Group:
    prompt: list[int]
    params: dict[str, Any]
    futures: list[asyncio.Future] = field(default_factory=list)
    first: float = 0.0
    timer: asyncio.TimerHandle | None = None

    def waiting(self) -> list[asyncio.Future]:
        return self.futures

    def drop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class SampleGrouper(PendingCalls):
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
        check_count("group_size", group_size)
        super().__init__(max_wait_ms=max_wait_ms, max_in_flight=max_in_flight)
        self._run_group = run_group
        self.group_size = group_size if use_n else 1
        self.use_n = use_n
        self._slots: asyncio.Semaphore | None = None
        #: (n, params) of every request sent, most recent last; bounded, for tests and logs
        self.sent_requests: list[tuple[int, dict[str, Any]]] = []

    # ------------------------------------------------------------------ public API
    async def submit(self, prompt: Sequence[int], params: Mapping[str, Any]) -> Any:
        """One sample of ``prompt``; returns its result once its group's request has run (or raises its error)."""
        self._check_open()
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

    # ------------------------------------------------------------------ internals
    def _send(self, key: Hashable, group: _Group) -> None:
        if self._groups.get(key) is not group:
            return  # already sent (full), or aborted
        del self._groups[key]
        group.drop()
        self._launch(self._run(group))

    async def _run(self, group: _Group) -> None:
        async with self._slots:
            live = [f for f in group.futures if not f.done()]  # a caller may have been cancelled
            if not live:
                return
            params = {**group.params, "n": len(live)} if self.use_n else dict(group.params)
            self.sent_requests.append((len(live), params))
            del self.sent_requests[:-256]
            sent = time.monotonic()
            expected = f"generate: expected {len(live)} samples of one prompt (n={len(live)})"
            if await self._answer(live, lambda: self._run_group(list(group.prompt), params), expected):
                logger.debug("generate: %d samples of one prompt, waited %.0f ms, ran %.3f s", len(live),
                             1000 * (sent - group.first), time.monotonic() - sent)
