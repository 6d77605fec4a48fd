"""Which of ZoRRO's pass and the plain pass is faster for one job, timed on the job's own calls.

The token rule (:mod:`arctic_rl.server.zorro.rule`) says when ZoRRO *can* pay: its pass computes few
enough tokens. Whether it *does* pay depends on the model and the device as much as on the token counts.
ZoRRO's pass is two forwards (the unique prompts, then the responses against their keys) with a graph
break in every attention layer, so where a call's arithmetic is small next to per-kernel and per-layer
costs it loses even when it removes most tokens. On one H200, SmolLM2-135M with 1.6K-token few-shot
prompts (80% of the tokens removed) took 1.30x the plain pass's step time (``benchmarks/RESULTS.md``
§2f), while a 0.6B-shaped model with 2K-token prompts ran 2.2x faster with ZoRRO (§2.0).

So for the calls the token rule sends to ZoRRO, a :class:`ZorroTuner` (one per job and call kind)
times both passes and keeps the faster:

1. *Measuring*: the calls alternate between the two passes, ZoRRO first, until each pass has run
   ``trials + 1`` times. The first call of each pass is a warm-up and is not timed (``torch.compile``,
   allocator and kernel caches); the others are, as seconds per token of the plain pass
   (``B * (P+R)``), so calls with other response widths compare.
   The measuring is bounded: at most ``max_trial_calls`` calls (default ``2 * (trials + 1)``, what the
   alternation needs) are chosen while measuring -- counted when chosen, so calls that fail or are not timed
   count too. A job that reaches the cap settles on the samples it has (the faster median; ZoRRO, the token
   rule's verdict, when a pass has none). It also ends as soon as each pass has one timed call and one pass
   took ``decisive`` times the other's time or more (default :data:`DEFAULT_DECISIVE`): more samples would not
   change such a verdict, and each would run the slow pass once more (on one H100, the plain pass of a
   few-shot ``/forward-backward`` took 6.7 s against ZoRRO's 1.5, ``benchmarks/RESULTS.md`` §2z). So the
   slower pass runs at most ``trials + 1`` of a job's first calls -- twice where it is that much slower --
   and one call in ``recheck_every`` after that; ``max_trial_calls=0`` skips the measuring (ZoRRO's pass).
2. *Settled*: every call takes the pass with the lower median. Every ``recheck_every``-th call
   after that re-times the other pass once (its oldest sample is replaced), so a job whose shapes
   drift (responses lengthen or shorten as it learns) follows the faster pass.

The choice changes speed only: both passes give the same log-probs, losses and gradients (to float
precision). Memory: a trial is a whole call run with one of the passes, never both passes on one batch,
so no call holds the buffers of both at once (and within a call, each pass's outputs are dropped before
the next pass's forward). ``trials=0`` turns the timing off: every call the token rule sends to ZoRRO takes it.
Verdicts are logged at INFO when they change; a call's metrics carry ``zorro_time_ratio`` (ZoRRO's
median over the plain pass's) once both passes are timed.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from arctic_rl.server.zorro.rule import ZorroChoice

__all__ = ["DEFAULT_DECISIVE", "DEFAULT_RECHECK_EVERY", "DEFAULT_TRIALS", "ZorroTuner", "default_max_trial_calls"]

logger = logging.getLogger(__name__)

#: timed calls per pass before a job settles (after one untimed warm-up call each)
DEFAULT_TRIALS = 2
#: once settled, every this many calls re-time the other pass once
DEFAULT_RECHECK_EVERY = 25
#: a pass this many times slower than the other on their first timed calls ends the measuring at once
DEFAULT_DECISIVE = 2.0


def default_max_trial_calls(trials: int) -> int:
    """Calls a tuner of ``trials`` measures at most: each pass's untimed warm-up call and ``trials`` timed ones."""
    return 2 * (trials + 1) if trials > 0 else 0


@dataclass
class _PassTimes:
    runs: int = 0  # calls that ran this pass (the first is the untimed warm-up)
    samples: deque[float] = field(default_factory=deque)  # seconds per plain-pass token, newest last

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


class ZorroTuner:
    """Times ZoRRO's pass against the plain pass on one job's calls and picks the faster (module docstring)."""

    def __init__(
        self, job: str, call: str, *, trials: int = DEFAULT_TRIALS, recheck_every: int = DEFAULT_RECHECK_EVERY,
        max_trial_calls: int | None = None, decisive: float | None = DEFAULT_DECISIVE,
    ) -> None:
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
            raise ValueError(f"trials: expected an integer >= 0 (0 = no timing, ZoRRO whenever it pays), got {trials!r}")
        if isinstance(recheck_every, bool) or not isinstance(recheck_every, int) or recheck_every < 2:
            raise ValueError(f"recheck_every: expected an integer >= 2, got {recheck_every!r}")
        if max_trial_calls is None:
            max_trial_calls = default_max_trial_calls(trials)
        if isinstance(max_trial_calls, bool) or not isinstance(max_trial_calls, int) or max_trial_calls < 0:
            raise ValueError(f"max_trial_calls: expected an integer >= 0, got {max_trial_calls!r}")
        if decisive is not None and (isinstance(decisive, bool) or not isinstance(decisive, (int, float))
                                     or not decisive > 1.0):
            raise ValueError(f"decisive: expected a number > 1 (None = always measure every trial), got {decisive!r}")
        self.decisive = None if decisive is None else float(decisive)
        self.job, self.call = job, call
        self.max_trial_calls = max_trial_calls
        self.trial_calls = 0  # calls chosen while measuring (never more than max_trial_calls)
        self.trials, self.recheck_every = trials, recheck_every
        self._times = {True: _PassTimes(samples=deque(maxlen=max(trials, 1))),
                       False: _PassTimes(samples=deque(maxlen=max(trials, 1)))}
        self._since_recheck = 0
        self._verdict: bool | None = None

    @property
    def timing(self) -> bool:
        """Whether calls are timed at all (``trials > 0``): a caller synchronises the device only then."""
        return self.trials > 0

    def choose(self, rule: ZorroChoice) -> ZorroChoice:
        """The pass of a call: the token ``rule``'s plain pass, or, where the rule sends it to ZoRRO, the
        pass :meth:`use_zorro` picks (``use_zorro`` of the answer; the token counts stay the rule's)."""
        if not rule.use_zorro:
            return rule
        return dataclasses.replace(rule, use_zorro=self.use_zorro())

    def record_call(self, rule: ZorroChoice, chosen: ZorroChoice, seconds: float) -> None:
        """The wall time of a call's passes, the device synchronised; only calls the rule sent to ZoRRO count."""
        if rule.use_zorro:
            self.record(chosen.use_zorro, seconds, rule.plain_tokens)

    @property
    def measuring(self) -> bool:
        """Whether a pass still lacks its warm-up or timed calls, the measuring calls are not all spent and the
        timed calls so far are not decisive."""
        return (self.trials > 0 and self.trial_calls < self.max_trial_calls
                and any(t.runs < self.trials + 1 for t in self._times.values()) and not self._decided())

    def _decided(self) -> bool:
        """Whether each pass has a timed call and one pass took ``decisive`` times the other's time or more."""
        ratio = self.time_ratio()
        return self.decisive is not None and ratio is not None and (
            ratio >= self.decisive or ratio * self.decisive <= 1.0)

    def use_zorro(self) -> bool:
        """The pass for a call the token rule sends to ZoRRO: True = ZoRRO's, False = the plain pass."""
        if self.trials == 0:
            return True
        zorro, plain = self._times[True], self._times[False]
        if self.measuring:
            self.trial_calls += 1
            return zorro.runs <= plain.runs  # alternate, ZoRRO first
        faster = self._faster()
        self._since_recheck += 1
        if self._since_recheck >= self.recheck_every:
            self._since_recheck = 0
            return not faster
        return faster

    def record(self, used_zorro: bool, seconds: float, plain_tokens: int) -> None:
        """The wall time of a call's passes (the device synchronised) that :meth:`use_zorro` chose."""
        if self.trials == 0 or plain_tokens <= 0:
            return
        times = self._times[bool(used_zorro)]
        times.runs += 1
        if times.runs > 1:  # the first run of a pass is its warm-up
            times.samples.append(float(seconds) / plain_tokens)
        if not self.measuring:
            faster = self._faster()
            if faster is not self._verdict:
                self._verdict = faster
                medians = [self._times[used].median() for used in (True, False)]
                logger.info(
                    "%s job, %s: timed %s faster (ZoRRO %s vs plain %s s per 1k plain-pass tokens, medians of "
                    "%d and %d calls, %d measuring calls); ZoRRO requests take it",
                    self.job, self.call, "ZoRRO's pass" if faster else "the plain pass",
                    *("-" if m is None else f"{1e3 * m:.3g}" for m in medians),
                    len(self._times[True].samples), len(self._times[False].samples), self.trial_calls,
                )

    def time_ratio(self) -> float | None:
        """ZoRRO's median time over the plain pass's (per plain-pass token), once both are timed."""
        zorro, plain = self._times[True].median(), self._times[False].median()
        if zorro is None or plain is None or plain <= 0:
            return None
        return zorro / plain

    def metrics(self) -> dict[str, float]:
        ratio = self.time_ratio()
        return {} if ratio is None else {"zorro_time_ratio": ratio}

    def _faster(self) -> bool:
        ratio = self.time_ratio()
        return True if ratio is None else ratio <= 1.0
