"""The ``transformers`` sampler's continuous batching: one running batch, calls join between decode steps.

:class:`HfStepCore` is the :class:`~.continuous.StepCore` of :class:`~.sampling.SamplingEngine`. It keeps one batch
of rows (a row is one sample of one prompt of one call) with one KV cache (``DynamicCache``), one attention mask and
each row's next-token logits:

* ``admit`` prefills a new call's rows (its prompts x ``n``, left-padded) in one forward and merges them into the
  running batch: the shorter of the two caches is left-padded with masked zeros to the other's length, then the
  two are concatenated along the batch;
* ``step`` samples one token for every row -- each call from its own ``torch.Generator`` and with its own sampling
  parameters (:func:`~.generation.sample_next`, the same log-probs and candidates as :func:`~.generation.generate_batch`)
  -- ends rows at a stop token, a stop string or ``max_tokens``, drops finished rows from the batch (and the
  padding columns no row needs any more), answers each call whose rows have all ended, and runs one decode forward
  for the rows left.

So a short call sent while a long one runs is answered first, and a call never waits for another to end -- unless
the batch holds ``max_rows`` rows (the job's ``vllm_config.max_num_seqs``, else ``--generate-batch-size``): then a
new call waits, in order, for rows to end (a call larger than that runs alone). A job created with
``full_determinism`` (the adapter asks for it under verl's ``rollout.full_determinism``) runs every call alone, so
that a seeded call's samples are the same whatever else the server is asked. The
weight version a call reports is the one at its admission; the loop never runs a weight load during a step, and one
that finds rows in flight either takes their calls out (``abort``) and admits them again afterwards -- from their
prompts, the call's generator re-seeded with its seed, so they sample as if sent after the load -- or waits for them
(:mod:`.continuous`), so it is the version of every token of the call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from arctic_rl.protocol import SamplingParams
from arctic_rl.server.engines.continuous import Call
from arctic_rl.server.engines.generation import Sample, sample_next, stop_cut, token_candidates

__all__ = ["HfCall", "HfStepCore"]


@dataclass
class HfCall:
    """A call's payload: token-id prompts, parameters, and what its rows need (filled in by the engine)."""

    prompts: list[list[int]]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: set[int]
    decode: Callable[[list[int]], str]
    top_logprobs: int | None
    samples: list[Sample] = field(default_factory=list)
    left: int = 0


@dataclass(eq=False)
class _Row:
    call: Call
    index: int  # the row's place in the call's answer (prompt-major, n samples adjacent)
    tokens: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    candidates: list[dict[int, tuple[float, int]]] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None


class HfStepCore:
    """One running batch over a ``transformers`` causal LM (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, pad_id: int, weight_version: Callable[[], int],
                 max_rows: int = 0, alone: bool = False) -> None:
        self.model = model
        self.max_rows = max_rows
        #: every call runs in a batch of its own (a job created with ``full_determinism``)
        self.alone = alone
        self.pad_id = pad_id
        self.weight_version = weight_version
        self.device = next(model.parameters()).device
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        self._reset()

    def _reset(self) -> None:
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, cache length]
        self.last_pos: torch.Tensor | None = None  # [rows]: the position of each row's latest token
        self.logits: torch.Tensor | None = None  # [rows, vocab]: what each row samples from next

    # ------------------------------------------------------------------ admit

    def has_room(self, call: Call, admitting: list[Call]) -> bool:
        """Whether ``call``'s rows fit beside the running ones (``max_rows``; 0 = no limit). Never, when calls run
        alone: batched matrix products and padded attention are not bit-identical across batch shapes, and one
        flipped token changes a seeded run, so a job that promises ``full_determinism`` takes one call at a time."""
        if self.alone:
            return False
        if self.max_rows <= 0:
            return True
        rows = sum(len(c.payload.prompts) * c.payload.params.n for c in (*admitting, call))
        return len(self.rows) + rows <= self.max_rows

    @torch.no_grad()
    def admit(self, call: Call) -> None:
        from transformers import DynamicCache

        job: HfCall = call.payload
        call.weight_version = self.weight_version()
        call.state = job
        job.generator.manual_seed(job.generator.initial_seed())  # a restarted call samples from its seed again
        n = job.params.n
        prompts = [p for p in job.prompts for _ in range(n)]
        job.samples = [None] * len(prompts)  # type: ignore[list-item]
        job.left = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, **self._keep).logits[:, -1].float()
        rows = [_Row(call, i) for i in range(len(prompts))]
        if not self.rows:
            self.rows, self.cache, self.mask, self.last_pos, self.logits = rows, cache, mask, positions[:, -1], logits
            return
        self.cache = _merge_caches(self.cache, self.mask.shape[1], cache, width)
        self.mask = _merge_masks(self.mask, mask)
        self.last_pos = torch.cat([self.last_pos, positions[:, -1]])
        self.logits = torch.cat([self.logits, logits])
        self.rows.extend(rows)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self) -> list[tuple[Call, Any]]:
        if not self.rows:
            return []
        feed = torch.full((len(self.rows),), self.pad_id, dtype=torch.long)
        by_call: dict[int, tuple[Call, list[int]]] = {}
        for r, row in enumerate(self.rows):
            by_call.setdefault(row.call.call_id, (row.call, []))[1].append(r)
        finished_calls: list[tuple[Call, Any]] = []
        for call, idx in by_call.values():
            job: HfCall = call.payload
            index = torch.tensor(idx, device=self.device)
            logits = self.logits.index_select(0, index)
            if job.top_logprobs is None:
                tokens, lps = sample_next(logits, job.params, job.generator)
                cands = None
            else:
                tokens, lps, logp = sample_next(logits, job.params, job.generator, full=True)
                cands = token_candidates(logp, tokens, job.top_logprobs)
            for k, (r, tok, lp) in enumerate(zip(idx, tokens.tolist(), lps.tolist(), strict=True)):
                row = self.rows[r]
                self._record(row, job, int(tok), float(lp), cands[k] if cands is not None else None)
                feed[r] = int(tok)
                if row.finish is not None:
                    job.samples[row.index] = Sample(row.tokens, row.lps, row.finish,
                                                    row.text if row.text is not None else job.decode(row.tokens),
                                                    row.candidates)
                    job.left -= 1
            if job.left == 0:
                finished_calls.append((call, job.samples))
        keep = [r for r, row in enumerate(self.rows) if row.finish is None]
        if len(keep) != len(self.rows):
            self._select(keep)
            feed = feed[keep] if keep else feed[:0]
        if self.rows:
            self._decode(feed.to(self.device))
        return finished_calls

    def _record(self, row: _Row, job: HfCall, tok: int, lp: float, cand: dict | None) -> None:
        row.tokens.append(tok)
        row.lps.append(lp)
        if cand is not None:
            row.candidates.append(cand)
        stops = [s for s in (job.params.stop or []) if s]
        if tok in job.stop_ids:
            row.finish = "stop"
        elif stops:
            text = job.decode(row.tokens)
            cut = stop_cut(text, stops)
            if cut is not None:
                row.finish, row.text = "stop", text[:cut]
        if row.finish is None and len(row.tokens) >= job.params.max_tokens:
            row.finish = "length"

    def _decode(self, feed: torch.Tensor) -> None:
        ones = torch.ones((len(self.rows), 1), dtype=self.mask.dtype, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        self.last_pos = self.last_pos + 1
        self.logits = self.model(input_ids=feed.unsqueeze(1), attention_mask=self.mask,
                                 position_ids=self.last_pos.unsqueeze(1), past_key_values=self.cache,
                                 use_cache=True).logits[:, -1].float()

    def _select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in order) and drop the left padding columns no kept row needs."""
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, device=self.device)
        self.rows = [self.rows[r] for r in keep]
        self.mask = self.mask.index_select(0, index)
        self.last_pos = self.last_pos.index_select(0, index)
        self.logits = self.logits.index_select(0, index)
        self.cache.batch_select_indices(index)
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def abort(self, call: Call) -> None:
        keep = [r for r, row in enumerate(self.rows) if row.call is not call]
        if len(keep) != len(self.rows):
            self._select(keep)


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge_masks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    length = max(a.shape[1], b.shape[1])
    return torch.cat([_left_pad(a, length, 1), _left_pad(b, length, 1)])


def _merge_caches(running: Any, running_len: int, new: Any, new_len: int) -> Any:
    """``new``'s rows appended to ``running``'s, both left-padded (masked zeros) to the longer length."""
    length = max(running_len, new_len)
    for mine, theirs in zip(running.layers, new.layers, strict=True):
        mine.keys = torch.cat([_left_pad(mine.keys, length, 2), _left_pad(theirs.keys, length, 2)])
        mine.values = torch.cat([_left_pad(mine.values, length, 2), _left_pad(theirs.values, length, 2)])
    return running
