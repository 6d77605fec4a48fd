"""The vLLM sampling engine: ``/generate`` on vLLM's engine, inside the server process.

Chosen by ``--sampler vllm`` (or ``auto`` on a CUDA machine with ``vllm``; see
:mod:`.sampler_choice`). It answers the same ``/generate`` requests as the ``transformers``
:class:`~.sampling.SamplingEngine` with the same result fields:

* prompts are token ids (text prompts are tokenised with the model's tokenizer first) and go to
  vLLM as ``TokensPrompt``; vLLM's tokenizer is never loaded (``skip_tokenizer_init``);
* ``n``, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1/0 = off), ``max_tokens``,
  ``stop_token_ids``, ``ignore_eos``, ``seed`` and ``logprobs`` map onto vLLM's
  ``SamplingParams``, one per prompt (a seed is per prompt: :func:`prompt_seeds`); the EOS ids are
  stop tokens unless ``ignore_eos``; the stop token is kept in ``token_ids`` as in the
  ``transformers`` sampler;
* a sampled token's log-prob is vLLM's ``processed_logprobs``: ``log_softmax(logits / temperature)``
  (temperature 1 when greedy), the distribution verl recomputes and the ``transformers``
  sampler reports. With ``top_k``/``top_p`` truncation on, vLLM renormalises over the kept
  tokens first, so there its log-probs are those of the truncated distribution;
* ``stop`` strings are applied to the decoded text after generation, exactly as the
  ``transformers`` sampler does (text cut before the stop string, tokens kept up to the one that
  completed it, ``finish_reason="stop"``);
* ``prefix_cache_len`` is the number of prompt tokens vLLM's prefix cache served.

Continuous batching: every ``/generate`` call is queued into one running batch (:mod:`.continuous`,
:mod:`.vllm_steps`): a thread steps vLLM's in-process ``LLMEngine``, calls that arrive while others run join the
batch between steps, and each call is answered when its own sequences end, with ``weight_version`` the version it
ran on. Weight loads, sleep, wake and prefix-cache resets run on that thread between two engine steps, so no step
sees half-updated weights and no answer mixes two versions. What each does with the calls in flight:

* a weight load, under ``--in-flight-on-weight-load restart``, waits for the running step only, aborts the calls in
  flight, lets vLLM settle the step it may still run for them (:func:`.vllm_steps.settle`), loads, resets the
  prefix cache and admits those calls again from their prompts and seeds: each answers with the new version
  (``info()["restarted_on_weight_load"]`` counts them). Under ``wait`` (the default) it waits for them to end on
  the old version;
* a sleep waits for the calls in flight to end (it frees the KV cache they decode into; no call is dropped);
* a wake, a weight-norm read and (policy ``restart``) a prefix-cache reset run at the next step boundary: an engine
  with a part asleep admits no call, and no cached block is stale while calls run (the last load reset the cache
  before any was admitted; vLLM keeps the blocks of running requests and says ``busy``).

By default the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a ``/weight-sync`` from a
training job on the same GPU hands its live tensors to ``model.load_weights`` with no host round trip;
``--vllm-engine-process own`` puts vLLM's engine core in a process of its own, the sync then going through a shared
CUDA buffer (:mod:`.vllm_process` holds what differs). The prefix cache is reset after every sync, and the next
``/generate`` uses the new weights. GPU memory: vLLM takes
``vllm_config.gpu_memory_utilization`` of the device (default :data:`DEFAULT_GPU_MEMORY_UTILIZATION`), leaving the
rest to the training and log-prob jobs; :meth:`sleep` / :meth:`wake_up` (``/sleep-inference``, ``/wake-inference``)
free and restore vLLM's share around training (:mod:`.vllm_sleep`: a sleep other processes' allocations disturb).
Engine options come from the job's ``vllm_config`` (:data:`VLLM_OPTIONS`).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from arctic_rl.protocol import GenerateRequest, JobConfig, JobType, SamplingParams
from arctic_rl.server.engines.common import (
    _model_source,
    compute_dtype,
    ensure_process_group,
    load_tokenizer,
    resolve_device,
)
from arctic_rl.server.engines.continuous import Call, ContinuousLoop, Pending, When
from arctic_rl.server.engines.device_memory import DeviceMemory
from arctic_rl.server.engines.prompts import check_context, prompt_token_ids, stop_token_ids
from arctic_rl.server.engines.vllm_answer import answer_from_outputs
from arctic_rl.server.engines.vllm_options import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    MAX_LOGPROBS,
    VLLM_OPTIONS,
    engine_options,
    prompt_seeds,
)
from arctic_rl.server.engines.vllm_process import engine_process
from arctic_rl.server.engines.vllm_sleep import fall_asleep
from arctic_rl.server.engines.vllm_steps import VllmCall, VllmStepCore
from arctic_rl.server.engines.weights import is_device_fault
from arctic_rl.server.errors import BadRequest, Conflict
from arctic_rl.server.memory import device_report
from arctic_rl.server.settings import ServerSettings

__all__ = ["DEFAULT_GPU_MEMORY_UTILIZATION", "MAX_LOGPROBS", "VLLM_OPTIONS", "VllmSamplingEngine", "engine_options",
           "prompt_seeds"]

logger = logging.getLogger("arctic_rl.server")

_WAKE_TAGS = ("weights", "kv_cache")


def _final_only(params: Any) -> None:
    """Ask vLLM for a request's final output only (as ``LLM.generate`` does): one ``RequestOutput`` per prompt."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY


class VllmSamplingEngine:
    """Generation on an in-process ``vllm.LLM`` (see the module docstring)."""

    job_type = JobType.SAMPLING
    device_memory: DeviceMemory | None = None  #: sleep and wake's memory functions (None: the device's)
    #: ``restart`` or ``wait``: the calls in flight at a weight load (``--in-flight-on-weight-load``)
    in_flight_on_weight_load = "wait"
    startup_outside_allocator: int | None = None  #: bytes vLLM's start left outside PyTorch's allocator

    def __init__(self, config: JobConfig, settings: ServerSettings, job_dir: Path | None = None) -> None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no FlashInfer JIT build on first use
        self.config = config
        self.in_flight_on_weight_load = settings.in_flight_on_weight_load
        self.device = resolve_device(settings.device)
        if self.device.type != "cuda":
            raise RuntimeError("the vLLM sampler needs --device cuda")
        self.dtype = compute_dtype(self.device)
        self.process = engine_process(settings.vllm_engine_process, self.device, self.dtype)
        self.process.claim_env()
        from vllm import LLM

        self.options = engine_options(config.vllm_config)
        self.tokenizer = load_tokenizer(config.model_name)
        # Training, log-prob and vLLM share one world-size-1 process group whichever job comes first.
        ensure_process_group(self.device)
        mem, t0 = self._memory(), time.perf_counter()
        start = mem.mark()
        self.llm = LLM(
            model=_model_source(config.model_name),
            skip_tokenizer_init=True,
            dtype=self.dtype,
            seed=0,
            enable_sleep_mode=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=MAX_LOGPROBS,
            **self.options,
            **self.process.llm_options(),
        )
        model_config = self.llm.llm_engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        eos = getattr(model_config.hf_config, "eos_token_id", None)
        gen_eos = None
        try:
            gen_eos = model_config.try_get_generation_config().get("eos_token_id")
        except Exception:  # noqa: BLE001 - a model without a generation config
            gen_eos = None
        eos = gen_eos if gen_eos is not None else eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.weight_version = 0
        self.sleeping: dict[str, bool] = dict.fromkeys(_WAKE_TAGS, False)
        self.sleep_level = 0
        self.weights_discarded = False
        # the engine's start-up passes (profiling, CUDA-graph capture) leave cached blocks: back before jobs train
        released = mem.release_unused()["allocator_released_bytes"]
        self.startup_outside_allocator = mem.grown_outside_allocator(start)
        logger.info(
            "vLLM sampler ready in %.1fs (engine core in the %s process, gpu_memory_utilization=%s, max_model_len=%d, "
            "options=%s); %.2f GB of cached blocks released; %.2f GiB of device memory its start left outside "
            "PyTorch's allocator", time.perf_counter() - t0, self.process.mode,
            self.options["gpu_memory_utilization"], self.max_model_len, self.options,
            released / 1e9, self.startup_outside_allocator / (1 << 30),
        )

    def _memory(self) -> DeviceMemory:
        """Sleep and wake's memory functions: the injected ones, else the device's."""
        return self.device_memory or DeviceMemory.of(self.device)

    def _vllm_params(self, params: SamplingParams, prompts: list[list[int]]):
        """One ``vllm.SamplingParams`` per prompt (their seeds: :func:`prompt_seeds`)."""
        from vllm import SamplingParams as VllmParams

        check_context(prompts, params, self.max_model_len, "the engine's max_model_len")
        stop_ids = stop_token_ids(params, self.vocab_size, self.eos_ids)
        n_top = int(params.logprobs) if params.wants_logprobs else None  # the sampled token + the top `logprobs`
        if n_top is not None and not 0 <= n_top <= MAX_LOGPROBS:
            raise BadRequest("sampling_params.logprobs: how many top tokens to report per generated token",
                             field="sampling_params.logprobs", allowed=f"0..{MAX_LOGPROBS}", received=params.logprobs)
        if params.sampled_logprobs_only:
            n_top = 0  # the compact shape: vLLM computes the sampled token's log-prob alone
        common = {
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": max(0, params.top_k),
            "max_tokens": params.max_tokens,
            "stop_token_ids": sorted(stop_ids),
            "ignore_eos": params.ignore_eos,
            "logprobs": n_top,
            "detokenize": False,
        }
        seeds = prompt_seeds(params.seed, len(prompts), params.n)
        return [VllmParams(seed=seed, **common) for seed in seeds]

    def _check_awake(self) -> None:
        asleep = [tag for tag, off in self.sleeping.items() if off]
        if asleep:
            raise Conflict(
                f"the vLLM sampler is asleep ({', '.join(asleep)} released by /sleep-inference level "
                f"{self.sleep_level}); call /wake-inference first",
                field="job_id",
                allowed="an awake sampling job",
                received="asleep",
            )
        if self.weights_discarded:
            raise Conflict(
                "the vLLM sampler's weights were discarded by /sleep-inference level 2; run /weight-sync first",
                field="job_id",
                allowed="a sampling job with weights",
                received="weights discarded",
            )

    def _loop(self) -> ContinuousLoop:
        """The continuous-batching loop around ``llm.llm_engine`` (made on first use, see :mod:`.vllm_steps`)."""
        loop = self.__dict__.get("_generation_loop")
        if loop is None:
            from vllm.inputs import TokensPrompt

            core = VllmStepCore(self.llm.llm_engine, make_prompt=lambda ids: TokensPrompt(prompt_token_ids=ids),
                                final_only=_final_only, weight_version=lambda: self.weight_version,
                                ready=self._check_awake, alone=bool(self.config.full_determinism))
            loop = self._generation_loop = ContinuousLoop(core, name="vLLM sampler")
        return loop

    def _control(self, fn, when: When = "idle"):
        """Run ``fn`` on the engine's loop thread between two steps; ``when`` decides what happens to the calls in
        flight (module docstring)."""
        return self._loop().control(fn, when=when)

    def _weights_when(self, restart: When) -> When:
        """``restart`` (the given way) under the ``restart`` policy, else wait for the calls in flight."""
        return restart if self.in_flight_on_weight_load == "restart" else "idle"

    def submit_generate(self, request: GenerateRequest, params: SamplingParams) -> Pending:
        """Validate a ``/generate`` call and queue it into the running batch; the answer is built by
        :meth:`Pending.finish` once its sequences are done (see :mod:`.continuous`)."""
        prompts = prompt_token_ids(self.tokenizer, list(request.prompts), self.vocab_size)
        vllm_params = self._vllm_params(params, prompts)
        self._check_awake()

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

        def build(call: Call, outputs: list[Any]) -> list[dict[str, Any]]:
            return answer_from_outputs(outputs, prompts, params, decode=decode, weight_version=call.weight_version)

        loop = self._loop()
        return Pending(loop, loop.submit(VllmCall(prompts, vllm_params)), build)

    def generate(self, request: GenerateRequest, params: SamplingParams) -> list[dict[str, Any]]:
        """``/generate`` from a worker thread: queued into the running batch, answered when its sequences end."""
        t0 = time.perf_counter()
        results = self.submit_generate(request, params).result()
        logger.debug("vLLM generated %d samples in %.2fs", len(results), time.perf_counter() - t0)
        return results

    def load_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """Copy the training job's live tensors into vLLM's model (GPU to GPU) and bump the version, after the
        running step: the calls in flight restart on the new weights (or, policy ``wait``, finish first)."""
        return self._control(lambda: self._load_weights(weights), self._weights_when("restart"))

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> int:
        if not self.sleeping["kv_cache"]:
            self.process.settle(self.llm)  # the step vLLM may still run for the calls just taken out, first
        if self.sleeping["weights"]:
            self.llm.wake_up(tags=["weights"])
            self.sleeping["weights"] = False
        try:
            self.process.load(self.llm, weights)
        except (KeyError, ValueError, AssertionError, RuntimeError) as exc:
            if is_device_fault(exc):  # the device failed, not the weights: an internal error (500), not the caller's
                raise
            raise BadRequest(
                f"target_sub_job_ids: the sampling job's model does not take the training model's weights: {exc}",
                field="target_sub_job_ids",
            ) from None
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.weights_discarded = False
        self.weight_version += 1
        return self.weight_version

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Release vLLM's GPU memory: level 1 keeps the weights in host memory, level 2 discards them
        (the next ``/weight-sync`` brings them back). Calls in flight finish first."""
        if level not in (1, 2):
            raise BadRequest("level: the vLLM sleep level", field="level", allowed=[1, 2], received=level)
        return self._control(lambda: self._sleep(level))

    def _sleep(self, level: int) -> dict[str, Any]:
        mem = self._memory()
        if all(self.sleeping.values()):
            return {"status": "sleeping", "level": self.sleep_level, "seconds": 0.0, "freed_bytes": 0,
                    "weight_version": self.weight_version, **mem.unchanged()}
        if any(self.sleeping.values()):  # half awake (weights woken for a sync): wake fully, then sleep
            self.llm.wake_up()
        mem.synchronize()
        free_before = mem.free()
        t0 = time.perf_counter()
        # At level 2 the weights are gone from here on, even when vLLM's check then refuses the sleep
        # (awake again, without them): the next wake needs a /weight-sync either way.
        self.weights_discarded = self.weights_discarded or level == 2
        attempts = fall_asleep(self.llm, level)  # tried again when another process's allocation fails vLLM's check
        seconds = time.perf_counter() - t0
        freed = mem.free() - free_before
        released = mem.release_unused()  # generation's cached blocks: training allocates afresh, not on top of them
        self.sleeping = dict.fromkeys(_WAKE_TAGS, True)
        self.sleep_level = level
        logger.info("vLLM sampler asleep (level %d): %.2f GB freed in %.2fs%s; %.2f GB of unused cached blocks released",
                    level, freed / 1e9, seconds, f" ({attempts} attempts)" if attempts > 1 else "",
                    released["allocator_released_bytes"] / 1e9)
        return {"status": "sleeping", "level": level, "seconds": seconds, "freed_bytes": int(freed),
                "weight_version": self.weight_version, **released}

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Take vLLM's GPU memory back (``tags``: ``weights`` and/or ``kv_cache``; default both)."""
        wanted = list(_WAKE_TAGS) if tags is None else list(tags)
        bad = [t for t in wanted if t not in _WAKE_TAGS]
        if bad:
            raise BadRequest("tags: what to wake", field="tags", allowed=list(_WAKE_TAGS), received=bad[0])
        return self._control(lambda: self._wake_up(wanted), "step")

    def _wake_up(self, wanted: list[str]) -> dict[str, Any]:
        todo = [t for t in wanted if self.sleeping[t]]
        mem = self._memory()
        t0 = time.perf_counter()  # training's unused cached blocks go first: the KV cache must not stack on them
        released = mem.release_unused() if todo else mem.unchanged()
        if todo:
            self.llm.wake_up(tags=todo)
            for tag in todo:
                self.sleeping[tag] = False
        if self.awake:
            self.sleep_level = 0
        seconds = time.perf_counter() - t0
        logger.info("vLLM sampler woke %s in %.2fs (%.2f GB of unused cached blocks released first)",
                    todo or "nothing (already awake)", seconds, released["allocator_released_bytes"] / 1e9)
        asleep = sorted(tag for tag, off in self.sleeping.items() if off)
        return {"status": "partly_awake" if asleep else "awake", "asleep": asleep, "woken": todo,
                "seconds": seconds, "weights_discarded": self.weights_discarded, **released}

    @property
    def awake(self) -> bool:
        """Whether every part (weights, KV cache) is awake."""
        return not any(self.sleeping.values())

    def reset_prefix_cache(self) -> dict[str, Any]:
        """Drop vLLM's cached prompt blocks (asleep, the KV cache is already gone: nothing to drop) at the next step
        boundary (policy ``wait``: once the calls in flight have finished)."""
        ok = self._control(lambda: bool(self.llm.reset_prefix_cache()) if self.awake else True,
                           self._weights_when("step"))
        return {"status": "ok" if ok else "busy", "reset": ok}

    def weight_norm(self) -> dict[str, Any]:
        if self.sleeping["weights"]:
            raise Conflict("the vLLM sampler's weights are asleep; call /wake-inference first", field="job_id",
                           allowed="an awake sampling job", received="asleep")
        return self._control(lambda: self.process.weight_norm(self.llm), "step")

    def memory_report(self) -> dict[str, int]:
        """Bytes by part (:mod:`arctic_rl.server.memory`): the worker's weights and KV cache (reached through
        ``collective_rpc``; on the loop's thread at a step boundary where the engine core runs apart), plus the
        device's figures."""
        read = lambda: self.process.memory_parts(self.llm)
        parts = {**(read() if self.process.rpc_from_any_thread else self._control(read, "step")),
                 **device_report(self.device)}
        if self.startup_outside_allocator is not None and "device_in_use" in parts:  # a CUDA figure, as those
            parts["startup_outside_allocator"] = int(self.startup_outside_allocator)
        return parts

    def info(self) -> dict[str, Any]:
        loop = self.__dict__.get("_generation_loop")
        return {
            "sampler": "vllm",
            "weight_version": self.weight_version,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.options["gpu_memory_utilization"],
            "sleeping": not self.awake,
            "sleep_level": self.sleep_level,
            "continuous_batching": True,
            "engine_process": self.process.mode,
            "generate_in_flight": loop.in_flight() if loop is not None else 0,
            "in_flight_on_weight_load": self.in_flight_on_weight_load,
            "restarted_on_weight_load": loop.restarted if loop is not None else 0,
        }

    def close(self) -> None:
        loop = self.__dict__.pop("_generation_loop", None)
        if loop is not None:
            loop.close("destroyed")
        self.process.close(self.llm)
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        del self.llm
        gc.collect()
        torch.cuda.empty_cache()
