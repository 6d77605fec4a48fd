"""Reward of the arithmetic task: 1.0 when the last number of the answer equals the result, else 0.0.

Plugged into verl the standard way (verl loads the file by path; nothing of this repository is imported)::

    reward.custom_reward_function.path=examples/arithmetic/reward.py
    reward.custom_reward_function.name=compute_score

verl's reward manager decodes each response (special tokens skipped) and calls ``compute_score(data_source=...,
solution_str=..., ground_truth=..., extra_info=...)``. Only the LAST number of the answer counts, so
"17 + 25 = 42" and "The answer is 42." both score 1, and "42 - no, 43" scores 0. Numbers are read
forgivingly: a sign (``-``, or the unicode minus ``−``) where it is not a subtraction between two numbers,
thousands separators ("1,234"), a trailing point or zero decimals ("42.", "42.0" equal 42). An answer with
no number (empty, "I don't know") scores 0. The file is deliberately self-contained.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

DATA_SOURCE = "arithmetic"

# A number: an optional sign, digits (with comma-separated thousands groups, or plain), optional decimals. It
# never starts right after a digit or a point, so "10-3" reads as 10 and 3 (a subtraction), not 10 and -3.
_NUMBER = re.compile(r"(?<![\d.])([-\u2212]?)((?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?)")


def numbers_in(text: str) -> list[Decimal]:
    """The numbers of ``text`` in order of appearance (see the module docstring for what counts as one)."""
    found = []
    for sign, digits in _NUMBER.findall(text):
        value = Decimal(digits.replace(",", ""))
        found.append(-value if sign else value)
    return found


def last_number(text: str) -> Decimal | None:
    """The last number of ``text``, or None when it has none."""
    found = numbers_in(text)
    return found[-1] if found else None


def _expected(ground_truth: Any) -> Decimal:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        raise TypeError(f"ground_truth: expected the result as a string or number, got {type(ground_truth).__name__}")
    text = str(ground_truth).strip().replace("\u2212", "-").replace(",", "")
    try:
        return Decimal(text)
    except InvalidOperation:
        raise ValueError(f"ground_truth: expected a number such as '42', got {ground_truth!r}") from None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """verl custom reward: 1.0 when :func:`last_number` of the response equals ``ground_truth``, else 0.0.

    ``extra_info`` and any further keyword arguments verl passes are accepted and ignored.
    """
    if data_source != DATA_SOURCE:
        raise ValueError(
            f"data_source: this reward scores only {DATA_SOURCE!r} rows, got {data_source!r} "
            "(set reward.custom_reward_function only for arithmetic data)"
        )
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str: expected str, got {type(solution_str).__name__}")
    expected = _expected(ground_truth)
    got = last_number(solution_str)
    return 1.0 if got is not None and got == expected else 0.0
