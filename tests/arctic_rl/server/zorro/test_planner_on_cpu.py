"""The one ZoRRO pass choice (:class:`arctic_rl.server.zorro.planner.ZorroPlanner`) both call paths use:
the rule's verdict picks ZoRRO's or the plain passes, an unsupported model keeps the plain passes without
asking for ZoRRO's, the tuner alternates the passes while it times them, and the metrics follow the plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arctic_rl.server.zorro import planner as planner_module
from arctic_rl.server.zorro.planner import ZorroPlan, ZorroPlanner


def _batch(rows: int = 4, prompt_len: int = 6, response_len: int = 2) -> SimpleNamespace:
    """``rows`` rows that share one prompt: ZoRRO computes ``P + B*R`` tokens instead of ``B*(P+R)``."""
    prompt = torch.arange(1, prompt_len + 1).repeat(rows, 1)
    response = torch.arange(100, 100 + rows * response_len).view(rows, response_len)
    ids = torch.cat([prompt, response], dim=1)
    mask = torch.ones_like(ids)
    return SimpleNamespace(input_ids=ids, attention_mask=mask, prompt_len=prompt_len,
                           position_ids=torch.arange(ids.shape[1]).repeat(rows, 1))


PLAIN = [[(0, 2)], [(2, 4)]]
MERGED = [[(0, 2), (2, 4)]]


@pytest.fixture
def supported(monkeypatch):
    monkeypatch.setattr(planner_module, "zorro_unsupported_reason", lambda model: None)


def test_the_rule_sends_a_paying_call_to_zorros_passes(supported):
    seen = []
    planner = ZorroPlanner("training", "/forward-backward", min_saving=0.0)
    plan = planner.plan(object(), _batch(), PLAIN, lambda groups: seen.append(groups.tolist()) or MERGED)
    assert seen == [[0, 0, 0, 0]]  # one prompt group
    assert plan.use_zorro and plan.passes == MERGED
    assert plan.rule is not None and plan.rule.unique_prompts == 1  # counted in the merged pass
    assert planner.metrics(plan)["zorro_applied"] == 1.0


def test_a_call_that_would_not_pay_keeps_the_plain_passes(supported):
    planner = ZorroPlanner("log_prob", "/forward", min_saving=0.99)
    plan = planner.plan(object(), _batch(), PLAIN, lambda groups: MERGED)
    assert not plan.use_zorro and plan.passes == PLAIN
    assert plan.rule is not None and not plan.rule.use_zorro
    assert planner.metrics(plan)["zorro_applied"] == 0.0


def test_a_model_that_cannot_run_zorro_keeps_its_plain_passes(monkeypatch):
    monkeypatch.setattr(planner_module, "zorro_unsupported_reason", lambda model: "no ZoRRO here")

    def merge(groups):
        raise AssertionError("ZoRRO's passes were laid out for a model that cannot run them")

    plan = ZorroPlanner("training", "/forward", min_saving=0.0).plan(object(), _batch(), PLAIN, merge)
    assert plan.passes == PLAIN


def test_the_tuner_alternates_the_passes_while_it_times_them(supported):
    planner = ZorroPlanner("training", "/forward-backward", min_saving=0.0, trials=2)
    taken = []
    for _ in range(4):
        plan = planner.plan(object(), _batch(), PLAIN, lambda groups: MERGED)
        taken.append(plan.use_zorro)
        assert plan.passes == (MERGED if plan.use_zorro else PLAIN)
        planner.record(plan, 0.01)
    assert taken == [True, False, True, False]  # ZoRRO first, then alternating


def test_a_call_that_did_not_ask_for_zorro_reports_nothing_and_records_nothing(supported):
    planner = ZorroPlanner("training", "/forward", min_saving=0.0, trials=2)
    plain = ZorroPlan(passes=PLAIN)
    planner.record(plain, 1.0)
    assert not plain.use_zorro and planner.metrics(plain) == {}
    # nothing was timed: the first call that asks for ZoRRO still takes ZoRRO's pass, then the plain one
    first = planner.plan(object(), _batch(), PLAIN, lambda groups: MERGED)
    planner.record(first, 0.01)
    assert first.use_zorro and not planner.plan(object(), _batch(), PLAIN, lambda groups: MERGED).use_zorro
