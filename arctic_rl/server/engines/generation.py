"""Batched sampling from a Hugging Face causal LM with a KV cache (the reference sampler's loop).

:func:`generate_batch` takes token-id prompts, left-pads them, runs the prompt once with
``use_cache=True`` and then one token per step for every row:

* ``temperature == 0``: greedy (argmax); otherwise ``softmax(logits / temperature)`` truncated by
  ``top_k`` (>0) then ``top_p`` (<1), sampled with the caller's :class:`torch.Generator` -- so a
  seeded request is reproducible;
* the reported log-prob of a sampled token is ``log_softmax(logits / temperature)`` at that
  token, *before* top-k/top-p truncation (temperature 1 for greedy). That is the distribution
  verl recomputes from the trainer (``logits / temperature``), so the two agree; asked for
  ``top_logprobs=k``, each token also gets its candidates in vLLM's form -- the sampled token and
  the ``k`` most likely of that same distribution, each with its rank;
* a row stops at a stop token (``stop_token_ids``, plus the EOS ids unless ``ignore_eos``) --
  the token is kept in ``token_ids`` -- or when its decoded text contains a stop string (the text
  is cut before it, the tokens up to the one that completed it are kept), both with
  ``finish_reason="stop"``; or after ``max_tokens`` with ``"length"``.

What is not here: request parsing, chunking a big request, n samples (:mod:`.sampling`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from arctic_rl.protocol import SamplingParams

__all__ = ["Decoding", "Sample", "generate_batch", "sample_next", "stop_cut", "token_candidates"]


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    #: per generated token ``{token_id: (logprob, rank)}``: the sampled token and the top-k (vLLM's rule);
    #: empty unless :func:`generate_batch` was asked for ``top_logprobs``
    candidates: list[dict[int, tuple[float, int]]] = field(default_factory=list)


@dataclass(frozen=True)
class Decoding:
    """How one call's rows are decoded, whichever loop runs them (:func:`generate_batch`, or the CUDA loop of
    :mod:`.fast_generation`): the call's seeded generator, its stop ids, the padding id, the detokenizer
    (``decode(ids) -> str``) and, asked for log-probs, how many top candidates to record per token."""

    generator: torch.Generator
    stop_ids: set[int]
    pad_id: int
    decode: Callable[[list[int]], str]
    top_logprobs: int | None = None


def token_candidates(
    logp: torch.Tensor, tokens: torch.Tensor, k: int
) -> list[dict[int, tuple[float, int]]]:
    """For each row of ``logp`` ``[B, V]``: the sampled token and the ``k`` most likely ones, each with its
    log-prob and rank (1 = most likely; the sampled token's rank counts the tokens strictly more likely)."""
    chosen = logp.gather(-1, tokens.unsqueeze(-1))
    ranks = (logp > chosen).sum(-1) + 1
    top_v, top_i = torch.topk(logp, min(int(k), logp.shape[-1]), dim=-1) if k > 0 else (None, None)
    out: list[dict[int, tuple[float, int]]] = []
    for b in range(logp.shape[0]):
        entry = {int(tokens[b]): (float(chosen[b, 0]), int(ranks[b]))}
        if top_i is not None:
            for r, (tok, val) in enumerate(zip(top_i[b].tolist(), top_v[b].tolist()), start=1):
                entry.setdefault(int(tok), (float(val), r))
        out.append(entry)
    return out


def _filter_top_k_top_p(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before > top_p
        drop_sorted[..., 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, *, full: bool = False
) -> tuple[torch.Tensor, ...]:
    """``(tokens [B], logprobs [B])`` for one step (see the module docstring for the log-prob);
    ``full=True`` adds the whole log-distribution ``[B, V]`` the log-probs were read from."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        z = logits / params.temperature
        logp = torch.log_softmax(z, dim=-1)
        probs = torch.softmax(_filter_top_k_top_p(z, params.top_k, params.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (tokens, picked, logp) if full else (tokens, picked)


def stop_cut(text: str, stops: list[str]) -> int | None:
    """Where the first of ``stops`` begins in ``text`` (the text is cut there), or ``None`` when none occurs."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return min(cuts) if cuts else None


@torch.no_grad()
def generate_batch(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams,
                   decoding: Decoding) -> list[Sample]:
    """Sample one continuation per prompt (see the module docstring); ``decoding.top_logprobs=k`` also records
    each token's candidates (:func:`token_candidates`)."""
    generator, stop_ids, pad_id, decode = decoding.generator, decoding.stop_ids, decoding.pad_id, decoding.decode
    top_logprobs = decoding.top_logprobs
    from transformers import DynamicCache

    device = next(model.parameters()).device
    rows = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, **keep
    ).logits[:, -1]
    last_pos = positions[:, -1]

    out_ids: list[list[int]] = [[] for _ in range(rows)]
    out_lps: list[list[float]] = [[] for _ in range(rows)]
    out_cands: list[list[dict[int, tuple[float, int]]]] = [[] for _ in range(rows)]
    finish: list[str | None] = [None] * rows
    texts: list[str | None] = [None] * rows
    stops = [s for s in (params.stop or []) if s]
    for _ in range(params.max_tokens):
        if top_logprobs is None:
            tokens, lps = sample_next(logits, params, generator)
            step_candidates = None
        else:
            tokens, lps, logp = sample_next(logits, params, generator, full=True)
            step_candidates = token_candidates(logp, tokens, top_logprobs)
        tokens_list, lps_list = tokens.tolist(), lps.tolist()
        for i in range(rows):
            if finish[i] is not None:
                continue
            tok = tokens_list[i]
            out_ids[i].append(tok)
            out_lps[i].append(float(lps_list[i]))
            if step_candidates is not None:
                out_cands[i].append(step_candidates[i])
            if tok in stop_ids:
                finish[i] = "stop"
            elif stops:
                text = decode(out_ids[i])
                cut = stop_cut(text, stops)
                if cut is not None:
                    finish[i], texts[i] = "stop", text[:cut]
            if finish[i] is None and len(out_ids[i]) >= params.max_tokens:
                finish[i] = "length"
        if all(f is not None for f in finish):
            break
        feed = torch.tensor([t if finish[i] is None else pad_id for i, t in enumerate(tokens_list)], device=device)
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
        last_pos = last_pos + 1
        logits = model(
            input_ids=feed.unsqueeze(1),
            attention_mask=mask,
            position_ids=last_pos.unsqueeze(1),
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
    return [
        Sample(out_ids[i], out_lps[i], finish[i] or "length", texts[i] if texts[i] is not None else decode(out_ids[i]),
               out_cands[i])
        for i in range(rows)
    ]
