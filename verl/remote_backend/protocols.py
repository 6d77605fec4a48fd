"""The compute contract a remote backend offers verl: an actor side and a sampler side.

:class:`~verl.remote_backend.base.RemoteBackend` is the *lifecycle* of a backend (create, handle,
destroy, and the per-step hooks ``update_weights`` and ``save_checkpoint``, as in verl's PR #7102).
What verl's worker and rollout server call on data is written down here, each method once, as two
``typing.Protocol``s:

* :class:`RemoteActor` -- used by :class:`~verl.remote_backend.workers.worker.RemoteActorRolloutRefWorker`:
  old and reference log-probs, the PPO/GRPO update, and ``load_checkpoint`` (verl's resume, which the
  PR's ABC does not declare);
* :class:`RemoteSampler` -- used by the rollout server of
  :mod:`verl.remote_backend.workers.replica`: token ids in, ``n`` samples per prompt out, with
  per-token log-probs. One result per sample is a :class:`SampleResult`-shaped mapping or object.

Both are ``runtime_checkable`` so that the contract kit (:mod:`verl.remote_backend.contract`) and a
worker at attach time can check that a registered backend offers them. A backend implements both *and*
the lifecycle ABC. An optional capability is a Protocol of its own, checked with ``isinstance``:
:class:`SamplerAdopter` (a sampler that lives client-side and follows the actor side's weight updates),
:class:`ReportsCallTimes` (a transport that reports its calls' seconds and the server's) and
:class:`SamplerSleep` (a sampler that frees its memory between generation phases) and :class:`ReadsTensorFields`
(the tensor fields of verl's batch each compute method reads, so that the forwarder reads no others).

TensorDict conventions (verl 0.9.1's engine workers): ``input_ids``/``position_ids`` are nested
(prompt + response per row, no padding); ``compute_log_prob`` / ``compute_ref_log_prob`` return a
TensorDict with nested ``log_probs`` (value ``k`` of a row = log p(token ``k+1``)), optionally
``entropy``, and a ``metrics`` dict; ``update_actor`` returns a TensorDict whose non-tensor
``metrics`` maps metric names to one value per mini-batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from tensordict import TensorDict

__all__ = [
    "ACTOR_METHODS",
    "COMPUTE_METHODS",
    "SAMPLER_METHODS",
    "SAMPLER_UPDATE_KEY",
    "ReadsTensorFields",
    "RemoteActor",
    "RemoteSampler",
    "ReportsCallTimes",
    "SampleResult",
    "SamplerAdopter",
    "SamplerSleep",
    "SamplingParams",
    "adopter_of",
    "fields_read",
    "fields_read_by",
    "result_field",
    "sleeper_of",
]

#: key of ``update_weights()``'s result that the worker forwards to every rollout server, whose
#: backend then gets it through :meth:`SamplerAdopter.adopt_sampler` (for samplers that live client-side)
SAMPLER_UPDATE_KEY = "sampler_update"

#: the backend-neutral sampling parameters of one ``generate`` call (``max_tokens``, ``temperature``,
#: ``top_p``, ``top_k``, ``seed``, ``stop``, ``logprobs``, ``n``, ...; see
#: :func:`verl.remote_backend.workers.replica.normalize_sampling_params`)
SamplingParams = Mapping[str, Any]


class SampleResult(Protocol):
    """One sample, as an object with these attributes (a mapping with these keys is accepted too)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None
    finish_reason: str | None


@runtime_checkable
class RemoteActor(Protocol):
    """The training side verl's forwarder worker calls (one call per verl call, data unchanged)."""

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs (and, when ``calculate_entropy``, entropy) of the current policy."""

    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs of the reference (initial) policy."""

    def update_actor(self, data: TensorDict) -> TensorDict:
        """One PPO/GRPO update over the batch (``ppo_epochs`` x mini-batches); returns metrics."""

    def load_checkpoint(self, step: int | None = None) -> Mapping[str, Any]:
        """Restore the state :meth:`RemoteBackend.save_checkpoint` saved for ``step`` (and sync the sampler)."""


@runtime_checkable
class RemoteSampler(Protocol):
    """The generation side verl's rollout server calls."""

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None
                 ) -> Sequence[SampleResult | Mapping[str, Any]]:
        """``n = sampling_params['n']`` (default 1) samples per prompt, in prompt order with the ``n``
        samples of a prompt adjacent; each result has ``token_ids``, ``logprobs`` (one per token, or
        ``None``) and ``finish_reason`` (``stop``/``length``/``abort``), see :class:`SampleResult`."""


@runtime_checkable
class SamplerAdopter(Protocol):
    """Optional capability of a backend whose sampler lives in the client process (e.g. a sampling
    client opened on a saved path): the rollout servers hand it what the actor side's
    ``update_weights`` returned under :data:`SAMPLER_UPDATE_KEY`. A backend that declares it
    implements both :class:`RemoteSampler` and this."""

    def adopt_sampler(self, data: Mapping[str, Any]) -> None:
        """Serve samples from the sampler ``data`` describes from now on (JSON data)."""


@runtime_checkable
class ReportsCallTimes(Protocol):
    """Optional capability: the backend's transport sums its calls' wall seconds and the server's own
    seconds; the forwarder worker drains them after each forwarded call so that every run's metrics split
    a phase into the adapter, the transport and the server (:mod:`verl.remote_backend.timings`)."""

    def drain_call_times(self) -> Mapping[str, float]:
        """Since the last drain: ``calls``, ``wall_s``, ``server_s`` and ``server_reported`` (the calls whose
        answer carried the server's seconds); then start again."""


@runtime_checkable
class SamplerSleep(Protocol):
    """Optional capability: the backend's sampler can free its memory while the actor side trains (verl's
    sync mode sleeps its rollout after each generation phase, :mod:`verl.remote_backend.workers.sampler_sleep`).
    The rollout server wakes it (all parts) before its next ``generate``; a weight sync in between must work on
    a sleeping sampler (the backend wakes what the sync needs). Both calls are idempotent."""

    def sleep_sampler(self, level: int) -> Mapping[str, Any]:
        """Free the sampler's memory: level 1 frees the KV cache and keeps the weights (in host memory), level 2
        may discard the weights (the next weight sync restores them). ``{"skipped": True}``: nothing slept (the
        backend's server keeps its sampler resident); the rollout server then stops asking. Optional
        ``"released_bytes"``: device memory the backend's server handed back beyond the sampler's own (e.g. a
        caching allocator's unused blocks), reported as ``perf/remote_backend/sampler_released_gib``; an
        ``update_weights`` answer may carry it too, where the sync woke the sleeping sampler's weights."""

    def wake_sampler(self, tags: list[str] | None = None) -> Mapping[str, Any]:
        """Restore the given parts (``weights``, ``kv_cache``; ``None`` = all); optional ``"released_bytes"`` as
        for :meth:`sleep_sampler` (released before the parts came back)."""


@runtime_checkable
class ReadsTensorFields(Protocol):
    """Optional capability, declared on the backend's class: the tensor fields of verl's batch that each compute
    method (``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``) may read. The forwarder worker's
    dispatch then has verl's TransferQueue bridge fetch only those (:mod:`verl.remote_backend.workers.tensor_fields`):
    at 64 prompts x 8 samples a batch holds ~15 tensor fields and a backend reads 5-10 of them. The answer must
    name every field the method can read under any configuration (a field it would look for and not find changes
    nothing loudly: an optional one, such as ``rollout_is_weights``, would silently be absent); ``None`` reads all."""

    @classmethod
    def tensor_fields_read(cls, method: str) -> Collection[str] | None:
        """The field names ``method`` may read, or ``None`` for all."""


def fields_read(backend_cls: type, method: str) -> frozenset[str] | None:
    """The fields ``backend_cls`` declares ``method`` reads (:class:`ReadsTensorFields`), or ``None`` (all of them,
    also for a class that declares nothing). An answer that is not ``None`` or a collection of names is a
    ``TypeError`` naming the class and the method."""
    read = getattr(backend_cls, "tensor_fields_read", None)
    fields = read(method) if callable(read) else None
    if fields is None:
        return None
    if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
        raise TypeError(f"{backend_cls.__name__}.tensor_fields_read({method!r}): expected a collection of field "
                        f"names or None, got {fields!r:.200}")
    return frozenset(fields)


def fields_read_by(backend_cls: type) -> dict[str, frozenset[str]]:
    """:func:`fields_read` of every compute method that ``backend_cls`` names fields for."""
    declared = {method: fields_read(backend_cls, method) for method in COMPUTE_METHODS}
    return {method: fields for method, fields in declared.items() if fields is not None}


def sleeper_of(backend: object) -> SamplerSleep | None:
    """``backend`` as a :class:`SamplerSleep`, or ``None`` when it does not declare the capability."""
    return backend if isinstance(backend, SamplerSleep) else None


def adopter_of(backend: object) -> SamplerAdopter | None:
    """``backend`` as a :class:`SamplerAdopter`, or ``None`` when it does not declare the capability."""
    return backend if isinstance(backend, SamplerAdopter) else None


#: method names per protocol (what the worker checks at attach time and the contract kit on every backend)
ACTOR_METHODS = ("compute_log_prob", "compute_ref_log_prob", "update_actor", "load_checkpoint")
#: the actor methods that take verl's batch (whose tensor fields a :class:`ReadsTensorFields` backend names)
COMPUTE_METHODS = ACTOR_METHODS[:3]
SAMPLER_METHODS = ("generate",)


def result_field(result: SampleResult | Mapping[str, Any], name: str) -> Any:
    """A field of one sample result (an object with attributes, or a mapping)."""
    return result.get(name) if isinstance(result, Mapping) else getattr(result, name, None)
