"""Settling an unanswered training call: was it applied? The server's own counters decide.

A mutating call that got no answer (:class:`~.http.AmbiguousCallError`) on a server that does not
replay ``X-Request-Id``s is settled with ``GET /job/{id}``: ``global_step`` for ``/step``,
``pending_forward_backward`` for ``/forward-backward`` (one per mini-batch, then ``/step``). One
more than before the call means it was applied (:data:`Outcome.APPLIED`: not re-sent), unchanged
means it was not (re-sent as a new call); a server that exposes neither (the vendor's) cannot tell,
nor can a counter that moved by more than one or went back (:data:`Outcome.UNKNOWN`: the training
job is rebuilt, :mod:`.restore`).

What is not here: what is done with the outcome (:mod:`.recovery`).
"""

from __future__ import annotations

import enum
import logging
import time

from arctic_rl.protocol import Paths

from .http import ArcticHttp

__all__ = ["Outcome", "outcome_of", "read_counter", "settle"]

logger = logging.getLogger(__name__)

_POLL_S = 0.5


class Outcome(str, enum.Enum):
    """What the server's counter says about an unanswered call."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    UNKNOWN = "unknown"


def read_counter(http: ArcticHttp, job_id: int, counter: str) -> tuple[int | None, dict]:
    """``GET /job/{id}``'s integer ``counter`` (``None`` when the server does not expose it)."""
    info = http.get_json(Paths.job(job_id))
    value = info.get(counter) if isinstance(info, dict) else None
    if isinstance(value, bool) or not isinstance(value, int):
        return None, info if isinstance(info, dict) else {}
    return value, info


def outcome_of(before: int, now: int | None) -> Outcome:
    """What a counter that was ``before`` before the call and is ``now`` says: one more is
    :data:`Outcome.APPLIED`, unchanged :data:`Outcome.NOT_APPLIED`; anything else -- no counter, a
    jump of more than one, a counter that went back (another client, a checkpoint loaded meanwhile)
    -- cannot tell (:data:`Outcome.UNKNOWN`)."""
    if now is None:
        return Outcome.UNKNOWN
    if now == before + 1:
        return Outcome.APPLIED
    if now == before:
        return Outcome.NOT_APPLIED
    return Outcome.UNKNOWN


def settle(http: ArcticHttp, job_id: int, what: str, counter: tuple[str, int] | None, *, wait_s: float) -> Outcome:
    """Was the unanswered call ``what`` applied to job ``job_id``? ``counter`` is ``(name, value before
    the call)``; while the job says it is ``busy`` (the call may still be computing) it is read again,
    up to ``wait_s``."""
    if counter is None:
        return Outcome.UNKNOWN
    name, before = counter
    value, info = read_counter(http, job_id, name)
    deadline = time.monotonic() + wait_s
    while info.get("busy") is True and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        value, info = read_counter(http, job_id, name)
    outcome = outcome_of(before, value)
    logger.warning("arctic: %s got no answer and the server does not replay request ids: its %s is %s (was %d "
                   "before the call) -> %s", what, name, value, before,
                   {Outcome.APPLIED: "it was applied; not re-sending",
                    Outcome.NOT_APPLIED: "it was not applied; re-sending",
                    Outcome.UNKNOWN: "cannot tell; rebuilding the training job from the checkpoint and journal"}
                   [outcome])
    return outcome
