"""Recovery's decisions as pure functions, each branch in milliseconds (no server).

The server-process tests next to this file (``test_reliability_*``, ``test_recovery_reentrant``)
drive the same decisions through real failures; these pin every branch down.
"""

from __future__ import annotations

import pytest

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
