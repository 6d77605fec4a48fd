"""When a ZoRRO request takes the ZoRRO pass, and when the plain pass is the faster way to the same numbers.

ZoRRO (:mod:`arctic_rl.server.zorro.forward`) pushes each unique prompt through the model once and the
responses after it, so a call computes ``U*P + B*R`` tokens instead of the plain pass's ``B*(P+R)``
(``B`` rows, ``U`` unique prompts, ``P`` prompt width, ``R`` response width, padded as the batch is).
Its response pass costs more per token than a plain pass (the responses attend to the shared prompt
keys through FlexAttention or expanded keys), so it only pays when it removes enough tokens. On one
H200 (``benchmarks/RESULTS.md`` §2.0 and §2c) ZoRRO was 1.33-1.5x *slower* when it removed 29% of the
tokens (256-token prompts, 512-token responses, n=8) and 2.24x faster when it removed 70% (2K-token
prompts): per computed token it cost 1.5-2.1x a plain token, which puts the break-even between 33% and
52% saved.

The rule: take the ZoRRO pass when the share of tokens it saves,
``saving = 1 - (U*P + B*R) / (B*(P+R))``, is at least ``min_saving`` (the server's
``--zorro-min-saving``, default :data:`DEFAULT_MIN_SAVING`); otherwise run the plain pass. Both give
the same log-probs (to float precision) in the same response-aligned layout, so the choice changes
speed only. ``U`` is counted per pass (per micro-batch of a ``/forward-backward``, per row chunk of a
``/forward``), since each pass deduplicates only its own rows. ``min_saving=0`` takes ZoRRO whenever
it is asked for; ``min_saving>1`` never does.

What is not here: the passes themselves (:mod:`arctic_rl.server.compute.token_logprobs`, :mod:`arctic_rl.server.zorro.forward`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from arctic_rl.server.zorro.forward import group_prompts

__all__ = ["DEFAULT_MIN_SAVING", "ZorroChoice", "ZorroChoiceLog", "choose_zorro", "row_slices"]

logger = logging.getLogger(__name__)

#: default share of tokens ZoRRO must save to be taken (see the module docstring for the measurements)
DEFAULT_MIN_SAVING = 0.55


@dataclass(frozen=True)
class ZorroChoice:
    """The rule's answer for one call: the path taken and the token counts it was decided on."""

    use_zorro: bool
    rows: int  # B, summed over the call's passes
    unique_prompts: int  # U, summed over the call's passes
    prompt_len: int  # P
    response_len: int  # R
    saving: float  # share of the plain pass's tokens that ZoRRO would not compute
    min_saving: float

    @property
    def plain_tokens(self) -> int:
        return self.rows * (self.prompt_len + self.response_len)

    @property
    def zorro_tokens(self) -> int:
        return self.unique_prompts * self.prompt_len + self.rows * self.response_len

    def describe(self) -> str:
        path = "ZoRRO pass" if self.use_zorro else "plain pass"
        relation = ">=" if self.use_zorro else "<"
        return (
            f"{path}: ZoRRO would compute {self.zorro_tokens} of {self.plain_tokens} tokens "
            f"(B={self.rows}, U={self.unique_prompts}, P={self.prompt_len}, R={self.response_len}), "
            f"saving {self.saving:.0%} {relation} --zorro-min-saving {self.min_saving:.0%}"
        )

    def metrics(self) -> dict[str, float]:
        """What a call reports about the choice (the adapter forwards these to verl's tracking)."""
        return {"zorro_applied": float(self.use_zorro), "zorro_token_saving": float(self.saving)}


def row_slices(rows: int, step: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` row ranges of passes of ``step`` rows (the last may be shorter)."""
    if step < 1:
        raise ValueError(f"step: expected >= 1 rows per pass, got {step}")
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def choose_zorro(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    min_saving: float,
    passes: Iterable[tuple[int, int]] | None = None,
    position_ids: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> ZorroChoice:
    """Decide between the ZoRRO and the plain pass for a ``[B, P+R]`` call (see the module docstring).

    ``passes`` are the row ranges the call will be run in (default: one pass over all rows); unique
    prompts are counted inside each, as ZoRRO would group them. ``groups``: the call's ``row_to_group``
    (:func:`~arctic_rl.server.zorro.forward.group_prompts`) when the caller has it already; else it is computed.
    """
    if not min_saving >= 0.0:
        raise ValueError(f"min_saving: expected a share >= 0, got {min_saving!r}")
    rows, total = int(input_ids.shape[0]), int(input_ids.shape[1])
    p = int(prompt_len)
    r = total - p
    ranges = list(passes) if passes is not None else [(0, rows)]
    if groups is None and rows:
        _, groups = group_prompts(input_ids, attention_mask, p, position_ids=position_ids)
    # rows share a group iff their prompts are byte-identical, so a pass's unique prompts are its distinct groups
    unique = sum(int(groups[start:stop].unique().numel()) for start, stop in ranges if stop > start)
    plain = rows * total
    saving = 1.0 - (unique * p + rows * r) / plain if plain else 0.0
    return ZorroChoice(
        use_zorro=bool(rows) and saving >= float(min_saving),
        rows=rows,
        unique_prompts=unique,
        prompt_len=p,
        response_len=r,
        saving=saving,
        min_saving=float(min_saving),
    )


class ZorroChoiceLog:
    """Logs a job's ZoRRO choice at INFO when the path changes (the first call included), else at DEBUG."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._last: bool | None = None

    def record(self, call: str, choice: ZorroChoice) -> None:
        level = logging.INFO if choice.use_zorro is not self._last else logging.DEBUG
        self._last = choice.use_zorro
        logger.log(level, "%s job, %s: %s", self.job, call, choice.describe())
