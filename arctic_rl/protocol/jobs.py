"""Jobs: the body of ``/initialize`` (:class:`JobConfig`, with its typed ``ds_worker_config``), the
answers about jobs and the server (``/initialize``, ``GET /job/{id}``, ``/health``), and the
``detail`` of a 4xx answer.

``JobConfig`` and ``DsWorkerConfig`` are tolerant although clients send them: the vendor's server
ignores unknown keys there (``common/utils/server_models.py``) and the vendor's clients send keys of
their own, so ours must accept them too.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_serializer, field_validator

from .base import Strict, Tolerant

__all__ = [
    "DEFAULT_SEED",
    "MAX_BATCH_SHAPE_SIZE",
    "BatchShape",
    "DestroyRequest",
    "DsWorkerConfig",
    "ErrorDetail",
    "HealthResponse",
    "InitializeResponse",
    "JobConfig",
    "JobInfo",
    "JobType",
]

DEFAULT_SEED = 42


class JobType(str, enum.Enum):
    TRAINING = "training"
    LOG_PROB = "log_prob"
    SAMPLING = "sampling"


#: the largest rows and token lengths a :class:`BatchShape` may name
MAX_BATCH_SHAPE_SIZE = 1 << 20


class BatchShape(Strict):
    """``DsWorkerConfig.batch_shape``: the sizes of the batches a client will send a training or log_prob job.

    A server that lists :attr:`~.wire.Features.BATCH_SHAPE` (ours) warms the job up at these sizes as well as
    on its small synthetic batches, so that what a compiler decides by a batch's size (a kernel's tiling, a
    guard on ``rows x tokens``) is compiled before the client's first step instead of in it. The sizes are the
    largest the client sends: prompts padded to ``prompt_len`` at most, responses to ``response_len``. A client
    sends it only to a server that lists the feature; the vendor's server reads only the ``ds_worker_config``
    keys it knows.
    """

    #: tokens of the longest prompt (verl: ``data.max_prompt_length``)
    prompt_len: int = Field(ge=1, le=MAX_BATCH_SHAPE_SIZE)
    #: tokens of the longest response (verl: ``data.max_response_length``)
    response_len: int = Field(ge=1, le=MAX_BATCH_SHAPE_SIZE)
    #: rows of one ``/forward`` (verl: ``data.train_batch_size`` x ``rollout.n``)
    forward_rows: int = Field(ge=1, le=MAX_BATCH_SHAPE_SIZE)
    #: rows of one ``/forward-backward``, the mini-batch (verl: ``ppo_mini_batch_size`` x ``rollout.n``)
    forward_backward_rows: int = Field(ge=1, le=MAX_BATCH_SHAPE_SIZE)


class DsWorkerConfig(Tolerant):
    """``JobConfig.ds_worker_config`` of the training and log_prob jobs: the model and per-token knobs.

    The vendor's server builds its model from this dict (``ModelSpec.from_ds_worker_config``) and
    answers 500 when ``attn_implementation`` is missing, so every DeepSpeed job must send it; its
    ZoRRO patch needs a flash-attention backend. Tolerant: the vendor's clients send more knobs
    (``logits_compute_from_fp32_inputs``, ...), kept in ``model_extra``.
    """

    #: Hugging Face attention backend of the server's model (required by the vendor)
    attn_implementation: str | None = None
    zorro_train_enable: bool = False
    logits_optimization: Literal["none", "memory", "compute"] | None = "none"
    logits_optimization_peak_mem_size_in_gib: int | float = Field(4, gt=0)
    logits_compute_in_fp32: bool = False
    response_len: int | None = Field(None, ge=1)
    max_token_len: int | None = Field(None, ge=1)
    rollout_n: int = Field(1, ge=1)
    temperature: float | None = Field(None, gt=0)
    enable_gradient_checkpointing: bool = False
    use_liger: bool = False
    use_unpad: bool | None = None
    zorro_train_load_balancer: Any = None
    #: the client's batch sizes, for the warm-up of a server listing ``Features.BATCH_SHAPE`` (ours)
    batch_shape: BatchShape | None = None


class JobConfig(Tolerant):
    """Body of ``POST /initialize``. Unknown keys are ignored, as by the vendor's server."""

    model_config = ConfigDict(extra="ignore")

    model_name: str = Field(description="HF model id or local directory")
    job_type: JobType = JobType.TRAINING
    num_devices: int | None = None
    ds_config: dict[str, Any] | None = None
    training_config: dict[str, Any] | None = None
    log_prob_config: dict[str, Any] | None = None
    ds_worker_config: DsWorkerConfig | None = None
    vllm_config: dict[str, Any] | None = None
    checkpoint_path: str | None = None
    arctic_inference_config: dict[str, Any] | None = None
    full_determinism: bool = False
    seed: int = Field(DEFAULT_SEED, ge=-(2**63), le=2**63 - 1)
    cuda_ipc: bool = False
    low_memory: bool = False
    #: opaque label of the client run that created the job, echoed by ``GET /job/{id}`` and
    #: ``/status`` of servers that know it (ours); lets a client find its jobs again after a server
    #: restart and destroy only its own. The vendor's server ignores it.
    client_tag: str | None = Field(None, max_length=128)

    @field_validator("seed", mode="before")
    @classmethod
    def _null_seed_is_default(cls, value: Any) -> Any:
        return DEFAULT_SEED if value is None else value

    @field_serializer("ds_worker_config")
    def _worker_config_as_given(self, value: DsWorkerConfig | None) -> dict[str, Any] | None:
        """The keys that were given (and extras), not the model's defaults: the wire carries what was set."""
        return None if value is None else value.model_dump(mode="json", exclude_unset=True)


class InitializeResponse(Tolerant):
    """``POST /initialize``: the new job's id."""

    job_id: int
    job_type: JobType
    running: bool


class DestroyRequest(Strict):
    """``POST /destroy?job_id=``."""

    job_type: JobType


class JobInfo(Tolerant):
    """``GET /job/{id}``. ``status`` is ``RUNNING`` once the job accepts calls."""

    job_id: int
    job_type: JobType
    model_name: str
    status: str
    checkpoint_path: str | None = None


class HealthResponse(Tolerant):
    """``GET /health``. The vendor's server answers ``{"status": "OK"}`` only: every feature is absent there."""

    status: str
    server: str | None = None
    version: str | None = None
    protocol: int | None = None
    instance_id: str | None = None
    features: list[str] = Field(default_factory=list)


class ErrorDetail(Tolerant):
    """``detail`` of every 4xx answer of the reference server."""

    message: str
    field: str | None = None
    allowed: Any = None
    received: Any = None
