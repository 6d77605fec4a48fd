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

Control operations -- a weight load, sleep, wake, a prefix-cache reset -- go through :meth:`ContinuousLoop.control`
and run on the loop's thread between two steps, never during one; controls run in the order they were asked, and
each says what it does with the calls in flight (``when``):

* ``"restart"`` (a weight load under the server's ``restart`` policy): it waits only for the step that is running;
  then every call in flight is taken out of the engine (:meth:`StepCore.abort`), the control runs, and those calls
  are admitted again, first, from their own payloads (same prompts, same seeds), so each runs wholly on the new
  weights and reports them. A call answered by the step that was running keeps the old version.
  :attr:`ContinuousLoop.restarted` counts them.
  The work they had done is lost, and a call restarts at every load that finds it running: loads sent more often
  than a call takes would starve it (``wait`` does not);
* ``"step"`` (wake, a prefix-cache reset, a weight read, a cancel): it runs at the next step boundary and the calls
  in flight go on;
* ``"idle"`` (sleep; a weight load and a prefix-cache reset under the server's ``wait`` policy, the default): it
  runs once no call is in flight; calls queued after it wait for it.

Which control takes which is the samplers' choice (their docstrings say it; the server's
``--in-flight-on-weight-load restart|wait`` picks the weight load's).

No step ever runs on half-updated weights, and no call spans a weight change: each call is stamped with the weight
version current when it was (last) admitted (:attr:`Call.weight_version`), which is the version it ran on from first
token to last. What is not here: the engines (:class:`StepCore` implementations live next to each sampler), building the
``/generate`` answer (done by the caller, off the loop thread, so the next step is not delayed).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = ["WHEN", "Call", "ContinuousLoop", "LoopClosed", "Pending", "StepCore", "When"]

logger = logging.getLogger("arctic_rl.server")

_ids = itertools.count(1)

#: what a control operation does with the calls in flight (see the module docstring)
When = Literal["idle", "step", "restart"]
WHEN: tuple[str, ...] = ("idle", "step", "restart")


class LoopClosed(RuntimeError):
    """The sampling job was destroyed (or its loop failed) before the call was answered."""


@dataclass(eq=False)
class Call:
    """One ``/generate`` call in the loop: what the core needs to run it, and where its answer goes."""

    payload: Any
    future: Future = field(default_factory=Future)
    call_id: int = field(default_factory=lambda: next(_ids))
    #: the weight version the call's sequences ran on (set when the call is admitted, again when restarted)
    weight_version: int = 0
    #: times the call was taken out of the engine by a weight load and admitted again from its prompts
    restarts: int = 0
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
        """Drop ``call``'s sequences from the running batch (a later ``admit`` of the same call starts it afresh
        from its payload: same prompts, same seeds)."""

    def has_room(self, call: Call, admitting: list[Call]) -> bool:
        """Whether ``call`` fits beside the running batch and the calls being admitted with it (a call that does
        not waits, in order; an idle core takes any)."""


@dataclass(eq=False)
class _Control:
    fn: Callable[[], Any]
    when: When = "idle"
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
        #: calls answered, steps run, and calls restarted by a ``"restart"`` control so far (``info()``, tests)
        self.answered = 0
        self.steps = 0
        self.restarted = 0
        self._restarting: list[Call] = []  # calls taken out by a "restart" control that is running

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
            waiting = self._queue if call in self._queue else self._restarting if call in self._restarting else None
            if waiting is not None:
                waiting.remove(call)
                if not call.future.cancel() and not call.future.done():  # a restarted call waiting to re-enter
                    call.future.set_exception(CancelledError())
                return
        if call in self._active:
            self.control(lambda: None, when="step", before=lambda: self._drop(call))

    def control(self, fn: Callable[[], Any], *, when: When = "idle",
                before: Callable[[], None] | None = None) -> Any:
        """Run ``fn`` on the loop's thread between two steps and return its result; ``when`` says what happens to
        the calls in flight (module docstring). From the loop's own thread ``fn`` runs at once."""
        if when not in WHEN:
            raise ValueError(f"when: expected one of {list(WHEN)}, got {when!r}")
        if threading.current_thread() is self._thread:
            return fn()
        with self._cond:
            if self._closed:
                raise LoopClosed(f"the {self.name} was closed")
            op = _Control(fn, when, before)
            self._start()
            self._queue.append(op)
            self._cond.notify_all()
        return op.future.result()

    def in_flight(self) -> int:
        """Calls admitted and not yet answered, plus calls queued."""
        with self._cond:
            return len(self._active) + len(self._restarting) + sum(isinstance(x, Call) for x in self._queue)

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
        """Under the lock: the calls to admit now, or the control operation whose turn it is. The first control
        queued decides: one that does not wait for idle runs now (calls queued ahead of it are admitted after it);
        one that does lets the calls ahead of it in, then waits for every call in flight to end."""
        while not self._closed and not self._queue and not self._active:
            self._cond.wait()
        first = next((i for i, item in enumerate(self._queue) if isinstance(item, _Control)), None)
        if first is not None and self._queue[first].when != "idle":
            op = self._queue[first]
            del self._queue[first]
            return [], op
        admit: list[Call] = []
        while self._queue and isinstance(self._queue[0], Call):
            if (self._active or admit) and not self.core.has_room(self._queue[0], admit):
                break  # the batch is full: the call waits (in order) for running ones to end
            admit.append(self._queue.popleft())
        if self._queue and isinstance(self._queue[0], _Control) and not self._active and not admit:
            return admit, self._queue.popleft()
        return admit, None

    def _run(self) -> None:
        while True:
            with self._cond:
                admit, op = self._next_items()
                if self._closed:
                    active, self._active = self._active, []
                    break
            for call in admit:
                if call.future.running() or call.future.set_running_or_notify_cancel():  # running: restarted
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
        taken: list[Call] = []
        if op.when == "restart" and self._active:
            with self._cond:
                taken, self._active = self._active, []
                self._restarting = taken
            for call in taken:  # out of the engine before the weights change: none of their steps sees both
                self.core.abort(call)
                call.restarts += 1
        result: Any = None
        error: BaseException | None = None
        try:
            if op.before is not None:
                op.before()
            result = op.fn()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            error = exc
        if taken:
            self._readmit(len(taken))
        if error is not None:
            op.future.set_exception(error)
        else:
            op.future.set_result(result)

    def _readmit(self, count: int) -> None:
        """Queue the calls a ``"restart"`` control took out (less those cancelled meanwhile) ahead of all others."""
        self.restarted += count
        logger.info("%s: %d calls in flight restarted from their prompts after a weight load", self.name, count)
        with self._cond:
            back, self._restarting = self._restarting, []
            if not self._closed:
                self._queue.extendleft(reversed(back))  # in their old order
                return
        for call in back:  # closed while the control ran
            if not call.future.done():
                call.future.set_exception(LoopClosed(f"the {self.name} was closed"))

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
