"""The ``arctic`` rollout replica: verl's generation served by an Arctic RL sampling job.

Thin registered subclasses of the generic replica (:mod:`verl.remote_backend.workers.replica`):
:class:`ArcticRLRolloutReplica` (registered as ``arctic`` in verl's ``RolloutReplicaRegistry``)
launches one :class:`ArcticRLRolloutServer`, which sends token ids to ``/generate`` through the
adapter's ``generate``. The only Arctic-specific step is :func:`to_protocol_sampling_params`:
verl's sampling parameters validated into ``arctic_rl.protocol.SamplingParams``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl.remote_backend.workers.replica import (
    RemoteRolloutReplica,
    RemoteRolloutServer,
    normalize_sampling_params,
    remote_server_class,
)

from .generation import clean_sampling_params

__all__ = ["ArcticRLRolloutReplica", "ArcticRLRolloutServer", "to_protocol_sampling_params"]

def to_protocol_sampling_params(
    params: Mapping[str, Any], *, prompt_len: int, response_length: int, prompt_length: int
) -> dict[str, Any]:
    """verl's per-sample ``sampling_params`` -> the ``/generate`` ``sampling_params`` dict.

    :func:`~verl.remote_backend.workers.replica.normalize_sampling_params` (``n`` = 1, ``top_k``
    ``None``/``0`` -> -1, ``logprobs`` bool -> ``True``/``None``, ``max_tokens`` defaulted like
    verl's vLLM server, unsupported penalties dropped with a one-time warning), then the adapter's
    :func:`~verl.workers.remote_client.arctic.generation.clean_sampling_params` (unknown keys dropped with
    a one-time warning, values validated: a bad one raises naming the field; the same function and
    warned-once set as the adapter's ``generate``, which leaves a cleaned dict as it is).
    """
    raw = normalize_sampling_params(params, prompt_len=prompt_len, response_length=response_length,
                                    prompt_length=prompt_length, backend="Arctic RL")
    return clean_sampling_params(raw).model_dump(exclude_none=True, exclude_unset=True)


class ArcticRLRolloutServer(RemoteRolloutServer):
    """Ray actor behind one ``arctic`` replica: verl's token-in/token-out API over ``/generate``."""

    def convert_sampling_params(self, params: Mapping[str, Any], prompt_len: int) -> dict[str, Any]:
        return to_protocol_sampling_params(params, prompt_len=prompt_len, response_length=self.response_length,
                                           prompt_length=self.prompt_length)


_RemoteServer = remote_server_class(ArcticRLRolloutServer)


class ArcticRLRolloutReplica(RemoteRolloutReplica):
    """verl rollout replica whose server forwards generation to the Arctic RL sampling job."""

    server_class = ArcticRLRolloutServer
