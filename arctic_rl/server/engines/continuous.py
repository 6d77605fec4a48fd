"""Continuous batching: one thread owns a generation engine, and ``/generate`` calls join its running batch.

A sampling engine that batches continuously hands its step-wise core to a :class:`ContinuousLoop`. The loop's
thread is the only one that touches the core; it repeats:

1. admit every call queued since the last step (their sequences join the running batch -- prompts are
   prefilled while the others decode);
2. run one engine step over everything in flight;
3. answer each call whose sequences have all finished (its :class:`concurrent.futures.Future` is resolved),
   whatever the other calls still do.

So a call with ``max_tokens`` 4 sent while a call with ``max_tokens`` 64 runs returns first, and calls that
arrive while others run do not wait for them.

Control operations -- a weight load, sleep, wake, a prefix-cache reset -- go through :meth:`ContinuousLoop.control`:
they run on the loop's thread once no call is in flight, and calls queued after one wait for it. No step ever
runs on half-updated weights, and no call spans a weight change: each call is stamped with the weight version
current when it was admitted (:attr:`Call.weight_version`), which is the version it ran on from first token to
last. What is not here: the engines (:class:`StepCore` implementations live next to each sampler), building the
``/generate`` answer (done by the caller, off the loop thread, so the next step is not delayed).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Call", "ContinuousLoop", "LoopClosed", "Pending", "StepCore"]

logger = logging.getLogger("arctic_rl.server")

_ids = itertools.count(1)


class LoopClosed(RuntimeError):
    """The sampling job was destroyed (or its loop failed) before the call was answered."""


@dataclass(eq=False)
class Call:
    """One ``/generate`` call in the loop: what the core needs to run it, and where its answer goes."""

    payload: Any
    future: Future = field(default_factory=Future)
    call_id: int = field(default_factory=lambda: next(_ids))
    #: the weight version the call's sequences ran on (set when the call is admitted)
    weight_version: int = 0
    #: the core's own bookkeeping for the call (sequences, partial outputs)
    state: Any = None


@dataclass(eq=False)
class Pending:
    """A submitted ``/generate`` call: await :attr:`future` (the core's raw output), then build the answer with
    :meth:`finish` -- off the loop's thread, so the answer of one call never delays the next step."""

    loop: ContinuousLoop
    call: Call
    build: Callable[[Call, Any], list[dict[str, Any]]]

    @property
    def future(self) -> Future:
        return self.call.future

    def finish(self, raw: Any) -> list[dict[str, Any]]:
        return self.build(self.call, raw)

    def result(self) -> list[dict[str, Any]]:
        """Block until answered (the synchronous ``generate``)."""
        return self.finish(self.call.future.result())

    def cancel(self) -> None:
        self.loop.cancel(self.call)


class StepCore(Protocol):
    """A generation engine driven step by step (each call's methods run on the loop's thread only)."""

    def admit(self, call: Call) -> None:
        """Add ``call``'s sequences to the running batch and stamp ``call.weight_version``."""

    def step(self) -> list[tuple[Call, Any]]:
        """One engine step over everything admitted; the calls it finished, each with its raw output."""

    def abort(self, call: Call) -> None:
        """Drop ``call``'s sequences from the running batch."""

    def has_room(self, call: Call, admitting: list[Call]) -> bool:
        """Whether ``call`` fits beside the running batch and the calls being admitted with it (a call that does
        not waits, in order; an idle core takes any)."""


@dataclass(eq=False)
class _Control:
    fn: Callable[[], Any]
    wait_idle: bool = True
    before: Callable[[], None] | None = None
    future: Future = field(default_factory=Future)


class ContinuousLoop:
    """The loop thread around one :class:`StepCore` (see the module docstring)."""

    def __init__(self, core: StepCore, *, name: str = "sampler") -> None:
        self.core = core
        self.name = name
        self._cond = threading.Condition()
        self._queue: deque[Call | _Control] = deque()
        self._active: list[Call] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        #: calls answered and steps run so far (``info()``, tests)
        self.answered = 0
        self.steps = 0

    # ------------------------------------------------------------------ callers (any thread)

    def submit(self, payload: Any) -> Call:
        """Queue a call; its :attr:`Call.future` resolves to the core's raw output for it."""
        call = Call(payload)
        with self._cond:
            if self._closed:
                raise LoopClosed(f"the {self.name} was closed")
            self._start()
            self._queue.append(call)
            self._cond.notify_all()
        return call

    def cancel(self, call: Call) -> None:
        """Give up on ``call``: dropped from the queue, or its sequences aborted at the next step boundary."""
        with self._cond:
            if call in self._queue:
                self._queue.remove(call)
                call.future.cancel()
                return
        if call in self._active:
            self.control(lambda: None, wait_idle=False, before=lambda: self._drop(call))

    def control(self, fn: Callable[[], Any], *, wait_idle: bool = True,
                before: Callable[[], None] | None = None) -> Any:
        """Run ``fn`` on the loop's thread once no call is in flight (``wait_idle``) and return its result; calls
        queued after this one wait for it. From the loop's own thread ``fn`` runs at once."""
        if threading.current_thread() is self._thread:
            return fn()
        with self._cond:
            if self._closed:
                raise LoopClosed(f"the {self.name} was closed")
            op = _Control(fn, wait_idle, before)
            self._start()
            self._queue.append(op)
            self._cond.notify_all()
        return op.future.result()

    def in_flight(self) -> int:
        """Calls admitted and not yet answered, plus calls queued."""
        with self._cond:
            return len(self._active) + sum(isinstance(x, Call) for x in self._queue)

    def controls_waiting(self) -> int:
        """Control operations queued and not yet run (a weight load waiting for the calls in flight, ...)."""
        with self._cond:
            return sum(isinstance(x, _Control) for x in self._queue)

    def close(self, reason: str = "closed") -> None:
        """Fail every call not yet answered with :class:`LoopClosed` and stop the thread."""
        with self._cond:
            self._closed = True
            pending, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for item in pending:
            if not item.future.done():
                item.future.set_exception(LoopClosed(f"the {self.name} was {reason}"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the loop thread

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"arctic-{self.name}-loop", daemon=True)
            self._thread.start()

    def _drop(self, call: Call) -> None:
        if call in self._active:
            self._active.remove(call)
            self.core.abort(call)
        if not call.future.done():
            call.future.cancel()

    def _next_items(self) -> tuple[list[Call], _Control | None]:
        """Under the lock: the calls to admit now, or the control operation whose turn it is."""
        while not self._closed and not self._queue and not self._active:
            self._cond.wait()
        admit: list[Call] = []
        while self._queue and isinstance(self._queue[0], Call):
            if (self._active or admit) and not self.core.has_room(self._queue[0], admit):
                break  # the batch is full: the call waits (in order) for running ones to end
            admit.append(self._queue.popleft())
        head = self._queue[0] if self._queue else None
        if isinstance(head, _Control) and (not head.wait_idle or (not self._active and not admit)):
            self._queue.popleft()
            return admit, head
        return admit, None

    def _run(self) -> None:
        while True:
            with self._cond:
                admit, op = self._next_items()
                if self._closed:
                    active, self._active = self._active, []
                    break
            for call in admit:
                if call.future.set_running_or_notify_cancel():
                    try:
                        self.core.admit(call)
                    except BaseException as exc:  # noqa: BLE001 - the caller hears of it (a bad prompt, ...)
                        call.future.set_exception(exc)
                        continue
                    self._active.append(call)
            if op is not None:
                self._run_control(op)
                continue
            if self._active:
                self._step()
        for call in active:
            self.core.abort(call)
            if not call.future.done():
                call.future.set_exception(LoopClosed(f"the {self.name} was closed"))

    def _run_control(self, op: _Control) -> None:
        try:
            if op.before is not None:
                op.before()
            op.future.set_result(op.fn())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            op.future.set_exception(exc)

    def _step(self) -> None:
        try:
            finished = self.core.step()
        except BaseException as exc:
            logger.exception("%s: engine step failed; failing %d calls", self.name, len(self._active))
            failed, self._active = self._active, []
            for call in failed:
                try:
                    self.core.abort(call)
                except Exception:
                    logger.exception("%s: aborting call %d failed", self.name, call.call_id)
                if not call.future.done():
                    call.future.set_exception(exc)
            return
        self.steps += 1
        for call, output in finished:
            if call in self._active:
                self._active.remove(call)
            self.answered += 1
            if not call.future.done():
                call.future.set_result(output)
