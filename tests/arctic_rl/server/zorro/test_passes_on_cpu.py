"""How a ZoRRO call's rows are grouped into passes (:mod:`arctic_rl.server.zorro.passes`).

Unit tests of the token count of a pass, the merging of a ``/forward-backward``'s micro-batches and the
row passes of a ``/forward`` under a token bound; the end-to-end check (same loss, gradient and log-probs
as the plain passes, through a real server) is in ``test_rule_on_cpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl.server.zorro.passes import merge_micro_batches, plan_row_passes, zorro_pass_tokens


def _groups(*sizes: int) -> torch.Tensor:
    """row_to_group of consecutive prompts with ``sizes`` rows each."""
    return torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])


def _covers(passes, rows: int) -> bool:
    return [r for start, stop in passes for r in range(start, stop)] == list(range(rows))


def test_a_pass_computes_each_distinct_prompt_once_and_every_response():
    groups = torch.tensor([0, 0, 1, 1, 0, 2])  # prompt 0 also comes back after prompt 1
    assert zorro_pass_tokens(groups, 0, 6, 100, 10) == 3 * 100 + 6 * 10
    assert zorro_pass_tokens(groups, 0, 2, 100, 10) == 100 + 20
    assert zorro_pass_tokens(groups, 3, 3, 100, 10) == 0


def test_micro_batches_merge_while_the_pass_fits_one_plain_micro_batch():
    # 16 prompts x 8 rows, 16-row micro-batches, P=1518, R=128: the few-shot recipe's update on one GPU
    groups = _groups(*[8] * 16)
    micro = [(s, s + 16) for s in range(0, 128, 16)]
    passes = merge_micro_batches(groups, micro, 1518, 128, budget=16 * (1518 + 128))
    # a pass of k micro-batches computes 2k prompts and 16k responses: 2k*1518 + 16k*128 <= 26,336 -> k <= 5
    assert [len(p) for p in passes] == [5, 3]
    assert [m for p in passes for m in p] == micro  # every micro-batch once, in order


def test_a_micro_batch_over_the_budget_stays_alone():
    groups = _groups(4, 4, 4)
    micro = [(0, 4), (4, 8), (8, 12)]
    assert merge_micro_batches(groups, micro, 50, 5, budget=10) == [[(0, 4)], [(4, 8)], [(8, 12)]]
    assert merge_micro_batches(groups, micro, 50, 5, budget=10**9) == [micro]
    assert merge_micro_batches(groups, [], 50, 5, budget=100) == []


@pytest.mark.parametrize("budget", [None, 10**9])
def test_without_a_binding_bound_a_forward_is_one_pass(budget):
    assert plan_row_passes(_groups(3, 3, 2), 40, 8, budget) == [(0, 8)]
    assert plan_row_passes(torch.zeros(0, dtype=torch.long), 40, 8, budget) == []


def test_forward_passes_keep_a_prompts_rows_together_where_they_fit():
    groups = _groups(4, 4, 4, 4)
    # each prompt's run costs 100 + 4*10 = 140; two runs 280 fit 300, three (420) do not
    passes = plan_row_passes(groups, 100, 10, 300)
    assert passes == [(0, 8), (8, 16)]
    for start, stop in passes:
        assert zorro_pass_tokens(groups, start, stop, 100, 10) <= 300


def test_a_prompt_too_big_for_one_pass_is_cut_into_pieces_that_fit():
    groups = _groups(2, 10, 2)
    passes = plan_row_passes(groups, 100, 10, 150)  # a piece of one prompt: 100 + 5*10
    assert _covers(passes, 14)
    for start, stop in passes:
        assert zorro_pass_tokens(groups, start, stop, 100, 10) <= 150
    assert passes == [(0, 2), (2, 7), (7, 12), (12, 14)]


def test_a_single_row_over_the_bound_is_a_pass_of_its_own():
    passes = plan_row_passes(_groups(3), 100, 10, 50)
    assert passes == [(0, 1), (1, 2), (2, 3)]
