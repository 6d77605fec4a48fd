"""What the vLLM sampler adds around ``llm.generate``: building the ``/generate`` answer, on a CPU.

    python benchmarks/generate_answer.py [--repeats 7]     # ~10 s
    python benchmarks/generate_answer.py --smoke           # one small shape (the test suite's run)

The server's vLLM engine (:class:`arctic_rl.server.engines.vllm_sampler.VllmSamplingEngine`) turns vLLM's
outputs into the vendor's answer: per sample the tokens, text and finish reason and, with ``logprobs``, one
``{str(token_id): {"logprob", "rank"}}`` per generated token -- 131k of them for 256 samples x 512 tokens.
On one H200 that engine was slower than bare ``vllm.LLM.generate`` on the same engine (``benchmarks/RESULTS.md``
§2h); this script times the part that is the server's own code, on any machine: the engine's ``generate`` with
``llm.generate`` answering at once with outputs shaped as vLLM shapes them (token ids over a 151,936-token
vocabulary, one ``Logprob`` per position), at the shapes of ``gen_throughput.py``.

Baseline, in the same run: the same outputs turned into the same answer the way the engine did before
(per token a ``{id: (logprob, rank)}`` dict, the sampled log-prob read from it, then
:func:`arctic_rl.server.engines.sampling.vendor_logprobs`, the garbage collector running). Both columns are
medians over ``--repeats`` calls; ``vs before`` is the baseline's median over the engine's.

A second table compares the vendor-shaped answer with the compact one the adapter asks of a server listing
``compact_results`` (``logprobs_format="sampled"``, ``detokenize=false``: one float per token, no text): the
engine's time to build each, and the JSON the answer becomes on the wire (its size, and ``json.dumps`` +
``json.loads`` of it, what the server's encoder and the client's parser do at least once).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' helpers (tests.support) from a checkout

from arctic_rl.protocol import GenerateRequest, SamplingParams
from arctic_rl.server.engines.sampling import vendor_logprobs
from tests.support.vllm_stand_in import (
    Completion,
    Logprob,
    OutputsOf,
    RequestOutput,
    engine_around,
    vllm_stand_in_modules,
)

SHAPES = [(64, 128), (64, 512), (256, 128), (256, 512)]
VOCAB = 151_936


def outputs_for(batch: int, new: int, seed: int = 0) -> list[RequestOutput]:
    rng = random.Random(seed)
    outs = []
    for _ in range(batch):
        ids = [rng.randrange(3, VOCAB) for _ in range(new)]
        outs.append(RequestOutput([Completion(0, ids, [{t: Logprob(-5 * rng.random(), 1)} for t in ids])]))
    return outs


def engine_with(outputs: list[RequestOutput]):
    """The server's engine without its vLLM: ``llm.generate`` answers at once with ``outputs``."""
    for name, module in vllm_stand_in_modules().items():
        sys.modules.setdefault(name, module)
    return engine_around(OutputsOf(outputs), vocab_size=VOCAB, max_model_len=1024)


def before(outputs: list[RequestOutput], decode) -> list[dict]:
    """The answer as the engine built it before (two passes, the collector running)."""
    results = []
    for pi, out in enumerate(outputs):
        for si, c in enumerate(out.outputs):
            cands = [{int(t): (float(lp.logprob), int(lp.rank or 0)) for t, lp in step.items()} for step in c.logprobs]
            lps = [step[tok][0] for tok, step in zip(c.token_ids, cands)]
            results.append({"text": decode(c.token_ids), "token_ids": list(c.token_ids), "finish_reason": "length",
                            "prompt_len": 256, "generation_len": len(c.token_ids), "prefix_cache_len": 0,
                            "logprobs": vendor_logprobs(cands), "lps": lps, "prompt_index": pi, "sample_index": si,
                            "weight_version": 0})
    return results


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        del result
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="one shape of 4 x 16, 2 repeats")
    args = p.parse_args()
    shapes, repeats = ([(4, 16)], 2) if args.smoke else (SHAPES, max(1, args.repeats))
    print(f"the vLLM engine's answer to /generate, 256-token prompts, one log-prob per token; medians of {repeats}")
    print("| batch x new tokens | positions | engine ms | before ms | vs before | engine us / position |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for batch, new in shapes:
        outputs = outputs_for(batch, new)
        eng = engine_with(outputs)
        request = GenerateRequest(prompts=[[5] * 256] * batch)
        params = SamplingParams(max_tokens=new, ignore_eos=True, logprobs=1, seed=1)
        decode = eng.tokenizer.decode
        new_s = timed(lambda: eng.generate(request, params), repeats)  # noqa: B023
        old_s = timed(lambda: before(outputs, decode), repeats)  # noqa: B023
        print(f"| {batch} x {new} | {batch * new:,} | {1e3 * new_s:.1f} | {1e3 * old_s:.1f} | {old_s / new_s:.2f}x "
              f"| {1e6 * new_s / (batch * new):.2f} |", flush=True)
        rows.append((batch, new, eng, request, params, new_s))
    print()
    print(f"the vendor-shaped answer vs the compact one (compact_results); medians of {repeats}")
    print("| batch x new tokens | engine ms vendor / compact | JSON MB vendor / compact "
          "| JSON dumps+loads ms vendor / compact | compact vs vendor, engine + JSON |")
    print("| --- | --- | --- | --- | --- |")
    for batch, new, eng, request, params, vendor_s in rows:
        compact_params = params.model_copy(update={"logprobs_format": "sampled", "detokenize": False})
        compact_s = timed(lambda: eng.generate(request, compact_params), repeats)  # noqa: B023
        answers = [{"job_id": 1, "results": eng.generate(request, p)} for p in (params, compact_params)]
        sizes = [len(json.dumps(a)) / 1e6 for a in answers]
        wire_s = [timed(lambda a=a: json.loads(json.dumps(a)), repeats) for a in answers]
        ratio = (vendor_s + wire_s[0]) / (compact_s + wire_s[1])
        print(f"| {batch} x {new} | {1e3 * vendor_s:.1f} / {1e3 * compact_s:.1f} | {sizes[0]:.2f} / {sizes[1]:.2f} "
              f"| {1e3 * wire_s[0]:.1f} / {1e3 * wire_s[1]:.1f} | {ratio:.2f}x faster |", flush=True)
    gc.collect()


if __name__ == "__main__":
    main()
