"""What differs between the two Arctic wire generations, in one object per generation.

Every body the adapter sends is built from a request model of :mod:`arctic_rl.protocol` (strict:
a bad value fails here, naming the field, not at the server); a :class:`Dialect` says where it goes
and how it is encoded:

============================  ======================================  ======================================
                              :class:`DialectV2` (Arctic-Platform)    :class:`DialectV1` (PyPI 0.1.2)
============================  ======================================  ======================================
tensor bodies and answers     DSSST1 frames                           ``torch.save``, read with
                                                                      ``weights_only=True``
``/forward``                  ``/forward``                            ``/fwd-no-grad``
``/forward-backward``         ``/forward-backward``                   ``/fwd-bwd``
``/step`` body                ``{}`` (:class:`StepRequest`)           none
``/generate``                 DSSST1 :class:`GenerateRequest`         JSON ``{prompts, sampling_params}``
weight sync                   ``/weight-sync?job_id=<training>``      ``/sync-weights`` (
                              (:class:`WeightSyncRequest`)            :class:`V1SyncWeightsRequest`)
save                          ``/save`` (:class:`SaveRequest`)        ``/save-checkpoint``, no body
load a checkpoint back        ``/load-checkpoint``                    not possible
============================  ======================================  ======================================

What is not here: sending (:mod:`.http`, :mod:`.session`), detecting the generation
(:func:`.wire.detect_protocol`), or what the calls mean (the role classes of the client).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import requests

from arctic_rl import dssst1
from arctic_rl.protocol import (
    JSON_MEDIA_TYPE,
    OCTET_STREAM,
    GenerateRequest,
    LoadCheckpointRequest,
    Paths,
    ProtocolVersion,
    SaveRequest,
    StepRequest,
    V1SyncWeightsRequest,
    WeightSyncRequest,
)
from arctic_rl.v1compat import torch_load_safe, torch_save_bytes
from verl.remote_backend.errors import RemoteProtocolError

__all__ = ["Dialect", "DialectV1", "DialectV2", "Payload", "Route", "dialect_for"]


@dataclass(frozen=True)
class Payload:
    """An encoded request body: raw bytes (``data``) or a JSON value (``json``; ``None``: no body)."""

    content_type: str | None = None
    data: bytes | bytearray | None = None
    json: Any = None


@dataclass(frozen=True)
class Route:
    """Where a control call goes: the path, its query parameters and its JSON body (``None``: none)."""

    path: str
    params: dict[str, Any] | None
    body: dict[str, Any] | None


class Dialect(abc.ABC):
    """One Arctic wire generation: paths, body codec and the bodies whose shape differs."""

    version: ProtocolVersion
    #: ``/forward`` and ``/forward-backward`` under this generation's names
    forward_path: str
    forward_backward_path: str
    #: whether the server can load a saved checkpoint back (and so whether saves can anchor a restore)
    can_load_checkpoints: bool

    @abc.abstractmethod
    def encode_tensors(self, body: dict[str, Any]) -> bytes | bytearray:
        """A body holding tensors, sent as ``application/octet-stream``."""

    @abc.abstractmethod
    def decode_tensors(self, content: bytes) -> Any:
        """An ``application/octet-stream`` answer (never a full unpickler)."""

    @abc.abstractmethod
    def step_body(self) -> dict[str, Any] | None:
        """The JSON body of ``/step`` (``None``: no body)."""

    @abc.abstractmethod
    def generate_payload(self, prompts: list[str] | list[list[int]], sampling_params: dict[str, Any]) -> Payload:
        """The ``/generate`` body, validated by :class:`~arctic_rl.protocol.GenerateRequest`."""

    @abc.abstractmethod
    def weight_sync(self, *, training: int, sampling: int, log_prob: int | None, cuda_ipc: bool,
                    low_memory: bool) -> Route:
        """The call that pushes the training job's weights to the sampler (and the log_prob job)."""

    @abc.abstractmethod
    def save(self, *, step: int | None, path: str | None, export_hf: bool, save_total_limit: int | None) -> Route:
        """The call that saves model + optimizer + step (``params`` left to the caller: the training job)."""

    def load_checkpoint_body(self, *, step: int | None, path: str | None) -> dict[str, Any]:
        """The ``/load-checkpoint`` body; raises on a generation that cannot load checkpoints."""
        if not self.can_load_checkpoints:
            raise RemoteProtocolError(Paths.LOAD_CHECKPOINT, f"v{int(self.version)} servers cannot load checkpoints")
        return LoadCheckpointRequest(step=step, path=path).model_dump(mode="json", exclude_none=True)

    def decode(self, resp: requests.Response, endpoint: str) -> Any:
        """A JSON or octet-stream answer decoded by its ``Content-Type``; undecodable: a protocol error."""
        kind = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
        try:
            if kind == OCTET_STREAM:
                return self.decode_tensors(resp.content)
            return resp.json()
        except (dssst1.WireError, ValueError) as exc:
            raise RemoteProtocolError(endpoint, f"undecodable {kind or 'untyped'} answer: {exc}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class DialectV2(Dialect):
    """Arctic-Platform main (the vendor's current server, and our reference server)."""

    version = ProtocolVersion.V2
    forward_path = Paths.FORWARD
    forward_backward_path = Paths.FORWARD_BACKWARD
    can_load_checkpoints = True

    def encode_tensors(self, body: dict[str, Any]) -> bytes | bytearray:
        return dssst1.dumps(body)

    def decode_tensors(self, content: bytes) -> Any:
        return dssst1.loads(content)

    def step_body(self) -> dict[str, Any] | None:
        return StepRequest().model_dump(mode="json", exclude_none=True)

    def generate_payload(self, prompts: list[str] | list[list[int]], sampling_params: dict[str, Any]) -> Payload:
        body = GenerateRequest(prompts=prompts, sampling_params=sampling_params, routing_key=None, strict=False)
        return Payload(content_type=OCTET_STREAM, data=self.encode_tensors(body.model_dump(mode="json")))

    def weight_sync(self, *, training: int, sampling: int, log_prob: int | None, cuda_ipc: bool,
                    low_memory: bool) -> Route:
        targets = [sampling] + ([log_prob] if log_prob is not None else [])
        body = WeightSyncRequest(source_sub_job_id=training, target_sub_job_ids=targets, cuda_ipc=cuda_ipc,
                                 low_memory=low_memory)
        return Route(Paths.WEIGHT_SYNC, {"job_id": training}, body.model_dump(mode="json"))

    def save(self, *, step: int | None, path: str | None, export_hf: bool, save_total_limit: int | None) -> Route:
        body = SaveRequest(export_hf=export_hf, checkpoint_type="resumable", step=step, path=path,
                           save_total_limit=save_total_limit)
        return Route(Paths.SAVE, None, body.model_dump(mode="json", exclude_none=True))


class DialectV1(Dialect):
    """PyPI ``arctic-platform`` 0.1.2: ``torch.save`` bodies, JSON ``/generate``, no checkpoint loading."""

    version = ProtocolVersion.V1
    forward_path = Paths.V1_FWD_NO_GRAD
    forward_backward_path = Paths.V1_FWD_BWD
    can_load_checkpoints = False

    def encode_tensors(self, body: dict[str, Any]) -> bytes | bytearray:
        return torch_save_bytes(body)

    def decode_tensors(self, content: bytes) -> Any:
        return torch_load_safe(content)

    def step_body(self) -> dict[str, Any] | None:
        return None

    def generate_payload(self, prompts: list[str] | list[list[int]], sampling_params: dict[str, Any]) -> Payload:
        body = GenerateRequest(prompts=prompts, sampling_params=sampling_params)
        return Payload(content_type=JSON_MEDIA_TYPE,
                       json=body.model_dump(mode="json", include={"prompts", "sampling_params"}))

    def weight_sync(self, *, training: int, sampling: int, log_prob: int | None, cuda_ipc: bool,
                    low_memory: bool) -> Route:
        # v1 syncs one sampler per call; the log_prob job is not a target there
        body = V1SyncWeightsRequest(training_job_id=training, sampling_job_id=sampling, colocate=False,
                                    cuda_ipc=cuda_ipc, low_memory=low_memory)
        return Route(Paths.V1_SYNC_WEIGHTS, None, body.model_dump(mode="json"))

    def save(self, *, step: int | None, path: str | None, export_hf: bool, save_total_limit: int | None) -> Route:
        return Route(Paths.V1_SAVE_CHECKPOINT, None, None)  # v1 saves to the job's own directory


_DIALECTS: dict[ProtocolVersion, Dialect] = {ProtocolVersion.V1: DialectV1(), ProtocolVersion.V2: DialectV2()}


def dialect_for(version: ProtocolVersion | int) -> Dialect:
    """The dialect of wire generation ``version`` (1 or 2)."""
    try:
        return _DIALECTS[ProtocolVersion(version)]
    except ValueError:
        raise RemoteProtocolError("protocol", f"unknown wire generation {version!r}; allowed: "
                                  f"{[int(v) for v in _DIALECTS]}") from None
