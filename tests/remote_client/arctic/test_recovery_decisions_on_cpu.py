"""Recovery's decisions as pure functions, each branch in milliseconds (no server): whether a lost call
was applied (``settle.outcome_of``), what to do after a failed send (``recovery.decide``), whether the
server restarted (``restart.judge``), and what a call came to (``recovery.CallResult``).

The server-process tests next to this file (``test_reliability_*``, ``test_recovery_reentrant``)
drive the same decisions through real failures; these pin every branch down.
"""

from __future__ import annotations

import pytest

from verl.remote_backend.errors import RemoteProtocolError
from verl.workers.remote_client.arctic.recovery import Action, CallResult, decide
from verl.workers.remote_client.arctic.restart import judge
from verl.workers.remote_client.arctic.settle import Outcome, outcome_of


@pytest.mark.parametrize(
    "before, now, outcome",
    [
        (0, 1, Outcome.APPLIED),  # one more: applied
        (7, 8, Outcome.APPLIED),
        (0, 0, Outcome.NOT_APPLIED),  # unchanged: not applied
        (7, 7, Outcome.NOT_APPLIED),
        (0, None, Outcome.UNKNOWN),  # no counter (the vendor's server)
        (0, 2, Outcome.UNKNOWN),  # moved by more than one: another client stepped too
        (3, 9, Outcome.UNKNOWN),
        (3, 2, Outcome.UNKNOWN),  # went back: a checkpoint was loaded meanwhile
        (1, 0, Outcome.UNKNOWN),
    ],
)
def test_a_counter_settles_only_unchanged_or_one_more(before, now, outcome):
    assert outcome_of(before, now) is outcome


# ------------------------------------------------------------------------------------------------ decide

FACTS = {"restored": False, "job_gone": False, "ambiguous": True, "safe": False, "replays_ids": False}


@pytest.mark.parametrize(
    "change, action",
    [
        ({"restored": True}, Action.RESEND_NEW),  # new jobs: a new call to them
        ({"restored": True, "job_gone": True}, Action.RESEND_NEW),  # the restore explains the 404
        ({"job_gone": True, "ambiguous": False}, Action.RAISE),  # same server, job destroyed: the run ends
        ({"job_gone": True, "safe": True}, Action.RAISE),
        ({"ambiguous": False}, Action.RESEND_SAME),  # never reached the server
        ({"safe": True}, Action.RESEND_SAME),  # harmless: /forward, /generate, weight sync -- never settled
        ({"safe": True, "replays_ids": True}, Action.RESEND_SAME),
        ({"replays_ids": True}, Action.RESEND_SAME),  # the server answers the same id from its cache
        ({}, Action.SETTLE),  # an update, no replay: ask the counter
        ({"settled": Outcome.APPLIED}, Action.APPLIED),
        ({"settled": Outcome.NOT_APPLIED}, Action.RESEND_NEW),
        ({"settled": Outcome.UNKNOWN}, Action.REBUILD),  # no counter, or one that jumped or went back
        ({"safe": True, "settled": Outcome.UNKNOWN}, Action.RESEND_SAME),  # a harmless call is never rebuilt
        ({"restored": True, "settled": Outcome.APPLIED}, Action.RESEND_NEW),
    ],
)
def test_decide(change, action):
    assert decide(**{**FACTS, **change}) is action


def test_every_action_is_reachable():
    seen = {decide(restored=r, job_gone=g, ambiguous=a, safe=s, replays_ids=i, settled=o)
            for r in (False, True) for g in (False, True) for a in (False, True) for s in (False, True)
            for i in (False, True) for o in (None, *Outcome)}
    assert seen == set(Action)


# ------------------------------------------------------------------------------------------------ CallResult


def test_a_call_result_is_answered_or_applied_with_its_answer_lost():
    answered = CallResult({"global_step": 3})
    assert answered.answered and answered.answer("POST /step") == {"global_step": 3}
    lost = CallResult.lost()
    assert not lost.answered and lost.value is None
    with pytest.raises(RemoteProtocolError, match="applied but its answer was lost"):
        lost.answer("POST /step")


# ------------------------------------------------------------------------------------------------ restart


@pytest.mark.parametrize(
    "known, now, facts, verdict",
    [
        ("a", "a", {"down_seen": True, "jobs_gone": True}, False),  # instance ids decide when both exist
        ("a", "b", {"down_seen": False, "jobs_gone": False}, True),
        (None, "b", {"down_seen": False, "jobs_gone": False}, False),  # nothing failed on the way
        (None, None, {"down_seen": True, "live_jobs": 0}, False),  # no job of ours to look for
        (None, None, {"down_seen": True}, None),  # look the live jobs up first
        (None, None, {"jobs_gone": True}, None),
        (None, None, {"down_seen": True, "jobs_found": [False, True]}, False),  # one still there
        (None, None, {"down_seen": True, "jobs_found": [False, False]}, True),  # all gone after a failure
        (None, None, {"jobs_gone": True, "jobs_found": [False]}, False),  # all gone, no failure: destroyed
    ],
)
def test_judge_a_restart(known, now, facts, verdict):
    assert judge(known, now, **{"down_seen": False, "jobs_gone": False, "live_jobs": 2, **facts}) is verdict
