"""The one ZoRRO pass choice of a call: prompt groups, ZoRRO's passes, the token rule, the tuner's timing.

A call that asks for ZoRRO runs either as ZoRRO's passes or as the plain ones. :class:`ZorroPlanner` makes
that choice the same way for ``/forward`` (:func:`arctic_rl.server.engines.common.forward_logprobs`) and for
``/forward-backward`` (:class:`arctic_rl.server.engines.training.TrainingEngine`):

1. group the call's rows by prompt (:func:`~arctic_rl.server.zorro.forward.group_prompts`);
2. lay out ZoRRO's passes with the caller's ``merge`` (row passes for ``/forward``, micro-batches merged for
   ``/forward-backward``); a model that cannot run ZoRRO keeps the plain passes (its fallback is the plain pass);
3. the token rule (:func:`~arctic_rl.server.zorro.rule.choose_zorro`) says whether deduplicating pays, logged
   when the path changes (:class:`~arctic_rl.server.zorro.rule.ZorroChoiceLog`);
4. among the calls the rule sends to ZoRRO, the job's timings pick the faster pass
   (:class:`~arctic_rl.server.zorro.tuner.ZorroTuner`); :meth:`ZorroPlanner.record` hands the call's time back.

A pass is a list of ``[start, stop)`` row ranges run together (one range for a plain pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from arctic_rl.server.zorro.forward import group_prompts, zorro_unsupported_reason
from arctic_rl.server.zorro.rule import DEFAULT_MIN_SAVING, ZorroChoice, ZorroChoiceLog, choose_zorro
from arctic_rl.server.zorro.tuner import ZorroTuner

__all__ = ["Pass", "ZorroPlan", "ZorroPlanner"]

#: the row ranges one pass runs together
Pass = list[tuple[int, int]]


@dataclass(frozen=True)
class ZorroPlan:
    """A call's passes and, for a call that asked for ZoRRO, the rule's verdict and the pass taken."""

    passes: list[Pass]
    rule: ZorroChoice | None = None
    choice: ZorroChoice | None = None

    @property
    def use_zorro(self) -> bool:
        """Whether the call runs ZoRRO's pass."""
        return self.choice is not None and self.choice.use_zorro


class ZorroPlanner:
    """One job's ZoRRO choice for one call path (``/forward`` or ``/forward-backward``): see the module docstring.

    ``choices`` is the job's log of choices (shared by its call paths); ``trials=0`` turns the timing off.
    """

    def __init__(
        self,
        job: str,
        call: str,
        *,
        min_saving: float = DEFAULT_MIN_SAVING,
        trials: int = 0,
        choices: ZorroChoiceLog | None = None,
    ) -> None:
        self.call = call
        self.min_saving = min_saving
        self.tuner = ZorroTuner(job, call, trials=trials)
        self.choices = choices if choices is not None else ZorroChoiceLog(job)

    @property
    def timing(self) -> bool:
        """Whether calls are timed (a caller synchronises the device before :meth:`record` only then)."""
        return self.tuner.timing

    def plan(
        self,
        model: torch.nn.Module,
        batch,
        plain: list[Pass],
        merge: Callable[[torch.Tensor], list[Pass]],
    ) -> ZorroPlan:
        """The passes of ``batch`` (a :class:`~arctic_rl.server.engines.batch.ParsedBatch`) that asked for
        ZoRRO: ``plain`` or ``merge(row_to_group)``, ZoRRO's, as the rule and the timings say."""
        _, groups = group_prompts(batch.input_ids, batch.attention_mask, batch.prompt_len,
                                  position_ids=batch.position_ids)
        zorro_passes = plain if zorro_unsupported_reason(model) is not None else merge(groups)
        rule = choose_zorro(
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            min_saving=self.min_saving,
            passes=[(group[0][0], group[-1][1]) for group in zorro_passes],
            groups=groups,
        )
        self.choices.record(self.call, rule)
        choice = self.tuner.choose(rule)
        return ZorroPlan(passes=zorro_passes if choice.use_zorro else plain, rule=rule, choice=choice)

    def record(self, plan: ZorroPlan, seconds: float) -> None:
        """The wall time of ``plan``'s passes (device synchronised when :attr:`timing`); a no-op for a plan
        that did not ask for ZoRRO or that the rule kept on the plain pass."""
        if plan.rule is not None and plan.choice is not None:
            self.tuner.record_call(plan.rule, plan.choice, seconds)

    def metrics(self, plan: ZorroPlan) -> dict[str, float]:
        """The choice's and the timings' metrics for a call that asked for ZoRRO; nothing otherwise."""
        if plan.choice is None:
            return {}
        return {**plan.choice.metrics(), **self.tuner.metrics()}
