"""vLLM's in-process engine driven step by step: the core of the vLLM sampler's continuous batching.

:class:`VllmStepCore` is the :class:`~.continuous.StepCore` the vLLM sampler hands its
:class:`~.continuous.ContinuousLoop`: it adds each call's prompts to ``vllm.LLM``'s own ``LLMEngine``
(``add_request(request_id, TokensPrompt, SamplingParams)``, final outputs only), runs ``engine.step()``, and hands
back each call once all of its prompts' ``RequestOutput``s are in -- vLLM's scheduler mixes the prefill of new
requests into the decode of running ones, so calls join the running batch between steps.

Why not ``vllm.v1.engine.async_llm.AsyncLLM``: vLLM's async engine always runs its engine core in a separate
process (``EngineCoreClient.make_client`` refuses asyncio without multiprocessing), so a weight sync would become a
cross-process transfer. The synchronous ``LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine
core -- and the model -- in the server process: ``collective_rpc`` still copies the training job's live tensors
device to device. The loop thread gives it the async engine's behaviour (requests join while others run, each
answered when its own sequences end).

A weight load that finds calls in flight (the loop's ``"restart"``, :mod:`.continuous`) aborts their requests
(``LLMEngine.abort_request`` with the ids given to ``add_request``: vLLM drops them from its output processor and
scheduler and frees their KV blocks, so the prefix-cache reset after the load succeeds) and admits the calls again
afterwards: the same prompts and ``SamplingParams`` (so the same per-prompt seeds) under new request ids
(``c<call>-<prompt>r<restart>``), so no output of an aborted request can be taken for the new one. Between the abort
and the load, :func:`settle`: with async scheduling (vLLM's default) a step for the aborted requests may still be
in flight, and vLLM returns their KV blocks to the pool -- and lets its prefix cache be reset -- only once that step
is processed; the reset after the load must drop every prompt block computed on the old weights, or the restarted
call (same prompt) would reuse them.

Plain Python over vLLM's objects: no vLLM import, so the CPU tests drive it with a stand-in engine
(``tests/support/vllm_stand_in.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arctic_rl.server.engines.continuous import Call

__all__ = ["SETTLE_STEPS", "VllmCall", "VllmStepCore", "settle"]

#: engine steps :func:`settle` lets vLLM take to finish what it still runs for requests just aborted
SETTLE_STEPS = 8


@dataclass
class VllmCall:
    """A call's payload (token-id prompts and one ``vllm.SamplingParams`` per prompt) and its outputs so far."""

    prompts: list[list[int]]
    params: list[Any]
    outputs: list[Any] = field(default_factory=list)
    #: the ids given to vLLM (one per prompt) and any other id vLLM reports them under
    request_ids: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    left: int = 0


class VllmStepCore:
    """``LLMEngine.add_request`` / ``step`` behind the loop (see the module docstring).

    Args:
        engine: ``vllm.LLM(...).llm_engine`` (or an object with its ``add_request``, ``step``, ``abort_request``
            and ``has_unfinished_requests``).
        make_prompt: token ids -> the prompt object vLLM takes (``vllm.inputs.TokensPrompt``).
        final_only: sets a ``SamplingParams`` to report final outputs only (``RequestOutputKind.FINAL_ONLY``).
        weight_version: the engine's current weight version (read when a call is admitted).
        ready: raises when the engine cannot take a call now (asleep, weights discarded); run at admission.
        alone: every call runs in a batch of its own (a job created with ``full_determinism``: vLLM's batched kernels
            are not bit-identical across batch shapes, and a seeded call must sample the same whatever else runs).
    """

    def __init__(self, engine: Any, *, make_prompt: Callable[[list[int]], Any], final_only: Callable[[Any], None],
                 weight_version: Callable[[], int], ready: Callable[[], None] = lambda: None,
                 alone: bool = False) -> None:
        self.engine = engine
        self.alone = alone
        self.ready = ready
        self.make_prompt = make_prompt
        self.final_only = final_only
        self.weight_version = weight_version
        self._owner: dict[str, tuple[Call, int]] = {}

    def has_room(self, call: Call, admitting: list[Call]) -> bool:
        """Any call joins the running batch (vLLM's scheduler bounds it), unless calls run alone."""
        return not self.alone

    def admit(self, call: Call) -> None:
        job: VllmCall = call.payload
        self.ready()
        job.outputs = [None] * len(job.prompts)
        job.left = len(job.prompts)
        job.request_ids, job.aliases = [], []
        call.weight_version = self.weight_version()
        call.state = job
        try:
            for i, (prompt, params) in enumerate(zip(job.prompts, job.params, strict=True)):
                request_id = f"c{call.call_id}-{i}" + (f"r{call.restarts}" if call.restarts else "")
                self.final_only(params)
                job.request_ids.append(request_id)
                self._owner[request_id] = (call, i)
                internal = self.engine.add_request(request_id, self.make_prompt(prompt), params)
                if isinstance(internal, str) and internal != request_id:  # vLLM may suffix the id it keeps
                    job.aliases.append(internal)
                    self._owner[internal] = (call, i)
        except BaseException:
            self.abort(call)
            raise

    def step(self) -> list[tuple[Call, Any]]:
        finished: list[tuple[Call, Any]] = []
        outputs = self.engine.step()
        for out in outputs:
            if not getattr(out, "finished", True):
                continue
            owner = self._owner.get(out.request_id)
            if owner is None:
                continue  # a request of an aborted call, or one the engine ran for someone else
            call, i = owner
            job: VllmCall = call.state
            if job.outputs[i] is None:
                job.outputs[i] = out
                job.left -= 1
            if job.left == 0:
                self._forget(job)
                finished.append((call, job.outputs))
        if not outputs and not self.engine.has_unfinished_requests() and self._owner:
            stuck = sorted({c.call_id for c, _ in self._owner.values()})
            raise RuntimeError(f"vLLM engine has no unfinished request, but calls {stuck} have no output")
        return finished

    def abort(self, call: Call) -> None:
        job: VllmCall | None = call.state if isinstance(call.state, VllmCall) else None
        if job is None:
            return
        ids = [r for r in job.request_ids if r in self._owner]
        self._forget(job)
        if ids:
            self.engine.abort_request(ids)

    def _forget(self, job: VllmCall) -> None:
        for request_id in (*job.request_ids, *job.aliases):
            self._owner.pop(request_id, None)


def settle(llm: Any, steps: int = SETTLE_STEPS) -> None:
    """Step ``llm``'s engine (no request of ours left in it) until its prefix cache can be reset -- every KV block
    free -- and reset it; a ``RuntimeError`` after ``steps`` steps (the weights are then left as they were)."""
    for _ in range(steps):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()  # outputs of aborted requests only: vLLM drops them
    raise RuntimeError(f"vLLM still holds KV blocks {steps} steps after the calls in flight were taken out of it")
