"""Reward of the reverse-text task: per-position partial credit, as verl's custom reward function.

Plugged into verl the standard way (no import of this repository needed -- verl loads the file
by path)::

    reward.custom_reward_function.path=examples/reverse_text/reward.py
    reward.custom_reward_function.name=compute_score

verl's reward manager decodes the response with ``skip_special_tokens=True`` (so the end-of-turn
token is gone) and calls ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)`` for every sample.

The score is the number of positions where the output equals the reversed string, divided by the
longer of the two lengths: a wrong length costs credit, an empty output scores 0. (An LCS-ratio
credit was measured to be too generous for RL: the warm start already scores high and learning
stalls -- see shared/design/REVERSE_TEXT_RECIPE.md.) This file is deliberately self-contained.
"""

from __future__ import annotations

from typing import Any

DATA_SOURCE = "reverse_text"


def positional_match(output: str, target: str) -> float:
    """Share of positions where ``output`` equals ``target``, over ``max(len(output), len(target))``.

    0.0 when the output is empty (or both strings are).
    """
    longest = max(len(output), len(target))
    if len(output) == 0 or longest == 0:
        return 0.0
    return sum(o == t for o, t in zip(output, target)) / longest


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """verl custom reward: :func:`positional_match` of the decoded response against the reversed string.

    ``extra_info`` and any further keyword arguments verl passes (``reward_router_address``, ...) are
    accepted and ignored.
    """
    if data_source != DATA_SOURCE:
        raise ValueError(
            f"data_source: this reward scores only {DATA_SOURCE!r} rows, got {data_source!r} "
            "(set reward.custom_reward_function only for reverse-text data)"
        )
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str: expected str, got {type(solution_str).__name__}")
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth: expected str (the reversed string), got {type(ground_truth).__name__}")
    return positional_match(solution_str, ground_truth)
