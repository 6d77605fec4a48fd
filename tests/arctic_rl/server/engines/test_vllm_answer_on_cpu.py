"""The vLLM sampler's answer to ``/generate``, built from vLLM's outputs, on a CPU machine (no vLLM here).

The engine's ``generate`` turns ``llm.generate``'s outputs into the vendor's answer: per sample the tokens,
text, finish reason and, with ``logprobs``, the sampled token's log-prob and the per-position candidates as
``{str(token_id): {"logprob", "rank"}}``. vLLM's engine is not on this machine, so its outputs are given here
as vLLM shapes them (``RequestOutput.outputs[i].token_ids / .logprobs / .finish_reason``, ``Logprob``
objects, ``tests/support/vllm_stand_in.py``) by an object standing in for ``vllm.LLM``; what runs is the server's own code after
``llm.generate`` returns. The GPU tests (``test_vllm_sampler_gpu.py``) run the same path on real vLLM.
"""

from __future__ import annotations

import gc
import sys

import pytest

from arctic_rl.protocol import GenerateRequest, SamplingParams
from arctic_rl.server.engines.sampling import vendor_logprobs
from arctic_rl.server.engines.vllm_answer import apply_stop_strings, token_logprobs
from tests.support.vllm_stand_in import (
    Completion,
    Logprob,
    OutputsOf,
    RequestOutput,
    engine_around,
    vllm_stand_in_modules,
)


@pytest.fixture
def engine(monkeypatch):
    """A vLLM sampling engine without its ``LLM``; each test gives it one (``engine.llm = OutputsOf(...)``)."""
    for name, module in vllm_stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    return engine_around(None, vocab_size=100, max_model_len=64, weight_version=3)


def _ids(text: str, tok) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_token_logprobs_gives_the_sampled_values_and_the_vendor_format():
    steps = [{7: Logprob(-0.5, 1), 9: Logprob(-1.5, 2)}, {4: Logprob(-2.0, 3), 8: Logprob(-0.1, 1)}]
    lps, entries = token_logprobs([7, 4], steps)
    assert lps == [-0.5, -2.0]
    # what the transformers sampler writes for the same candidates
    assert entries == vendor_logprobs([{7: (-0.5, 1), 9: (-1.5, 2)}, {4: (-2.0, 3), 8: (-0.1, 1)}])
    assert token_logprobs([5], [{5: Logprob(-0.2, None)}]) == ([-0.2], [{"5": {"logprob": -0.2, "rank": 0}}])


def test_token_logprobs_refuses_outputs_without_the_sampled_token_or_of_another_length():
    with pytest.raises(RuntimeError, match="no log-prob for the sampled token 7"):
        token_logprobs([7], [{9: Logprob(-1.0, 1)}])
    with pytest.raises(ValueError):
        token_logprobs([7, 8], [{7: Logprob(-1.0, 1)}])


def test_generate_builds_the_vendor_answer_from_vllm_outputs(engine):
    tok = engine.tokenizer
    a, b = _ids("ab", tok), _ids("xyz", tok)
    outs = [RequestOutput([Completion(1, b, [{t: Logprob(-0.25 * (i + 1), 1)} for i, t in enumerate(b)], "stop"),
                           Completion(0, a, [{t: Logprob(-1.0, 1), 99: Logprob(-3.0, 2)} for t in a])],
                          num_cached_tokens=2)]
    engine.llm = OutputsOf(outs)
    res = engine.generate(GenerateRequest(prompts=[[5, 6, 7]]), SamplingParams(max_tokens=4, logprobs=1, n=2))
    assert [r["sample_index"] for r in res] == [0, 1] and [r["token_ids"] for r in res] == [a, b]
    assert res[0]["text"] == "ab" and res[1]["text"] == "xyz"
    assert [r["finish_reason"] for r in res] == ["length", "stop"]
    assert res[1]["logprobs"] == [{str(t): {"logprob": -0.25 * (i + 1), "rank": 1}} for i, t in enumerate(b)]
    assert res[0]["logprobs"][0] == {str(a[0]): {"logprob": -1.0, "rank": 1}, "99": {"logprob": -3.0, "rank": 2}}
    assert {r["prompt_len"] for r in res} == {3} and {r["prefix_cache_len"] for r in res} == {2}
    assert {r["weight_version"] for r in res} == {3} and {r["generation_len"] for r in res} == {2, 3}
    assert gc.isenabled()  # the collector, paused while the answer is built, is back on


def test_the_compact_answer_asks_vllm_for_the_sampled_token_only_and_carries_floats_without_text(engine):
    tok = engine.tokenizer
    a, b = _ids("ab", tok), _ids("xyz", tok)
    outs = [RequestOutput([Completion(0, a, [{t: Logprob(-0.5, 1)} for t in a]),
                           Completion(1, b, [{t: Logprob(-0.25 * (i + 1), 2)} for i, t in enumerate(b)])])]
    engine.llm = OutputsOf(outs)
    params = SamplingParams(max_tokens=4, logprobs=3, n=2, logprobs_format="sampled", detokenize=False)
    res = engine.generate(GenerateRequest(prompts=[[5, 6, 7]]), params)
    assert [r["logprobs"] for r in res] == [[-0.5, -0.5], [-0.25, -0.5, -0.75]]
    assert [r["text"] for r in res] == ["", ""] and [r["token_ids"] for r in res] == [a, b]
    (_, vllm_params), = engine.llm.calls
    assert {p.logprobs for p in vllm_params} == {0}  # no top tokens computed for an answer that drops them
    assert token_logprobs([7, 4], [{7: Logprob(-0.5, 1), 9: Logprob(-1.5, 2)}, {4: Logprob(-2.0, 3)}],
                           candidates=False) == ([-0.5, -2.0], [])
    with pytest.raises(RuntimeError, match="no log-prob for the sampled token 7"):
        token_logprobs([7], [{9: Logprob(-1.0, 1)}], candidates=False)


def test_generate_cuts_log_probs_with_the_tokens_at_a_stop_string(engine):
    ids = _ids("abXYcd", engine.tokenizer)
    engine.llm = OutputsOf([RequestOutput([Completion(0, ids, [{t: Logprob(-0.1 * t, 1)} for t in ids])])])
    (res,) = engine.generate(GenerateRequest(prompts=[[5]]), SamplingParams(max_tokens=6, logprobs=0, stop=["XY"]))
    assert res["token_ids"] == ids[:4] and res["text"] == "ab" and res["finish_reason"] == "stop"
    assert [next(iter(e)) for e in res["logprobs"]] == [str(t) for t in ids[:4]]


def test_generate_without_logprobs_returns_none_and_leaves_the_collector_as_it_found_it(engine):
    ids = _ids("ab", engine.tokenizer)
    engine.llm = OutputsOf([RequestOutput([Completion(0, ids, None)])])
    gc.disable()
    try:
        (res,) = engine.generate(GenerateRequest(prompts=[[5]]), SamplingParams(max_tokens=2))
        assert not gc.isenabled()  # was off before the call: stays off
    finally:
        gc.enable()
    assert res["logprobs"] is None and res["token_ids"] == ids


def test_stop_strings_after_generation_cut_like_the_step_loop():
    def decode(ids):
        return "".join(chr(i) for i in ids)

    ids = [ord(c) for c in "abXYcd"]
    lps = [-0.1 * (i + 1) for i in range(len(ids))]
    assert apply_stop_strings(ids, lps, "length", ["XY"], decode) == (ids[:4], lps[:4], "stop", "ab")
    assert apply_stop_strings(ids, lps, "length", ["zz"], decode) == (ids, lps, "length", None)
    # the stop string completes on the stop token itself: the stop token wins, text left whole
    assert apply_stop_strings(ids[:4], lps[:4], "stop", ["XY"], decode) == (ids[:4], lps[:4], "stop", None)
