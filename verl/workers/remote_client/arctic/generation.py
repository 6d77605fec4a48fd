"""``/generate`` requests and results for the Arctic adapter.

verl's rollout replica asks for token ids in and token ids out. Servers differ in what they accept
(:class:`arctic_rl.protocol.Features` in ``/health``):

* ``token_prompts``: prompts go as token ids; otherwise (the vendor's servers) they are decoded
  to text, which can re-tokenise differently -- the reason our reference server takes ids.
* ``n_samples``: ``sampling_params.n > 1`` returns ``n`` samples per prompt; otherwise (the vendor
  keeps only the first output per prompt) each prompt is repeated ``n`` times with ``n = 1``.
* ``compact_results``: log-probs come back as one float per generated token (``logprobs_format="sampled"``)
  and, with ``token_prompts`` too, without ``text`` (``detokenize=false``) -- verl reads token ids and the
  sampled tokens' log-probs only, and the vendor's per-token candidates are most of a large answer's bytes.
  The answer's shape is the client's to choose, from the features, not the caller's; other servers get
  neither key.

Sampling parameters are filtered to the protocol's :class:`~arctic_rl.protocol.SamplingParams` by
:func:`arctic_rl.protocol.clean_sampling_params` (unknown knobs are logged once per process and not sent; a
strict server would reject the whole call) and validated here, so a bad value is a config error naming the
knob rather than a 400 later.

:class:`SeedDeriver` gives reproducible sampling under verl's ``rollout.full_determinism``: a call
without a seed gets one derived from ``rollout.seed``, its prompts and how many times this client
already generated for exactly those prompts -- so a re-run, or a call re-sent after a server restart,
samples the same tokens, while repeated samples of one prompt (GRPO's ``n``) still differ: copies of a
prompt within one call go in separate calls (:func:`unique_layers`), since a server applies the call's one
seed to each of its prompts.
Log-probs come back per token as ``{str(token_id): {"logprob", "rank"}}`` (the sampled token and the
top-k, the vendor's format); :func:`ordered_results` keeps the sampled token's value, one float per
generated token, which is what verl's rollout expects.
:class:`Sampler` is the generation role of the client: one ``/generate`` call per verl request, its
body built by the run's :class:`~.dialect.Dialect` from :class:`~arctic_rl.protocol.GenerateRequest`.
What is not here: HTTP and retries (:mod:`.session`, :mod:`.recovery`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from typing import Any

from arctic_rl.protocol import (
    Features,
    FieldError,
    GenerateResponse,
    GenerateResult,
    JobType,
    Paths,
    SamplingParams,
    sampled_logprobs,
)
from arctic_rl.protocol import clean_sampling_params as protocol_clean
from verl.remote_backend.errors import RemoteBackendConfigError, RemoteProtocolError

from .answers import parse_answer
from .session import JobCalls, ModelTokens
from .state import RunState

__all__ = ["Sampler", "SeedDeriver", "clean_sampling_params", "ordered_results", "unique_layers"]

logger = logging.getLogger(__name__)

def clean_sampling_params(given: dict[str, Any]) -> SamplingParams:
    """``given`` restricted to the protocol's knobs and validated (:func:`arctic_rl.protocol.clean_sampling_params`,
    the one cleaning, with its one warned-once set); a bad value is a config error naming the knob."""
    try:
        return protocol_clean(given)
    except FieldError as exc:
        raise RemoteBackendConfigError(exc.field, exc.message, allowed=exc.allowed, received=exc.received) from None


class SeedDeriver:
    """Deterministic per-call seeds (see the module docstring); thread-safe."""

    def __init__(self, base_seed: int) -> None:
        self.base_seed = int(base_seed)
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, prompts: list[list[int]]) -> int:
        h = hashlib.sha256(str(self.base_seed).encode())
        for prompt in prompts:
            h.update(b"|" + ",".join(map(str, prompt)).encode())
        key = h.hexdigest()
        with self._lock:
            occurrence = self._seen[key]
            self._seen[key] += 1
        return int.from_bytes(hashlib.sha256(f"{key}:{occurrence}".encode()).digest()[:8], "big") >> 1


def ordered_results(answer: GenerateResponse, num_prompts: int, n: int, *, expanded: bool) -> list[GenerateResult]:
    """The answer's results, prompt-major (prompt ``i``'s samples at ``[i*n, (i+1)*n)``), indices filled in."""
    results = list(answer.results)
    if len(results) != num_prompts * n:
        raise RemoteProtocolError("POST /generate", f"expected {num_prompts * n} results ({num_prompts} prompts x "
                                  f"n={n}), got {len(results)}")
    for i, r in enumerate(results):  # the wire's per-token candidates -> the sampled tokens' log-probs
        if r.logprobs is not None:
            try:
                r.logprobs = sampled_logprobs(r.token_ids, r.logprobs)
            except (TypeError, ValueError) as exc:
                raise RemoteProtocolError("POST /generate", f"results[{i}].{exc}") from None
    if not expanded and all(r.prompt_index is not None for r in results):
        results.sort(key=lambda r: (r.prompt_index, r.sample_index or 0))
    for i, r in enumerate(results):
        r.prompt_index, r.sample_index = i // n, i % n
    return results


class Sampler:
    """``generate`` on the sampling job (see the module docstring)."""

    def __init__(self, calls: JobCalls, state: RunState, *, tokens: ModelTokens, seeds: SeedDeriver | None) -> None:
        self.calls = calls
        self.state = state
        self.tokens = tokens
        self.seeds = seeds

    def generate(self, prompts: list[list[int]], sampling_params: dict | None = None) -> list[GenerateResult]:
        """One ``/generate`` call (one per :func:`unique_layers` layer when a seed is derived); results in
        prompt order, ``n`` samples of a prompt adjacent, indices filled in."""
        if not prompts:
            return []
        features = self.state.features
        params = clean_sampling_params(sampling_params or {})
        n = params.n
        expand = n > 1 and Features.N_SAMPLES not in features
        per_row = 1 if expand else n
        rows = [[int(t) for t in p] for p in prompts for _ in range(n if expand else 1)]
        wire_params = params.model_dump(mode="json", exclude_none=True)
        if expand:
            wire_params["n"] = 1
        if Features.COMPACT_RESULTS in features:
            if params.wants_logprobs:
                wire_params["logprobs_format"] = "sampled"
            if Features.TOKEN_PROMPTS in features:
                wire_params["detokenize"] = False
        derive = self.seeds is not None and params.seed is None  # verl's rollout.full_determinism
        by_row: list[list[GenerateResult]] = [[] for _ in rows]
        for layer in unique_layers(rows) if derive else [list(range(len(rows)))]:
            layer_rows = [rows[i] for i in layer]
            seed = {"seed": self.seeds(layer_rows)} if derive else {}
            answer = self._post(layer_rows, {**wire_params, **seed})
            got = ordered_results(answer, len(layer_rows), per_row, expanded=expand)
            for k, i in enumerate(layer):
                by_row[i] = got[k * per_row : (k + 1) * per_row]
        results = [r for chunk in by_row for r in chunk]
        for i, r in enumerate(results):
            r.prompt_index, r.sample_index = i // n, i % n
        return results

    def _post(self, rows: list[list[int]], wire_params: dict[str, Any]) -> GenerateResponse:
        if Features.TOKEN_PROMPTS in self.state.features:
            wire_prompts: list = rows
        else:  # the vendor's servers take text only
            wire_prompts = [self.tokens.tokenizer.decode(r, skip_special_tokens=False) for r in rows]
        payload = self.state.dialect.generate_payload(wire_prompts, wire_params)
        what = f"POST {Paths.GENERATE}"
        out = self.calls.post(Paths.GENERATE, JobType.SAMPLING, payload, op="generate", idempotent=True).answer(what)
        return parse_answer(GenerateResponse, out, what)


def unique_layers(rows: list[list[int]]) -> list[list[int]]:
    """Row indices in layers without a repeated prompt: layer ``k`` holds the ``k``-th copy of each prompt.

    A seed in ``sampling_params`` is one per call, and a vLLM-backed server (the vendor's) applies it to each
    prompt of the call: two copies of a prompt in one seeded call would sample the same tokens, and a GRPO
    group of them would have zero advantages. So a call with a derived seed is sent one layer at a time, each
    layer with its own seed; with no repeated prompt that is the one call as before.
    """
    seen: Counter[tuple[int, ...]] = Counter()
    layers: list[list[int]] = []
    for i, row in enumerate(rows):
        k = seen[tuple(row)]
        seen[tuple(row)] += 1
        if k == len(layers):
            layers.append([])
        layers[k].append(i)
    return layers
