"""The Arctic RL HTTP protocol, defined once for both the client adapter and the reference server.

Modules, by role (every public name is re-exported here: ``from arctic_rl.protocol import X``):

====================  ==============================================================================
:mod:`.wire`          wire generations (v1: ``torch.save`` bodies; v2: DSSST1 bodies), endpoint paths,
                      media types, headers (auth, idempotency, replay), ``/health`` feature names
:mod:`.base`          :class:`Strict` (what we send: unknown keys refused) and :class:`Tolerant` (what we
                      read, or what the vendor's clients send with keys of their own), :class:`FieldError`
:mod:`.jobs`          ``/initialize`` (:class:`JobConfig` with a typed :class:`DsWorkerConfig`), job and
                      health answers, the 4xx ``detail``
:mod:`.loss`          loss and post-processor allow-lists, :class:`LossConfig`, :class:`RolloutCorrection`
:mod:`.batches`       ``/forward``, ``/forward-backward``, ``/step``: tensor names, :class:`BatchMeta`
                      (strict: :func:`validate_meta`), :class:`Processing` (``config`` a ``LossConfig``)
:mod:`.generation`    ``/generate``: :class:`SamplingParams` (typed into :class:`GenerateRequest`),
                      :func:`clean_sampling_params`, results and :func:`sampled_logprobs`
:mod:`.checkpoints`   ``/save``, ``/load-checkpoint``, weight sync (v1 and v2)
:mod:`.control`       the vendor's v2 control routes (sleep/wake, prefix cache, ``/operation``, weight norm,
                      ``/log-probs``)
====================  ==============================================================================

Conventions: request models are strict, answers tolerant (an older client keeps working against a
newer server that adds fields). The exceptions are where the vendor's code is tolerant and its clients
rely on it: ``JobConfig`` ignores unknown keys and ``DsWorkerConfig`` keeps them, as the vendor's server
does (``common/utils/server_models.py`` of Arctic-Platform; docs/SERVER.md). Every data-plane call names
its job with the ``job_id`` query parameter.

What is not here: HTTP transport (``verl.workers.remote_client``), tensor encoding
(:mod:`arctic_rl.dssst1`) or any computation (:mod:`arctic_rl.server`).
"""

from __future__ import annotations

from .base import FieldError, Strict, Tolerant
from .batches import (
    ENTROPY_KEY,
    LOGPROB_ALIGNMENT_KEY,
    LOGPROBS_KEY,
    OPTIONAL_FORWARD_TENSORS,
    OPTIONAL_TRAIN_TENSORS,
    REQUIRED_FORWARD_TENSORS,
    REQUIRED_TRAIN_TENSORS,
    BatchMeta,
    ForwardBackwardResponse,
    ForwardResponse,
    LogprobAlignment,
    Processing,
    StepRequest,
    StepResponse,
    validate_meta,
)
from .checkpoints import (
    LoadCheckpointRequest,
    LoadCheckpointResponse,
    SaveRequest,
    SaveResponse,
    V1SyncWeightsRequest,
    WeightSyncRequest,
    WeightSyncResponse,
)
from .control import (
    LogProbsRequest,
    OperationRequest,
    OperationType,
    ResetPrefixCacheRequest,
    WeightNormRequest,
    WeightNormResponse,
)
from .generation import (
    ANSWER_SHAPE_FIELDS,
    SAMPLING_ALIASES,
    GenerateRequest,
    GenerateResponse,
    GenerateResult,
    SamplingParams,
    TokenLogprob,
    clean_sampling_params,
    sampled_logprobs,
)
from .jobs import (
    DEFAULT_SEED,
    MAX_BATCH_SHAPE_SIZE,
    BatchShape,
    DestroyRequest,
    DsWorkerConfig,
    ErrorDetail,
    HealthResponse,
    InitializeResponse,
    JobConfig,
    JobInfo,
    JobType,
)
from .loss import (
    KL_TYPES,
    LOSS_AGG_MODES,
    LOSS_NAMES,
    POST_PROCESSORS,
    ROLLOUT_RS_OPTIONS,
    SFT_LOSS_NAMES,
    LossConfig,
    RolloutCorrection,
)
from .wire import (
    AUTH_HEADER,
    JSON_MEDIA_TYPE,
    OCTET_STREAM,
    REPLAY_HEADER,
    REQUEST_ID_HEADER,
    STEP_HEADER,
    V1_ONLY_PATHS,
    V2_ONLY_PATHS,
    Features,
    Paths,
    ProtocolVersion,
)

__all__ = [
    "ANSWER_SHAPE_FIELDS",
    "AUTH_HEADER",
    "DEFAULT_SEED",
    "ENTROPY_KEY",
    "JSON_MEDIA_TYPE",
    "KL_TYPES",
    "LOGPROBS_KEY",
    "LOGPROB_ALIGNMENT_KEY",
    "LOSS_AGG_MODES",
    "LOSS_NAMES",
    "MAX_BATCH_SHAPE_SIZE",
    "OCTET_STREAM",
    "OPTIONAL_FORWARD_TENSORS",
    "OPTIONAL_TRAIN_TENSORS",
    "POST_PROCESSORS",
    "REPLAY_HEADER",
    "REQUEST_ID_HEADER",
    "REQUIRED_FORWARD_TENSORS",
    "REQUIRED_TRAIN_TENSORS",
    "ROLLOUT_RS_OPTIONS",
    "SAMPLING_ALIASES",
    "SFT_LOSS_NAMES",
    "STEP_HEADER",
    "V1_ONLY_PATHS",
    "V2_ONLY_PATHS",
    "BatchMeta",
    "BatchShape",
    "DestroyRequest",
    "DsWorkerConfig",
    "ErrorDetail",
    "Features",
    "FieldError",
    "ForwardBackwardResponse",
    "ForwardResponse",
    "GenerateRequest",
    "GenerateResponse",
    "GenerateResult",
    "HealthResponse",
    "InitializeResponse",
    "JobConfig",
    "JobInfo",
    "JobType",
    "LoadCheckpointRequest",
    "LoadCheckpointResponse",
    "LogProbsRequest",
    "LogprobAlignment",
    "LossConfig",
    "OperationRequest",
    "OperationType",
    "Paths",
    "Processing",
    "ProtocolVersion",
    "ResetPrefixCacheRequest",
    "RolloutCorrection",
    "SamplingParams",
    "SaveRequest",
    "SaveResponse",
    "StepRequest",
    "StepResponse",
    "Strict",
    "TokenLogprob",
    "Tolerant",
    "V1SyncWeightsRequest",
    "WeightNormRequest",
    "WeightNormResponse",
    "WeightSyncRequest",
    "WeightSyncResponse",
    "clean_sampling_params",
    "sampled_logprobs",
    "validate_meta",
]
