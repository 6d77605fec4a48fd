"""The vLLM sampler's answer: ``/generate`` results built from vLLM's outputs.

:class:`~.vllm_sampler.VllmSamplingEngine` hands ``llm.generate``'s ``RequestOutput``s to
:func:`answer_from_outputs`, which writes the same result fields as the ``transformers`` sampler
(:func:`.sampling.sample_result`): the sampled tokens' log-probs as vLLM's ``processed_logprobs``, either
with each position's candidates in the vendor's format or, for the compact answer (``compact_results``),
the sampled token's alone; ``stop`` strings applied to the decoded text after generation, as the
``transformers`` sampler applies them step by step. Plain Python over vLLM's objects (no vLLM import),
so it runs, and is tested and timed (``benchmarks/generate_answer.py``), on any machine.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

from arctic_rl.protocol import SamplingParams
from arctic_rl.server.engines.generation import stop_cut
from arctic_rl.server.engines.sampling import sample_result

__all__ = ["answer_from_outputs", "apply_stop_strings", "collector_paused", "token_logprobs"]


def answer_from_outputs(
    outputs: list[Any], prompts: list[list[int]], params: SamplingParams, *, decode: Callable[[list[int]], str],
    weight_version: int,
) -> list[dict[str, Any]]:
    """``/generate``'s ``results`` from vLLM's ``RequestOutput``s (one per prompt, in prompt order): per sample its
    token ids, finish reason, text (``decode``; empty unless asked for), the sampled tokens' log-probs in the
    format asked for (:func:`token_logprobs`), stop strings applied (:func:`apply_stop_strings`), and the prompt
    tokens vLLM's prefix cache served."""
    want_lps, sampled_only = params.wants_logprobs, params.sampled_logprobs_only
    stops = [s for s in (params.stop or []) if s]
    results: list[dict[str, Any]] = []
    with collector_paused():
        for pi, out in enumerate(outputs):
            cached = int(getattr(out, "num_cached_tokens", 0) or 0)
            for si, completion in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                ids = list(completion.token_ids)
                lps, entries = (token_logprobs(ids, completion.logprobs, candidates=not sampled_only)
                                if want_lps else ([], []))
                finish = completion.finish_reason if completion.finish_reason in ("stop", "length") else "length"
                text = None
                if stops:
                    ids, lps, finish, text = apply_stop_strings(ids, lps, finish, stops, decode)
                    entries = entries[: len(ids)]
                if not params.wants_text:
                    text = ""
                results.append(
                    sample_result(
                        text=text if text is not None else decode(ids),
                        token_ids=ids,
                        finish_reason=finish,
                        prompt_len=len(prompts[pi]),
                        prefix_cache_len=cached,
                        logprobs=(lps if sampled_only else entries) if want_lps else None,
                        prompt_index=pi,
                        sample_index=si,
                        weight_version=weight_version,
                    )
                )
    return results


def token_logprobs(
    token_ids: list[int], logprobs: Any, *, candidates: bool = True
) -> tuple[list[float], list[dict[str, dict[str, Any]]]]:
    """One pass over vLLM's per-token ``{token_id: Logprob}``: each sampled token's log-prob, and (unless
    ``candidates`` is false: the compact answer) each position's candidates in the vendor's answer format
    (``{str(token_id): {"logprob", "rank"}}``, what :func:`.sampling.vendor_logprobs` writes for the transformers
    sampler), the sampled token always among them.

    One pass and no intermediate objects: at 256 samples x 512 tokens this is 131k positions per call, and
    building them was a large part of what the engine adds around ``llm.generate`` (``benchmarks/RESULTS.md`` §2h)."""
    lps: list[float] = []
    entries: list[dict[str, dict[str, Any]]] = []
    if not candidates:
        for tok, step in zip(token_ids, logprobs or [], strict=True):
            lp = step.get(tok)
            if lp is None:
                raise RuntimeError(f"vLLM returned no log-prob for the sampled token {tok}")
            lps.append(float(lp.logprob))
        return lps, entries
    for tok, step in zip(token_ids, logprobs or [], strict=True):
        entry: dict[str, dict[str, Any]] = {}
        sampled = None
        for t, lp in step.items():
            value = float(lp.logprob)
            entry[str(t)] = {"logprob": value, "rank": int(lp.rank) if lp.rank is not None else 0}
            if t == tok:
                sampled = value
        if sampled is None:
            raise RuntimeError(f"vLLM returned no log-prob for the sampled token {tok}")
        lps.append(sampled)
        entries.append(entry)
    return lps, entries


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off while a call's answer is built: the answer is hundreds of thousands of
    small dicts and no cycles, and the collections they would trigger walk the server's whole heap
    (``benchmarks/generate_answer.py`` times the answer against the way it was built before)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def apply_stop_strings(
    ids: list[int], lps: list[float], finish: str, stops: list[str], decode
) -> tuple[list[int], list[float], str, str | None]:
    """Cut a finished sample at its first stop string as the ``transformers`` sampler does step by
    step: the shortest token prefix whose text holds a stop string ends the sample, its text cut
    before the string. A stop token reached at that same position wins (text left whole)."""
    if stop_cut(decode(ids), stops) is None:
        return ids, lps, finish, None
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        cut = stop_cut(text, stops)
        if cut is None:
            continue
        if k == len(ids) and finish == "stop":
            return ids, lps, finish, None
        return ids[:k], lps[:k], "stop", text[:cut]
    return ids, lps, finish, None
