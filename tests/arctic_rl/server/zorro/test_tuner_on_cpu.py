"""The server's ZoRRO tuner: of the calls the token rule sends to ZoRRO, a job times both passes and keeps the faster.

Unit tests of :class:`arctic_rl.server.zorro.tuner.ZorroTuner` with given times (the order of the passes
while measuring, untimed warm-ups, the verdict either way, re-timing the other pass, ``trials=0``, bad
settings, the bound on measuring calls, a decisive first timing), and the settings that turn it on
(``--zorro-trials``, ``$ARCTIC_RL_ZORRO_TRIALS``, the adapter's ``server.local.zorro_trials``).
``test_rule_on_cpu.py`` runs it inside a real server.
"""

from __future__ import annotations

import pytest

from arctic_rl.server.__main__ import parse_args
from arctic_rl.server.settings import ServerSettings
from arctic_rl.server.zorro.rule import ZorroChoice
from arctic_rl.server.zorro.tuner import DEFAULT_TRIALS, ZorroTuner, default_max_trial_calls
from tests.support.server import check_server_flag


def _run(tuner: ZorroTuner, calls: int, seconds: dict[bool, float], warm: set[bool] | None = None) -> list[bool]:
    """``calls`` calls of 1000 plain-pass tokens; a pass takes ``seconds[pass]``, 10x that on its first run.

    ``warm``: the passes already run (a set shared by the calls of one test), updated here.
    """
    warm = set() if warm is None else warm
    taken = []
    for _ in range(calls):
        zorro = tuner.use_zorro()
        tuner.record(zorro, seconds[zorro] * (1 if zorro in warm else 10), 1000)
        warm.add(zorro)
        taken.append(zorro)
    return taken


def test_the_passes_alternate_zorro_first_until_each_is_timed():
    tuner = ZorroTuner("training", "/forward-backward", trials=2)
    assert tuner.measuring and tuner.time_ratio() is None and tuner.metrics() == {}
    assert _run(tuner, 6, {True: 1.0, False: 1.5}) == [True, False, True, False, True, False]
    assert not tuner.measuring
    # the 10x warm-ups are not in the medians
    assert tuner.time_ratio() == pytest.approx(2 / 3)
    assert tuner.metrics() == {"zorro_time_ratio": pytest.approx(2 / 3)}


@pytest.mark.parametrize("zorro_s, plain_s, keeps", [(1.0, 2.0, True), (4.5, 1.0, False)])
def test_a_decisive_first_timing_ends_the_measuring(zorro_s, plain_s, keeps):
    """Each pass timed once and one took twice the other's time or more: settled after four calls, the slower
    pass run twice (its warm-up and one timed call) instead of ``trials + 1`` times."""
    tuner = ZorroTuner("training", "/forward-backward", trials=2, recheck_every=100)
    taken = _run(tuner, 10, {True: zorro_s, False: plain_s})
    assert taken == [True, False, True, False] + [keeps] * 6 and not tuner.measuring and tuner.trial_calls == 4
    # just short of the margin: the measuring goes on to trials + 1 runs a pass
    tuner = ZorroTuner("training", "/forward-backward", trials=2, decisive=2.5)
    assert _run(tuner, 6, {True: 1.0, False: 2.0}) == [True, False] * 3 and not tuner.measuring


@pytest.mark.parametrize("zorro_s, plain_s, keeps", [(1.0, 2.0, True), (1.3, 1.0, False)])
def test_the_faster_pass_is_kept(zorro_s, plain_s, keeps, caplog):
    tuner = ZorroTuner("training", "/forward", trials=2, recheck_every=100)
    with caplog.at_level("INFO", logger="arctic_rl.server.zorro.tuner"):
        taken = _run(tuner, 30, {True: zorro_s, False: plain_s})
    assert taken[6:] == [keeps] * 24
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1  # logged once, when the verdict is reached
    assert ("timed ZoRRO's pass faster" if keeps else "timed the plain pass faster") in lines[0]
    assert lines[0].startswith("training job, /forward:")


def test_times_are_compared_per_plain_pass_token():
    """A call with twice the tokens may take twice as long without counting as slower."""
    tuner = ZorroTuner("training", "/forward", trials=1)
    for zorro, seconds, tokens in [(True, 9.0, 1), (False, 9.0, 1), (True, 3.0, 2000), (False, 2.0, 1000)]:
        assert tuner.use_zorro() is zorro
        tuner.record(zorro, seconds, tokens)
    assert tuner.time_ratio() == pytest.approx(0.75)
    assert tuner.use_zorro() is True


def test_the_other_pass_is_retimed_and_a_drift_flips_the_verdict():
    tuner, warm = ZorroTuner("training", "/forward-backward", trials=1, recheck_every=4), set()
    _run(tuner, 4, {True: 1.0, False: 2.0}, warm)  # settled: ZoRRO
    taken = _run(tuner, 8, {True: 1.0, False: 2.0}, warm)
    assert taken == [True, True, True, False, True, True, True, False]  # every 4th re-times the plain pass
    # the responses grew: ZoRRO's pass is now the slower; its next timed call replaces the old sample
    taken = _run(tuner, 4, {True: 3.0, False: 2.0}, warm)
    assert taken == [True, False, False, True]  # the plain pass from then on, ZoRRO re-timed on the 4th
    assert tuner.time_ratio() == pytest.approx(1.5)


def test_only_calls_the_token_rule_sends_to_zorro_are_chosen_and_timed():
    tuner = ZorroTuner("training", "/forward-backward", trials=1)
    plain_rule = ZorroChoice(False, rows=8, unique_prompts=8, prompt_len=4, response_len=4, saving=0.0, min_saving=0.55)
    assert tuner.choose(plain_rule) is plain_rule
    tuner.record_call(plain_rule, plain_rule, 99.0)  # not counted: the rule chose the plain pass itself
    assert tuner.measuring and tuner.time_ratio() is None
    rule = ZorroChoice(True, rows=8, unique_prompts=2, prompt_len=24, response_len=3, saving=0.67, min_saving=0.55)
    picked = []
    for seconds in (9.0, 9.0, 2.16, 4.32):  # warm-ups, then ZoRRO at half the plain pass's time
        chosen = tuner.choose(rule)
        assert (chosen.rows, chosen.saving) == (rule.rows, rule.saving)
        tuner.record_call(rule, chosen, seconds)
        picked.append(chosen.use_zorro)
    assert picked == [True, False, True, False]
    assert tuner.time_ratio() == pytest.approx(0.5) and tuner.choose(rule).use_zorro


@pytest.mark.parametrize("trials", [1, 2, 5])
def test_measuring_takes_at_most_max_trial_calls_and_the_slower_pass_trials_plus_one(trials):
    """The bound behind a job's first steps: the measuring ends after ``2 * (trials + 1)`` calls, the slower pass
    (3x here) runs ``trials + 1`` of them, then once per ``recheck_every`` calls."""
    tuner = ZorroTuner("training", "/forward-backward", trials=trials, recheck_every=10, decisive=None)
    assert tuner.max_trial_calls == default_max_trial_calls(trials) == 2 * (trials + 1)
    taken = _run(tuner, 2 * (trials + 1) + 20, {True: 3.0, False: 1.0})
    measuring, settled = taken[: 2 * (trials + 1)], taken[2 * (trials + 1):]
    assert measuring.count(True) == trials + 1 and tuner.trial_calls == 2 * (trials + 1) and not tuner.measuring
    assert settled.count(True) == 2 and settled[9] is True and settled[19] is True  # the rechecks only


def test_calls_that_are_never_timed_still_spend_the_measuring_calls():
    """Counted when chosen: calls that fail (never recorded) cannot keep a job measuring; it settles on what it
    has -- the faster median, or ZoRRO (the token rule's verdict) when a pass has no timed sample."""
    tuner = ZorroTuner("training", "/forward-backward", trials=2, max_trial_calls=3)
    assert [tuner.use_zorro() for _ in range(3)] == [True, True, True]  # nothing recorded: ZoRRO's turn each time
    assert tuner.trial_calls == 3 and not tuner.measuring
    assert [tuner.use_zorro() for _ in range(5)] == [True] * 5 and tuner.trial_calls == 3
    tuner = ZorroTuner("training", "/forward-backward", trials=2, max_trial_calls=4)
    assert _run(tuner, 4, {True: 3.0, False: 1.0}) == [True, False, True, False]  # one timed sample each
    assert not tuner.measuring and tuner.time_ratio() == pytest.approx(3.0)
    assert tuner.use_zorro() is False
    tuner = ZorroTuner("log_prob", "/forward", trials=2, max_trial_calls=0)
    assert not tuner.measuring and tuner.use_zorro() is True and tuner.trial_calls == 0
    with pytest.raises(ValueError, match="max_trial_calls: expected an integer >= 0"):
        ZorroTuner("training", "/forward", max_trial_calls=-1)
    assert default_max_trial_calls(0) == 0


def test_zero_trials_takes_zorro_always():
    tuner = ZorroTuner("log_prob", "/forward", trials=0)
    assert _run(tuner, 5, {True: 5.0, False: 1.0}) == [True] * 5
    assert not tuner.measuring and not tuner.timing and tuner.metrics() == {}


def test_bad_settings_are_refused_naming_them(monkeypatch):
    with pytest.raises(ValueError, match=r"trials: expected an integer >= 0 .*got -1"):
        ZorroTuner("training", "/forward", trials=-1)
    with pytest.raises(ValueError, match=r"recheck_every: expected an integer >= 2, got 1"):
        ZorroTuner("training", "/forward", recheck_every=1)
    for bad in (1.0, 0.5, True, "2"):
        with pytest.raises(ValueError, match=rf"decisive: expected a number > 1 .*got {bad!r}"):
            ZorroTuner("training", "/forward", decisive=bad)
    with pytest.raises(ValueError, match=r"zorro_trials: expected an integer >= 0 .*got 1.5"):
        ServerSettings(zorro_trials=1.5)
    assert ServerSettings().zorro_trials == DEFAULT_TRIALS
    check_server_flag(monkeypatch, "--zorro-trials", "ARCTIC_RL_ZORRO_TRIALS", bad="-1", good=("0", 0),
                      from_env=("5", 5), bad_env="some")


def test_the_adapter_passes_its_trials_to_a_local_server():
    """``remote_backend.server.local.zorro_trials``: null keeps the server's default; a count becomes the flag."""
    from verl.remote_backend.errors import RemoteBackendConfigError
    from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
    from verl.workers.remote_client.arctic.local_server import _extra_args

    local = ArcticConfig.from_dict({"server": {"local": {"zorro_trials": 3, "zorro_min_saving": 0.5}}}).server.local
    assert _extra_args(local) == ("--zorro-min-saving", "0.5", "--zorro-trials", "3")
    assert parse_args(list(_extra_args(local))).zorro_trials == 3
    with pytest.raises(RemoteBackendConfigError, match=r"server\.local\.zorro_trials.*-2"):
        ArcticConfig.from_dict({"server": {"local": {"zorro_trials": -2}}})
