"""How a ZoRRO call's rows are grouped into passes: as few as fit the token bound of the plain passes.

The server runs a call as a sequence of passes -- a ``/forward-backward``'s
``gradient_accumulation_steps`` micro-batches, a ``/forward``'s row chunks of at most
``max_token_len`` tokens -- sized by the client for the plain pass, which computes ``B*(P+R)``
tokens. ZoRRO's pass over the same rows computes ``U*P + B*R`` (:mod:`arctic_rl.server.zorro.rule`),
often a fifth of that, so run pass by pass it leaves the GPU mostly idle: at SmolLM2-135M's size a
16-row ZoRRO pass is almost all fixed cost (about 90 ms of launches and compiled-graph calls against
30 ms of kernels on one H200; ``benchmarks/zorro_gpu_passes.py``). With ZoRRO the server therefore
packs the rows of several plain passes into one pass that computes no more tokens than one plain
pass would have:

* ``/forward-backward`` (:func:`merge_micro_batches`): consecutive micro-batches are merged while the
  merged pass computes at most one plain micro-batch's ``rows*(P+R)`` tokens. The loss is still
  computed per micro-batch and summed, so the gradient is the same sum as micro-batch by micro-batch.
* ``/forward`` (:func:`plan_row_passes`): the rows, in order and a prompt's rows kept together where
  they fit, in passes of at most ``max_token_len`` ZoRRO tokens (one pass when there is no bound).

Activation memory follows the tokens a pass computes, so it stays within what the plain passes use;
the logits (``rows*R`` positions) grow with the rows of a pass, and are the smaller part wherever ZoRRO
pays (long prompts, short responses).

What is not here: whether ZoRRO runs at all (:mod:`arctic_rl.server.zorro.rule`,
:mod:`arctic_rl.server.zorro.tuner`) and the passes themselves (:mod:`arctic_rl.server.zorro.forward`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge_micro_batches", "plan_row_passes", "zorro_pass_tokens"]


def zorro_pass_tokens(groups: torch.Tensor, start: int, stop: int, prompt_len: int, response_len: int) -> int:
    """Tokens ZoRRO computes for rows ``[start, stop)``: distinct prompts x P + rows x R.

    ``groups`` is the call's ``row_to_group`` (:func:`arctic_rl.server.zorro.forward.group_prompts`): rows with
    the same value have byte-identical prompts.
    """
    if stop <= start:
        return 0
    return int(groups[start:stop].unique().numel()) * int(prompt_len) + (stop - start) * int(response_len)


def merge_micro_batches(
    groups: torch.Tensor,
    micro_batches: Sequence[tuple[int, int]],
    prompt_len: int,
    response_len: int,
    budget: int,
) -> list[list[tuple[int, int]]]:
    """Consecutive micro-batches merged into ZoRRO passes of at most ``budget`` tokens each.

    Returns the passes, each a list of the ``[start, stop)`` micro-batches it holds, in order (every
    micro-batch exactly once). A micro-batch that alone exceeds ``budget`` is a pass of its own.
    """
    passes: list[list[tuple[int, int]]] = []
    for micro in micro_batches:
        if passes:
            start = passes[-1][0][0]
            if zorro_pass_tokens(groups, start, micro[1], prompt_len, response_len) <= budget:
                passes[-1].append(micro)
                continue
        passes.append([micro])
    return passes


def _runs(groups: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of consecutive rows with the same prompt."""
    values = groups.tolist()
    runs, start = [], 0
    for row in range(1, len(values) + 1):
        if row == len(values) or values[row] != values[start]:
            runs.append((start, row))
            start = row
    return runs


def plan_row_passes(
    groups: torch.Tensor, prompt_len: int, response_len: int, budget: int | None
) -> list[tuple[int, int]]:
    """The ``[start, stop)`` row ranges of a ``/forward``'s ZoRRO passes (each at least one row).

    Runs of consecutive rows with the same prompt are added whole while the pass stays within
    ``budget`` ZoRRO tokens; a run that does not fit in an empty pass is cut into pieces that do
    (a single row over the budget is a pass of its own). ``budget=None``: one pass.
    """
    rows = int(groups.numel())
    if budget is None or rows == 0:
        return [(0, rows)] if rows else []
    passes: list[tuple[int, int]] = []
    start = None  # the open pass's first row
    for run_start, run_stop in _runs(groups):
        if start is not None and zorro_pass_tokens(groups, start, run_stop, prompt_len, response_len) <= budget:
            continue  # the whole run joins the open pass
        if start is not None:
            passes.append((start, run_start))
        start = run_start
        # the run alone: cut it while it does not fit (one prompt, so P + rows x R)
        per_piece = max(1, (budget - int(prompt_len)) // max(1, int(response_len)))
        while run_stop - start > per_piece:
            passes.append((start, start + per_piece))
            start += per_piece
    if start is not None:
        passes.append((start, rows))
    return passes
