"""The compute contract a remote backend offers verl: an actor side and a sampler side.

:class:`~verl.remote_backend.base.RemoteBackend` is the *lifecycle* of a backend. What verl's
worker and rollout replica call on it is written down here, as two ``typing.Protocol``s with
exactly the methods they call:

* :class:`RemoteActor` -- used by :class:`~verl.remote_backend.workers.worker.RemoteActorRolloutRefWorker`:
  old and reference log-probs, the PPO/GRPO update, and checkpoints named by verl's global step;
* :class:`RemoteSampler` -- used by the rollout server of
  :mod:`verl.remote_backend.workers.replica`: token ids in, ``n`` samples per prompt out, with
  per-token log-probs. One result per sample is a :class:`SampleResult`-shaped mapping or object.

Both are ``runtime_checkable`` so that the contract test (and a worker at attach time) can check
that a registered backend offers them. A backend implements both *and* the lifecycle ABC.

TensorDict conventions (verl 0.9.1's engine workers): ``input_ids``/``position_ids`` are nested
(prompt + response per row, no padding); ``compute_log_prob`` / ``compute_ref_log_prob`` return a
TensorDict with nested ``log_probs`` (value ``k`` of a row = log p(token ``k+1``)), optionally
``entropy``, and a ``metrics`` dict; ``update_actor`` returns a TensorDict whose non-tensor
``metrics`` maps metric names to one value per mini-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ACTOR_METHODS",
    "SAMPLER_METHODS",
    "SAMPLER_UPDATE_KEY",
    "RemoteActor",
    "RemoteSampler",
    "SampleResult",
    "result_field",
]

#: key of ``update_weights()``'s result that the worker forwards to every rollout server, whose
#: backend then gets it through ``adopt_sampler(data)`` (for samplers that live client-side)
SAMPLER_UPDATE_KEY = "sampler_update"


@runtime_checkable
class RemoteActor(Protocol):
    """The training side verl's forwarder worker calls (one call per verl call, data unchanged)."""

    def compute_log_prob(self, data: Any) -> Any:
        """Log-probs (and, when ``calculate_entropy``, entropy) of the current policy."""

    def compute_ref_log_prob(self, data: Any) -> Any:
        """Log-probs of the reference (initial) policy."""

    def update_actor(self, data: Any) -> Any:
        """One PPO/GRPO update over the batch (``ppo_epochs`` x mini-batches); returns metrics."""

    def update_weights(self) -> Any:
        """Make the sampler serve the latest trained weights. A dict result with the key
        :data:`SAMPLER_UPDATE_KEY` is forwarded to the rollout servers (see :class:`RemoteSampler`)."""

    def save_checkpoint(self, step: int | None = None) -> Any:
        """Persist weights + optimizer state on the backend as global step ``step``."""

    def load_checkpoint(self, step: int | None = None) -> Any:
        """Restore the state saved by :meth:`save_checkpoint` for ``step`` (and sync the sampler)."""


@runtime_checkable
class RemoteSampler(Protocol):
    """The generation side verl's rollout server calls."""

    def generate(self, prompts: list[list[int]], sampling_params: dict | None = None) -> Sequence[Any]:
        """``n = sampling_params['n']`` (default 1) samples per prompt, in prompt order with the ``n``
        samples of a prompt adjacent; each result has ``token_ids``, ``logprobs`` (one per token, or
        ``None``) and ``finish_reason`` (``stop``/``length``/``abort``), see :class:`SampleResult`."""

    # Optional, not part of the runtime check: ``adopt_sampler(data)`` -- take the JSON data the
    # actor side's ``update_weights`` returned under SAMPLER_UPDATE_KEY (e.g. a new sampler path).


class SampleResult(Protocol):
    """One sample, as an object with these attributes (a mapping with these keys is accepted too)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None
    finish_reason: str | None


#: method names per protocol (what the contract test checks on every registered backend)
ACTOR_METHODS = ("compute_log_prob", "compute_ref_log_prob", "update_actor", "update_weights", "save_checkpoint",
                 "load_checkpoint")
SAMPLER_METHODS = ("generate",)


def result_field(result: Any, name: str) -> Any:
    """A field of one sample result (an object with attributes, or a mapping)."""
    return result.get(name) if isinstance(result, Mapping) else getattr(result, name, None)
