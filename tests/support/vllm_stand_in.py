"""vLLM's outputs as ``llm.generate`` returns them, and the server's vLLM engine around such an ``llm``,
for the CPU tests and the CPU benchmark of the engine's ``/generate`` answer (no vLLM on those machines).

Only the fields the engine reads are modelled (``vllm.outputs.RequestOutput`` / ``CompletionOutput``,
``vllm.logprobs.Logprob``). :func:`vllm_stand_in_modules` gives the two vLLM names ``generate`` imports
at call time; the caller installs them in ``sys.modules`` (a test through ``monkeypatch``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

from arctic_rl.tiny_models import build_char_tokenizer


@dataclass
class Logprob:  # vllm.logprobs.Logprob's fields
    logprob: float
    rank: int | None
    decoded_token: str | None = None


@dataclass
class Completion:  # vllm.outputs.CompletionOutput's fields read by the engine
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str = "length"


@dataclass
class RequestOutput:
    outputs: list[Completion]
    num_cached_tokens: int = 0
    request_id: str = ""
    finished: bool = True


@dataclass
class OutputsOf:
    """Stands in for ``vllm.LLM``: its ``llm_engine`` (vLLM's ``LLMEngine`` interface: ``add_request``, ``step``,
    ``abort_request``, ``has_unfinished_requests``) finishes every request added since the last step at the next
    step, with the given outputs in the order the requests came; ``calls`` records each step's prompts and params."""

    outputs: list[RequestOutput]
    calls: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.llm_engine = self
        self._added: list = []

    def add_request(self, request_id, prompt, params):
        self._added.append((request_id, prompt, params))
        return request_id

    def step(self):
        added, self._added = self._added, []
        self.calls.append(([p for _, p, _ in added], [sp for _, _, sp in added]))
        for (request_id, _, _), out in zip(added, self.outputs, strict=True):
            out.request_id = request_id
        return self.outputs[: len(added)]

    def has_unfinished_requests(self) -> bool:
        return bool(self._added)

    def abort_request(self, request_ids) -> None:
        self._added = [a for a in self._added if a[0] not in set(request_ids)]


def vllm_stand_in_modules() -> dict[str, types.ModuleType]:
    """``vllm`` (its ``SamplingParams`` keeps the keywords it is given) and ``vllm.inputs`` (``TokensPrompt``)."""
    vllm, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    sampling = types.ModuleType("vllm.sampling_params")
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs.TokensPrompt = dict
    sampling.RequestOutputKind = types.SimpleNamespace(CUMULATIVE=0, DELTA=1, FINAL_ONLY=2)
    return {"vllm": vllm, "vllm.inputs": inputs, "vllm.sampling_params": sampling}


def engine_around(llm: Any, *, vocab_size: int, max_model_len: int, weight_version: int = 0,
                  full_determinism: bool = False, process: Any = None):
    """The server's :class:`~arctic_rl.server.engines.vllm_sampler.VllmSamplingEngine` without building vLLM:
    its ``llm`` is the given one, its tokenizer the project's character tokenizer, awake, no EOS ids; the engine core
    in the server's process unless ``process`` (a :mod:`~arctic_rl.server.engines.vllm_process` mode) says else."""
    import torch

    from arctic_rl.protocol import JobConfig, JobType
    from arctic_rl.server.engines.vllm_process import SameProcess
    from arctic_rl.server.engines.vllm_sampler import VllmSamplingEngine

    eng = VllmSamplingEngine.__new__(VllmSamplingEngine)
    eng.process = process if process is not None else SameProcess(torch.device("cpu"), torch.float32)
    eng.config = JobConfig(model_name="stand-in", job_type=JobType.SAMPLING, full_determinism=full_determinism)
    eng.llm, eng.tokenizer = llm, build_char_tokenizer()
    eng.max_model_len, eng.vocab_size, eng.eos_ids, eng.weight_version = max_model_len, vocab_size, set(), weight_version
    eng.sleeping, eng.weights_discarded = {"weights": False, "kv_cache": False}, False
    return eng


class StepwiseLLM:
    """Stands in for ``vllm.LLM`` with a step-wise engine (vLLM's ``LLMEngine`` interface): each ``step`` gives every
    running request one token, the engine's current weight version (so an answer that spans a weight load shows two
    values), and a request ends after its ``max_tokens`` steps with ``n`` completions. ``add_request`` returns an id
    with a suffix, as vLLM's does, and outputs carry the caller's id; ``collective_rpc`` (a weight load) bumps the
    version and refuses while requests run, as a real load would corrupt them."""

    def __init__(self) -> None:
        self.llm_engine = self
        self.version = 100
        self.running: dict[str, list] = {}  # request id -> [params, tokens per sample]
        self.steps = 0
        self.max_running = 0

    def add_request(self, request_id, prompt, params):
        self.running[request_id] = [params, [[] for _ in range(params.n)]]
        self.max_running = max(self.max_running, len(self.running))
        return f"{request_id}-internal"

    def step(self):
        self.steps += 1
        done = []
        for request_id, (params, samples) in list(self.running.items()):
            for tokens in samples:
                tokens.append(self.version)
            if len(samples[0]) >= params.max_tokens:
                del self.running[request_id]
                done.append(RequestOutput([Completion(j, list(t), None) for j, t in enumerate(samples)],
                                          request_id=request_id))
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def collective_rpc(self, fn, args=()):
        if self.running:
            raise RuntimeError("weights loaded while requests run")
        self.version += 1
        return [len(args[0]) if args else 0]

    def reset_prefix_cache(self) -> bool:
        return not self.running


class SleepModeLLM(StepwiseLLM):
    """:class:`StepwiseLLM` with vLLM 0.26's sleep bookkeeping, as far as the server's sleep relies on it: ``sleep``
    pauses the scheduler, the worker releases its memory, then vLLM's check of the device's free memory fails for the
    attempts listed in ``check_fails`` (1-based) -- raising before the executor records the sleep, as vLLM's
    ``Executor.sleep`` does -- or the executor records it. ``wake_up`` wakes the executor only if it recorded a sleep
    (else does nothing, as vLLM's warns "Executor is not sleeping") and resumes the scheduler once the executor is
    awake; ``tags=["scheduling"]`` resumes the scheduler alone. ``collective_rpc("wake_up")`` is the worker's own
    wake. ``step`` and a weight load fail on unmapped memory, as vLLM's do (``CUDA error: invalid argument``).
    ``apart``: the engine core runs in a process of its own, so the check's failure reaches the caller as vLLM's
    client raises a failed call: a plain ``Exception`` with the call's text."""

    def __init__(self, check_fails: tuple[int, ...] = (), apart: bool = False) -> None:
        super().__init__()
        self.apart = apart
        self.check_fails = set(check_fails)
        self.attempts = 0
        self.mapped = True  # the worker's memory
        self.executor_sleeping = False
        self.paused = False

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.paused = True
        self.mapped = False
        self.attempts += 1
        if self.attempts in self.check_fails:
            if self.apart:
                raise Exception("Call to sleep method failed: Memory usage increased after sleeping.")  # noqa: TRY002
            raise AssertionError("Memory usage increased after sleeping.")
        self.executor_sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if (tags is None or tags) and self.executor_sleeping:
            self.mapped, self.executor_sleeping = True, False  # (a partial wake is not modelled)
        if not self.executor_sleeping:
            self.paused = False

    def _check_mapped(self) -> None:
        if not self.mapped:
            raise RuntimeError("CUDA error: invalid argument")

    def step(self):
        self._check_mapped()
        if self.paused:
            return []
        return super().step()

    def collective_rpc(self, fn, args=(), kwargs=None):
        if fn == "wake_up":
            self.mapped = True
            return [None]
        self._check_mapped()
        return super().collective_rpc(fn, args)
