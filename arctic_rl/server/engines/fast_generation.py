"""The ``transformers`` sampler's fast loop for CUDA: static KV cache, compiled decode step, batch buckets.

:func:`generate_batch_static` samples like :func:`.generation.generate_batch` (same
:func:`~.generation.sample_next`: temperature, top-k, top-p, the log-prob of
``log_softmax(logits / temperature)``, stop tokens kept, ``finish_reason`` ``stop``/``length``) but
keeps the whole loop on the device:

* a ``StaticCache`` of ``rows x max_cache_len`` and a fixed ``[rows, max_cache_len]`` attention
  mask, so every decode step has the same shapes; the step is ``torch.compile``d
  (``reduce-overhead``: CUDA graphs) once per shape;
* shapes come from buckets -- rows rounded up to a power of two (padding rows are dropped),
  prompt width to a multiple of :data:`WIDTH_BUCKET`, cache length to a multiple of
  :data:`CACHE_BUCKET` -- so requests of similar size reuse the compiled step;
* sampled tokens and log-probs are written into device tensors; finished rows are tracked on the
  device and the host looks only every :data:`CHECK_EVERY` steps (one sync, to stop early).

``top_logprobs=k`` records each token's candidates as :func:`.generation.token_candidates` does
(the sampled token's rank and the ``k`` most likely tokens, kept on the device until the end).
What it does not do (the caller uses :func:`.generation.generate_batch` instead, see
:func:`can_run_static`): ``stop`` strings, which need the decoded text at every step. The CPU path
never comes here, so its outputs are those of :func:`.generation.generate_batch`, unchanged.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from arctic_rl.protocol import SamplingParams
from arctic_rl.server.engines.generation import Decoding, Sample, sample_next

__all__ = ["CACHE_BUCKET", "CHECK_EVERY", "WIDTH_BUCKET", "can_run_static", "generate_batch_static"]

logger = logging.getLogger("arctic_rl.server")

WIDTH_BUCKET = 64
CACHE_BUCKET = 256
CHECK_EVERY = 16
#: static caches kept per (model, rows, length) bucket: the compiled step's CUDA graphs keep their addresses
_CACHES: dict[tuple[int, int, int], Any] = {}
_MAX_CACHES = 4
_COMPILED: dict[int, Any] = {}


def can_run_static(params: SamplingParams) -> bool:
    """Whether :func:`generate_batch_static` serves these parameters (not with stop strings)."""
    return not any(s for s in (params.stop or []))


def _bucket_rows(rows: int) -> int:
    return 1 << max(0, (rows - 1).bit_length())


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _static_cache(model: torch.nn.Module, rows: int, cache_len: int):
    """The bucket's ``StaticCache``, reset (one per bucket, the oldest dropped beyond :data:`_MAX_CACHES`)."""
    from transformers import StaticCache

    key = (id(model), rows, cache_len)
    cache = _CACHES.pop(key, None)
    if cache is None:
        while len(_CACHES) >= _MAX_CACHES:
            _CACHES.pop(next(iter(_CACHES)))
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
    else:
        cache.reset()
    _CACHES[key] = cache  # most recently used last
    return cache


def _decode_step(model: torch.nn.Module, compile_step: bool):
    """The one-token forward (compiled once per model when asked)."""

    def step(input_ids, attention_mask, position_ids, cache_position, cache):
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache_position=cache_position,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]

    if not compile_step:
        return step
    key = id(model)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(step, mode="reduce-overhead", fullgraph=False, dynamic=False)
    return _COMPILED[key]


@torch.no_grad()
def generate_batch_static(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams,
                          decoding: Decoding, *, compile_step: bool = True) -> list[Sample]:
    """One continuation per prompt, the loop on the device (see the module docstring)."""
    generator, stop_ids, pad_id, decode = decoding.generator, decoding.stop_ids, decoding.pad_id, decoding.decode
    top_logprobs = decoding.top_logprobs
    if not can_run_static(params):
        raise ValueError("generate_batch_static: stop strings need the step-by-step loop (generate_batch)")
    device = next(model.parameters()).device
    rows = len(prompts)
    batch = _bucket_rows(rows)
    width = _round_up(max(len(p) for p in prompts), WIDTH_BUCKET)
    steps = params.max_tokens
    cache_len = _round_up(width + steps, CACHE_BUCKET)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, cache_len), dtype=torch.long)
    mask[:, width:] = 1  # generated positions (a position is only seen once it is written)
    for i in range(batch):
        prompt = prompts[i] if i < rows else prompts[0][-1:]  # padding rows: one real token, dropped at the end
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) : width] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp_min(0)
    cache = _static_cache(model, batch, cache_len)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        cache_position=torch.arange(width, device=device),
        past_key_values=cache,
        use_cache=True,
        **keep,
    ).logits[:, -1]
    step = _decode_step(model, compile_step and device.type == "cuda")

    stop_tensor = torch.tensor(sorted(stop_ids) or [-1], dtype=torch.long, device=device)
    out_tokens = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
    out_lps = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    k = int(top_logprobs or 0)
    if top_logprobs is not None:
        out_ranks = torch.zeros((batch, steps), dtype=torch.long, device=device)
        out_topv = torch.zeros((batch, steps, k), dtype=torch.float32, device=device)
        out_topi = torch.zeros((batch, steps, k), dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    finished[rows:] = True
    last_pos = positions[:, -1:].clone()
    cache_position = torch.tensor([width], dtype=torch.long, device=device)
    done = 0
    for t in range(steps):
        if top_logprobs is None:
            tokens, lps = sample_next(logits, params, generator)
        else:
            tokens, lps, logp = sample_next(logits, params, generator, full=True)
            out_ranks[:, t] = (logp > lps.unsqueeze(-1)).sum(-1) + 1
            if k > 0:
                out_topv[:, t], out_topi[:, t] = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        out_tokens[:, t] = tokens
        out_lps[:, t] = lps
        done = t + 1
        finished |= torch.isin(tokens, stop_tensor)
        if t + 1 == steps or ((t + 1) % CHECK_EVERY == 0 and bool(finished.all())):
            break
        feed = torch.where(finished, torch.full_like(tokens, pad_id), tokens).unsqueeze(1)
        last_pos = last_pos + 1
        logits = step(feed, mask, last_pos, cache_position, cache)
        if compile_step and device.type == "cuda":
            logits = logits.clone()  # CUDA-graph outputs are overwritten by the next replay
        cache_position = cache_position + 1

    tokens_host = out_tokens[:rows, :done].tolist()
    lps_host = out_lps[:rows, :done].tolist()
    if top_logprobs is not None:
        ranks_host = out_ranks[:rows, :done].tolist()
        topv_host, topi_host = out_topv[:rows, :done].tolist(), out_topi[:rows, :done].tolist()
    samples: list[Sample] = []
    for i in range(rows):
        row = tokens_host[i]
        end = next((j + 1 for j, tok in enumerate(row) if tok in stop_ids), None)
        cut = end if end is not None else min(len(row), steps)
        token_ids = row[:cut]
        candidates: list[dict[int, tuple[float, int]]] = []
        if top_logprobs is not None:
            for j in range(cut):
                entry = {token_ids[j]: (lps_host[i][j], ranks_host[i][j])}
                for r, (tok, val) in enumerate(zip(topi_host[i][j], topv_host[i][j]), start=1):
                    entry.setdefault(int(tok), (float(val), r))
                candidates.append(entry)
        finish = "stop" if end is not None else "length"
        samples.append(Sample(token_ids, lps_host[i][:cut], finish, decode(token_ids), candidates))
    return samples
