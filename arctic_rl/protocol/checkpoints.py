"""Checkpoints and weight sync: ``/save``, ``/load-checkpoint``, ``/weight-sync`` (v2) and
``/sync-weights`` (v1), requests and answers.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import Strict, Tolerant

__all__ = [
    "LoadCheckpointRequest",
    "LoadCheckpointResponse",
    "SaveRequest",
    "SaveResponse",
    "V1SyncWeightsRequest",
    "WeightSyncRequest",
    "WeightSyncResponse",
]


class SaveRequest(Strict):
    """``POST /save`` (v2): model, optimizer and step, under the job's checkpoint directory."""

    checkpoint_id: str | None = None
    checkpoint_type: str = "resumable"
    #: relative to the server's checkpoint root; ``None`` = the job's own directory
    path: str | None = None
    step: int | None = Field(None, ge=0)
    export_hf: bool = False
    save_total_limit: int | None = Field(None, ge=1)
    stage_info: dict[str, Any] | None = None


class SaveResponse(Tolerant):
    """``/save``: where the checkpoint went and the step it holds."""

    job_id: int | None = None
    path: str
    hf_path: str | None = None
    global_step: int | None = None


class LoadCheckpointRequest(Strict):
    """``POST /load-checkpoint`` (v2): a step (or path) to restore."""

    path: str | None = None
    step: int | None = Field(None, ge=0)


class LoadCheckpointResponse(Tolerant):
    """``/load-checkpoint``: the checkpoint restored and its step."""

    job_id: int | None = None
    path: str
    global_step: int


class WeightSyncRequest(Strict):
    """v2 ``POST /weight-sync?job_id=<training job>``."""

    source_sub_job_id: int
    target_sub_job_ids: list[int] = Field(min_length=1)
    cuda_ipc: bool | None = None
    low_memory: bool | None = None


class V1SyncWeightsRequest(Strict):
    """v1 ``POST /sync-weights``."""

    training_job_id: int
    sampling_job_id: int
    colocate: bool = False
    cuda_ipc: bool = False
    low_memory: bool = False


class WeightSyncResponse(Tolerant):
    """A weight sync's answer: the jobs synced and the sampler's weight version where the server says."""

    job_id: int | None = None
    synced: list[int] = Field(default_factory=list)
    weight_version: int | None = None
