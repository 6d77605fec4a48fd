"""The sampling engine: generation from its own copy of the weights (``transformers``).

A ``/generate`` request is ``{prompts, sampling_params}``; prompts are strings (tokenised with
the model's tokenizer) or token-id lists (used as given -- :data:`Features.TOKEN_PROMPTS`).
``n`` samples per prompt are really generated; results are grouped by prompt
(``results[i*n:(i+1)*n]`` belong to prompt ``i``) and carry ``prompt_index``, ``sample_index``
and the engine's ``weight_version`` (bumped by every ``/weight-sync``). Rows are generated in
chunks of at most ``generate_batch_size`` (``vllm_config.max_num_seqs`` when the job sets it).
One :class:`torch.Generator` per request, seeded from ``seed`` (random when absent), makes a
seeded request reproducible. The loop itself is :mod:`.generation`; on CUDA, requests without stop
strings take :mod:`.fast_generation` (static cache, compiled decode step, batch buckets).

With ``logprobs=k`` each result carries, per generated token, the vendor's (vLLM's) entry
``{str(token_id): {"logprob", "rank"}}`` for the sampled token and the ``k`` most likely tokens; with
``logprobs_format="sampled"`` (:data:`Features.COMPACT_RESULTS`) the sampled token's log-prob alone, one float
per token, and with ``detokenize=false`` no ``text`` (both samplers: :func:`result_logprobs`, :func:`result_text`).
A sampler exposes ``generate``, ``load_weights``, ``info``, ``sleep``, ``wake_up``,
``reset_prefix_cache`` and ``weight_norm`` (the routes of :mod:`arctic_rl.server.app` call them).

A weight load (``/weight-sync``) runs on the generation loop's thread between two decode steps (:mod:`.continuous`).
With the server's ``--in-flight-on-weight-load wait`` (the default) it waits for the calls in flight to end on the
old weights; with ``restart`` it waits for the running step only: the calls in flight leave the batch, the weights
load, and those calls run again from their prompts and seeds on the new weights, answering with the new version
(``info()["restarted_on_weight_load"]`` counts them). Sleep, wake and the prefix-cache reset only record state
here (this sampler keeps its weights and no prefix cache), so they wait for nothing.
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from arctic_rl.protocol import GenerateRequest, JobConfig, JobType, SamplingParams
from arctic_rl.server.engines.common import compute_dtype, load_model, load_tokenizer, model_vocab_size, resolve_device
from arctic_rl.server.engines.continuous import Call, ContinuousLoop, Pending, When
from arctic_rl.server.engines.device_memory import DeviceMemory
from arctic_rl.server.engines.fast_generation import can_run_static, generate_batch_static
from arctic_rl.server.engines.generation import Decoding, generate_batch
from arctic_rl.server.engines.hf_steps import HfCall, HfStepCore
from arctic_rl.server.engines.prompts import check_context, prompt_token_ids, stop_token_ids
from arctic_rl.server.engines.weights import copy_weights, weight_norm
from arctic_rl.server.errors import BadRequest, from_validation_error
from arctic_rl.server.memory import JobMemory
from arctic_rl.server.settings import ServerSettings

__all__ = ["SamplingEngine", "parse_generate_request", "result_logprobs", "result_text", "sample_result",
           "vendor_logprobs"]

logger = logging.getLogger("arctic_rl.server")

#: prompts x n of one request
MAX_ROWS_PER_REQUEST = 65536


def parse_generate_request(obj: Any) -> tuple[GenerateRequest, SamplingParams]:
    """Validate a decoded ``/generate`` body (400 naming the field)."""
    if not isinstance(obj, dict):
        raise BadRequest(
            "body: expected an object {prompts, sampling_params}", field="body", received=type(obj).__name__
        )
    try:  # sampling_params is typed in: one validation, errors named ``sampling_params.<field>``
        request = GenerateRequest.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    params = request.sampling_params or SamplingParams()
    if len(request.prompts) * params.n > MAX_ROWS_PER_REQUEST:
        raise BadRequest(
            f"prompts x n = {len(request.prompts) * params.n} exceeds {MAX_ROWS_PER_REQUEST}",
            field="sampling_params.n",
            allowed=MAX_ROWS_PER_REQUEST,
            received=len(request.prompts) * params.n,
        )
    return request, params


def vendor_logprobs(candidates: list[dict[int, tuple[float, int]]]) -> list[dict[str, dict[str, float | int]]]:
    """Per-token candidates in the vendor's (vLLM's) answer format: ``[{str(token_id): {"logprob", "rank"}}]``."""
    return [{str(tok): {"logprob": lp, "rank": rank} for tok, (lp, rank) in step.items()} for step in candidates]


def result_logprobs(
    token_ids: list[int], candidates: list[dict[int, tuple[float, int]]], params: SamplingParams
) -> list[dict[str, dict[str, float | int]]] | list[float] | None:
    """A result's ``logprobs`` in the shape the request asked for (None when it asked for none)."""
    if not params.wants_logprobs:
        return None
    if params.sampled_logprobs_only:
        return [float(step[tok][0]) for tok, step in zip(token_ids, candidates, strict=True)]
    return vendor_logprobs(candidates)


def result_text(text: str, params: SamplingParams) -> str:
    """A result's ``text``: empty when the request asked for token ids only (``detokenize=false``)."""
    return text if params.wants_text else ""


def sample_result(
    *,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    prompt_len: int,
    prefix_cache_len: int,
    logprobs: list[Any] | None,
    prompt_index: int,
    sample_index: int,
    weight_version: int,
) -> dict[str, Any]:
    """One entry of ``/generate``'s ``results`` (the vendor's keys), as every sampling engine writes it."""
    return {
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "prompt_len": prompt_len,
        "generation_len": len(token_ids),
        "prefix_cache_len": prefix_cache_len,
        "logprobs": logprobs,
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "weight_version": weight_version,
    }


class SamplingEngine:
    """The transformers sampler (see the module docstring).

    Sleep, wake and the prefix cache, with the semantics the vendor's routes give them (a vLLM engine
    implements the same three methods for real): ``sleep(level)`` marks the engine asleep -- this
    sampler keeps its weights where they are (nothing to free on CPU; on a GPU they stay resident), a
    ``/generate`` while asleep still works, as vLLM answers after a wake; ``wake_up(tags)`` marks the
    given parts (``weights``, ``kv_cache``; all when ``None``) awake; ``reset_prefix_cache()``
    drops cached prompt prefixes -- this sampler keeps none between requests (every request runs
    its prompts from scratch, ``prefix_cache_len`` is 0), so nothing can come from old weights.
    Each returns a small status dict; counters record the calls (``info()``).
    """

    job_type = JobType.SAMPLING
    device_memory: DeviceMemory | None = None  #: sleep and wake's memory functions (None: the device's)

    def __init__(self, config: JobConfig, settings: ServerSettings, job_dir: Path | None = None) -> None:
        self.config = config
        self.device = resolve_device(settings.device)
        self.dtype = compute_dtype(self.device)
        vllm_config = config.vllm_config or {}
        attn = config.ds_worker_config.attn_implementation if config.ds_worker_config else None
        self.model = load_model(config.model_name, device=self.device, dtype=self.dtype, attn_implementation=attn)
        self.model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(config.model_name)
        self.vocab_size = model_vocab_size(self.model)
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        max_seqs = vllm_config.get("max_num_seqs")
        self.batch_size = int(max_seqs) if isinstance(max_seqs, int) and max_seqs > 0 else settings.generate_batch_size
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else next(iter(self.eos_ids), 0))
        self.weight_version = 0
        #: ``restart`` or ``wait``: the calls in flight at a weight load
        #: (:data:`~arctic_rl.server.settings.IN_FLIGHT_ON_WEIGHT_LOAD`)
        self.in_flight_on_weight_load = settings.in_flight_on_weight_load
        self.asleep: set[str] = set()  # the parts put to sleep (``weights``, ``kv_cache``)
        self.prefix_cache_resets = 0
        if vllm_config:
            logger.info("sampling job: vllm_config is read for max_num_seqs only (transformers sampler)")

    # ------------------------------------------------------------------ generate

    def _prepare(self, request: GenerateRequest, params: SamplingParams):
        """A call's token-id prompts and how its rows are decoded (400 naming a bad field)."""
        prompts = prompt_token_ids(self.tokenizer, list(request.prompts), self.vocab_size)
        check_context(prompts, params, self.max_positions, "the model's context")
        stop_ids = stop_token_ids(params, self.vocab_size, self.eos_ids)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed))

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

        # vLLM: the sampled token + the top `logprobs`; the compact shape keeps the sampled token's value only
        top_k = (0 if params.sampled_logprobs_only else int(params.logprobs)) if params.wants_logprobs else None
        return prompts, Decoding(generator, stop_ids, self.pad_id, decode, top_k)

    def _result(self, sample, prompt_len: int, pi: int, si: int, params: SamplingParams, version: int) -> dict:
        return sample_result(
            text=result_text(sample.text, params),
            token_ids=sample.token_ids,
            finish_reason=sample.finish_reason,
            prompt_len=prompt_len,
            prefix_cache_len=0,
            logprobs=result_logprobs(sample.token_ids, sample.candidates, params),
            prompt_index=pi,
            sample_index=si,
            weight_version=version,
        )

    # ------------------------------------------------------------------ continuous batching (the server's path)

    def _loop(self) -> ContinuousLoop:
        loop = self.__dict__.get("_generation_loop")
        if loop is None:
            core = HfStepCore(self.model, pad_id=self.pad_id, weight_version=lambda: self.weight_version,
                              max_rows=self.batch_size, alone=bool(self.config.full_determinism))
            loop = self._generation_loop = ContinuousLoop(core, name="transformers sampler")
        return loop

    def submit_generate(self, request: GenerateRequest, params: SamplingParams) -> Pending:
        """Queue a ``/generate`` call into the running batch (:mod:`.hf_steps`); it is answered when its own rows
        end, whatever else runs."""
        prompts, d = self._prepare(request, params)

        def build(call: Call, samples: list) -> list[dict[str, Any]]:
            n = params.n
            return [self._result(s, len(prompts[i // n]), i // n, i % n, params, call.weight_version)
                    for i, s in enumerate(samples)]

        loop = self._loop()
        return Pending(loop, loop.submit(HfCall(prompts, params, d.generator, d.stop_ids, d.decode, d.top_logprobs)), build)

    # ------------------------------------------------------------------ one call at a time (in-process callers)

    def generate(self, request: GenerateRequest, params: SamplingParams) -> list[dict[str, Any]]:
        """One call on its own, in chunks of ``batch_size`` rows (on CUDA the compiled loop of
        :mod:`.fast_generation`); the server's ``/generate`` takes :meth:`submit_generate` instead."""
        prompts, decoding = self._prepare(request, params)
        rows = [(pi, si) for pi in range(len(prompts)) for si in range(params.n)]
        results: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            loop = generate_batch_static if self.device.type == "cuda" and can_run_static(params) else generate_batch
            samples = loop(self.model, [prompts[pi] for pi, _ in chunk], params, decoding)
            for (pi, si), sample in zip(chunk, samples, strict=True):
                results.append(self._result(sample, len(prompts[pi]), pi, si, params, self.weight_version))
        logger.debug("generated %d samples in %.2fs", len(results), time.perf_counter() - t0)
        return results

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """Copy the training model's weights in between two decode steps: the calls in flight restart on them, or
        (policy ``wait``) the load waits for those calls to end; calls queued meanwhile run on the new weights."""
        when: When = "restart" if self.in_flight_on_weight_load == "restart" else "idle"
        return self._loop().control(lambda: self._load_weights(weights), when=when)

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> int:
        copy_weights(self.model, weights)
        self.weight_version += 1
        return self.weight_version

    # ------------------------------------------------------------------ sleep, wake, prefix cache

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Mark the sampler asleep (level 1: weights kept; 2: weights may be discarded -- kept here)."""
        if level not in (1, 2):
            raise BadRequest("level: expected 1 or 2", field="level", allowed=[1, 2], received=level)
        self.asleep = {"weights", "kv_cache"}
        released = (self.device_memory or DeviceMemory.of(self.device)).release_unused()  # unused cached blocks
        return {"status": "sleeping", "level": level, "weight_version": self.weight_version, **released}

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Wake the given parts (``weights``, ``kv_cache``; ``None`` = all)."""
        allowed = ["weights", "kv_cache"]
        bad = [t for t in tags or [] if t not in allowed]
        if bad:
            raise BadRequest("tags: unknown part", field="tags", allowed=allowed, received=bad[0])
        todo = self.asleep & set(allowed if tags is None else tags)
        mem = self.device_memory or DeviceMemory.of(self.device)
        released = mem.release_unused() if todo else mem.unchanged()  # before generation allocates its cache
        self.asleep -= todo
        return {"status": "awake" if not self.asleep else "partly_awake", "asleep": sorted(self.asleep), **released}

    @property
    def awake(self) -> bool:
        """Whether no part is marked asleep."""
        return not self.asleep

    def reset_prefix_cache(self) -> dict[str, Any]:
        """Drop cached prompt prefixes (none are kept between requests by this sampler)."""
        self.prefix_cache_resets += 1
        return {"status": "ok", "prefix_cache_resets": self.prefix_cache_resets}

    def weight_norm(self) -> dict[str, Any]:
        return weight_norm(self.model)

    def info(self) -> dict[str, Any]:
        return {
            "asleep": sorted(self.asleep),
            "prefix_cache_resets": self.prefix_cache_resets,
            "weight_version": self.weight_version,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "batch_size": self.batch_size,
            "continuous_batching": True,
            "generate_in_flight": self._loop().in_flight() if "_generation_loop" in self.__dict__ else 0,
            "in_flight_on_weight_load": self.in_flight_on_weight_load,
            "restarted_on_weight_load": self._loop().restarted if "_generation_loop" in self.__dict__ else 0,
        }

    def memory_report(self) -> dict[str, int]:
        """Bytes by part (:mod:`arctic_rl.server.memory`): the weights of the model it holds."""
        return JobMemory(self.device).report(self.model)

    def close(self) -> None:
        loop = self.__dict__.pop("_generation_loop", None)
        if loop is not None:
            loop.close("destroyed")
        del self.model
