"""The Arctic RL HTTP protocol, defined once for both the client adapter and the reference server.

What is here: endpoint paths of both wire generations (v1: ``torch.save`` bodies; v2: DSSST1
bodies), the JSON request/response models, ``JobConfig`` (the body of ``/initialize``), the
names of the tensors and meta keys a forward/backward body carries, the loss and
post-processor allow-lists, and the headers used for auth and idempotency.

What is not here: HTTP transport (``verl.workers.remote_client``), tensor encoding
(:mod:`arctic_rl.dssst1`) or any computation (:mod:`arctic_rl.server`).

Conventions (see ``ARCTIC_PROTOCOL.md`` in the design notes):

* Request models that *we* define are strict (``extra="forbid"``): a typo is an error, not a
  silently ignored knob. ``JobConfig`` is the exception: the real Arctic server ignores unknown
  keys and clients send many, so it is tolerant.
* Response models are tolerant (``extra="allow"``): an older client keeps working against a newer
  server that adds fields.
* Every data-plane call names its job with the ``job_id`` query parameter.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "AUTH_HEADER",
    "DEFAULT_SEED",
    "ENTROPY_KEY",
    "KL_TYPES",
    "LOGPROBS_KEY",
    "LOGPROB_ALIGNMENT_KEY",
    "LOSS_AGG_MODES",
    "LOSS_NAMES",
    "OPTIONAL_FORWARD_TENSORS",
    "OPTIONAL_TRAIN_TENSORS",
    "POST_PROCESSORS",
    "REQUEST_ID_HEADER",
    "REQUIRED_FORWARD_TENSORS",
    "REQUIRED_TRAIN_TENSORS",
    "ROLLOUT_RS_OPTIONS",
    "SFT_LOSS_NAMES",
    "STEP_HEADER",
    "BatchMeta",
    "DestroyRequest",
    "DsWorkerConfig",
    "ErrorDetail",
    "Features",
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
    "TokenLogprob",
    "V1SyncWeightsRequest",
    "WeightNormRequest",
    "WeightNormResponse",
    "WeightSyncRequest",
    "WeightSyncResponse",
    "sampled_logprobs",
]

DEFAULT_SEED = 42

# --------------------------------------------------------------------------------------------
# Paths, versions and headers
# --------------------------------------------------------------------------------------------


class ProtocolVersion(enum.IntEnum):
    """Wire generation. v1: ``torch.save`` tensor bodies; v2: DSSST1 tensor bodies."""

    V1 = 1
    V2 = 2


class Paths:
    """Endpoint paths. Data-plane calls take ``?job_id=<int>``."""

    # common to both generations
    HEALTH = "/health"
    INITIALIZE = "/initialize"
    DESTROY = "/destroy"
    STATUS = "/status"
    JOB = "/job/{job_id}"
    STEP = "/step"
    GENERATE = "/generate"  # v1: JSON body; v2: DSSST1 body (told apart by Content-Type)
    OPENAPI = "/openapi.json"

    # v2
    FORWARD_BACKWARD = "/forward-backward"
    FORWARD = "/forward"
    SAVE = "/save"
    LOAD_CHECKPOINT = "/load-checkpoint"
    WEIGHT_SYNC = "/weight-sync"
    # v2 control routes of the vendor's server (Arctic-Platform ``common/http_server.py``)
    SLEEP_INFERENCE = "/sleep-inference"  # ?job_id=<sampling>; body {level} (or query ``level``)
    WAKE_INFERENCE = "/wake-inference"  # ?job_id=<sampling>; body a tag list or {tags}
    RESET_PREFIX_CACHE = "/reset-prefix-cache"  # ?job_id=<sampling>; body ResetPrefixCacheRequest
    OPERATION = "/operation"  # ?job_id=<primary job>; body OperationRequest
    SLEEP_TRAINING = "/sleep-training"  # ?job_id=<training>; body {mode} (or query ``mode``)
    WAKE_TRAINING = "/wake-training"  # ?job_id=<training>
    SLEEP_LOG_PROB = "/sleep-log-prob"  # ?job_id=<log_prob>
    WAKE_LOG_PROB = "/wake-log-prob"  # ?job_id=<log_prob>
    EMPTY_TRAINING_CACHE = "/empty-training-cache"  # ?job_id=<training>
    WEIGHT_NORM = "/weight-norm"  # no job_id; body WeightNormRequest
    LOG_PROBS = "/log-probs"  # ?job_id=<log_prob>; body LogProbsRequest (JSON in, DSSST1 out)

    # v1
    V1_FWD_BWD = "/fwd-bwd"
    V1_FWD_NO_GRAD = "/fwd-no-grad"
    V1_SAVE_CHECKPOINT = "/save-checkpoint"
    V1_SYNC_WEIGHTS = "/sync-weights"

    @classmethod
    def job(cls, job_id: int) -> str:
        return cls.JOB.format(job_id=int(job_id))


#: Paths only a v2 server serves; their presence in ``/openapi.json`` identifies v2.
V2_ONLY_PATHS = (Paths.FORWARD_BACKWARD, Paths.FORWARD, Paths.SAVE, Paths.WEIGHT_SYNC)
#: Paths only a v1 server serves.
V1_ONLY_PATHS = (Paths.V1_FWD_BWD, Paths.V1_FWD_NO_GRAD, Paths.V1_SAVE_CHECKPOINT, Paths.V1_SYNC_WEIGHTS)

OCTET_STREAM = "application/octet-stream"
JSON_MEDIA_TYPE = "application/json"

AUTH_HEADER = "Authorization"  # "Bearer <token>"
#: Idempotency key of a mutating call. A server that advertises ``Features.IDEMPOTENCY`` answers
#: a replay of the same id and payload with the original response, and a reused id with a
#: different payload with 409.
REQUEST_ID_HEADER = "X-Request-Id"
#: The client's optimizer-step counter at the time of the call (informational; logged).
STEP_HEADER = "X-Arctic-Step"


class Features:
    """Capability names a server may list in ``/health`` (``features``).

    The real Arctic server answers ``{"status": "OK"}`` only, so a client must treat every
    feature as absent unless listed.
    """

    TOKEN_PROMPTS = "token_prompts"  # /generate accepts prompts as lists of token ids
    N_SAMPLES = "n_samples"  # sampling_params.n > 1 really returns n samples per prompt
    IDEMPOTENCY = "idempotency"  # X-Request-Id replays are answered from a cache
    LOAD_CHECKPOINT = "load_checkpoint"  # /load-checkpoint restores model+optimizer+step
    INSTANCE_ID = "instance_id"  # /health carries an id that changes on every server start
    #: /generate takes sampling_params.logprobs_format="sampled" (one float per generated token instead of the
    #: vendor's per-token candidates) and sampling_params.detokenize=false (no ``text``, the token ids only)
    COMPACT_RESULTS = "compact_results"
    #: the ``verl_gspo`` and ``verl_bypass_mode`` losses (verl's ``gspo`` and ``bypass_mode`` policy losses)
    POLICY_LOSSES = "policy_losses"
    #: /generate calls join the sampler's running batch as they arrive and each is answered when its own sequences
    #: end (no call waits for another); a client sends calls as they come instead of gathering them into batches
    CONTINUOUS_BATCHING = "continuous_batching"
    #: /forward takes ``meta.response_logprobs_only=true``: the log-probs (and entropy) of the response tokens
    #: only, in the same layout with zeros elsewhere; the prompt positions' LM head is never run
    RESPONSE_LOGPROBS = "response_logprobs"
    #: the sampling job answers /generate while a call of the training job computes (separate locks, threads and
    #: engines; no sleep between them): a client may generate the next batch while this one trains
    CONCURRENT_JOBS = "concurrent_jobs"


# --------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------


class JobType(str, enum.Enum):
    TRAINING = "training"
    LOG_PROB = "log_prob"
    SAMPLING = "sampling"


class JobConfig(BaseModel):
    """Body of ``POST /initialize``. Tolerant of unknown keys, like the real server."""

    model_config = ConfigDict(extra="ignore")

    model_name: str = Field(description="HF model id or local directory")
    job_type: JobType = JobType.TRAINING
    num_devices: int | None = None
    ds_config: dict[str, Any] | None = None
    training_config: dict[str, Any] | None = None
    log_prob_config: dict[str, Any] | None = None
    ds_worker_config: dict[str, Any] | None = None
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


class DsWorkerConfig(BaseModel):
    """``JobConfig.ds_worker_config`` of the training and log_prob jobs: the model and per-token knobs.

    The vendor's server builds its model from this dict (``ModelSpec.from_ds_worker_config``) and
    answers 500 when ``attn_implementation`` is missing, so every DeepSpeed job must send it; its
    ZoRRO patch needs a flash-attention backend. Tolerant of keys added later (``extra="allow"``).
    """

    model_config = ConfigDict(extra="allow")

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


class InitializeResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    job_id: int
    job_type: JobType
    running: bool


class DestroyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_type: JobType


class JobInfo(BaseModel):
    """``GET /job/{id}``. ``status`` is ``RUNNING`` once the job accepts calls."""

    model_config = ConfigDict(extra="allow")

    job_id: int
    job_type: JobType
    model_name: str
    status: str
    checkpoint_path: str | None = None


class HealthResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str
    server: str | None = None
    version: str | None = None
    protocol: int | None = None
    instance_id: str | None = None
    features: list[str] = Field(default_factory=list)


class ErrorDetail(BaseModel):
    """``detail`` of every 4xx answer of the reference server."""

    model_config = ConfigDict(extra="allow")

    message: str
    field: str | None = None
    allowed: Any = None
    received: Any = None


# --------------------------------------------------------------------------------------------
# Forward / forward-backward / step
# --------------------------------------------------------------------------------------------

#: Loss functions by name. A request never names code: anything else is a 400.
LOSS_NAMES: tuple[str, ...] = ("verl_grpo", "grpo", "verl_gspo", "verl_bypass_mode", "sft", "sft_ce", "cross_entropy")
SFT_LOSS_NAMES: tuple[str, ...] = ("sft", "sft_ce", "cross_entropy")
POST_PROCESSORS: tuple[str, ...] = (
    "compute_entropy_and_logprobs",
    "apply_temperature",
    "compute_entropy",
    "identity",
)
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_TYPES: tuple[str, ...] = ("low_var_kl", "kl", "abs", "mse")
#: verl 0.9.1's rejection-sampling criteria (``rollout_corr_helper``), comma-joined in ``rollout_rs``
ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip

#: Tensors every ``/forward`` body must carry: dense ``[B, P+R]`` ``input_ids``/``attention_mask``
#: and ``[B, P]`` ``prompts`` (its width tells the server P). As at the vendor, ``position_ids``
#: (rebuilt from ``attention_mask`` when absent: ``cumsum - 1``, clamped at 0) and ``responses``
#: (``input_ids[:, P:]``) are optional: :data:`OPTIONAL_FORWARD_TENSORS`.
REQUIRED_FORWARD_TENSORS: tuple[str, ...] = ("input_ids", "attention_mask", "prompts")
OPTIONAL_FORWARD_TENSORS: tuple[str, ...] = ("position_ids", "responses")
#: ... and of a ``/forward-backward`` body with an RL loss. RL tensors are left-padded with zeros
#: to the full ``P+R`` width (their last ``R`` columns are the response).
REQUIRED_TRAIN_TENSORS: tuple[str, ...] = REQUIRED_FORWARD_TENSORS + ("response_mask", "old_log_probs", "advantages")
OPTIONAL_TRAIN_TENSORS: tuple[str, ...] = ("ref_log_prob", "rollout_is_weights", "loss_mask")

LOGPROBS_KEY = "logprobs"
ENTROPY_KEY = "entropy"
#: optional key of our server's ``/forward`` answer naming the :class:`LogprobAlignment` it used. The
#: vendor's server sends none: a client must know the alignment from the job config (ZoRRO on or off).
LOGPROB_ALIGNMENT_KEY = "logprob_alignment"


class LogprobAlignment(str, enum.Enum):
    """How ``/forward`` log-probs line up with the tokens. Both are ``[B, P+R]`` (the vendor's layouts).

    ``shifted`` (ZoRRO off): ``lp[:, c] = log p(input_ids[:, c+1] | input_ids[:, :c+1])`` (the
    last column holds no prediction). ``response`` (ZoRRO on): ``lp[:, P+j] = log p(responses[:, j] |
    prompt, responses[:, :j])``, zeros in the prompt columns ``0..P-1``. The two are one column
    apart on the response: reading one as the other is wrong by whole nats.
    """

    SHIFTED = "shifted"
    RESPONSE = "response"


class RolloutCorrection(BaseModel):
    """verl's ``policy_loss.rollout_correction`` as the ``verl_bypass_mode`` loss reads it: IS weights
    and rejection masks of the current policy against the rollout's log-probs (``old_log_probs``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    #: verl's dataclass default (the actor's ``policy_loss.rollout_correction``) is ``sequence``
    rollout_is: Literal["token", "sequence"] | None = "sequence"
    #: an upper bound (truncation) or ``"lower_upper"`` (weights outside are zeroed)
    rollout_is_threshold: float | str | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_threshold(cls, value: float | str | None) -> float | str | None:
        if value is not None:
            bounds = [float(v) for v in str(value).split("_", 1)]  # a non-number: ValueError, a 400
            if min(bounds) <= 0 or bounds != sorted(bounds):
                raise ValueError(f"expected a positive bound or 'lower_upper' with 0 < lower <= upper, got {value!r}")
        return value

    @field_validator("rollout_rs")
    @classmethod
    def _rs_options(cls, value: str | None) -> str | None:
        if value is not None:
            bad = [o for o in value.split(",") if o.strip() not in ROLLOUT_RS_OPTIONS]
            if bad or not value.strip():
                raise ValueError(f"expected comma-separated options of {list(ROLLOUT_RS_OPTIONS)}, got {value!r}")
        return value


class LossConfig(BaseModel):
    """``processing.config`` of a ``/forward-backward`` call: the loss hyper-parameters."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    clip_ratio: float = Field(0.2, ge=0.0)
    clip_ratio_low: float | None = Field(None, ge=0.0)
    clip_ratio_high: float | None = Field(None, ge=0.0)
    #: dual-clip lower bound for negative advantages (> 1); ``None`` disables dual clip
    clip_ratio_c: float | None = Field(3.0, gt=1.0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    entropy_coeff: float = 0.0
    #: divide the mean by this token count instead of the call's own (``global`` token-mean
    #: across the micro-batches of one step); ``None`` uses the call's own count.
    loss_scale_tokens: float | None = Field(None, gt=0.0)
    #: read by the ``verl_bypass_mode`` loss only (``None`` there: verl's defaults)
    rollout_correction: RolloutCorrection | None = None


class Processing(BaseModel):
    """``processing`` of a forward/backward body: which loss and post-processors to run."""

    model_config = ConfigDict(extra="forbid")

    loss_fn: str | None = None
    post: str | list[str] | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class BatchMeta(BaseModel):
    """``meta`` of a forward/backward body. Tolerant: Arctic clients send many more keys."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    zorro_train_enable: bool = False
    rollout_n: int = Field(1, ge=1)
    max_prompt_len: int | None = Field(None, ge=0)
    max_response_len: int | None = Field(None, ge=0)
    max_token_len_per_gpu: int | None = None
    temperature: float = Field(1.0, gt=0.0)
    calculate_entropy: bool = False
    #: /forward of servers listing ``Features.RESPONSE_LOGPROBS``: values at the response tokens only (zeros at
    #: the prompt's); others ignore it and answer every position
    response_logprobs_only: bool = False
    pad_token_id: int = 0
    global_batch_size: int | None = None
    batch_num_tokens: float | None = Field(None, ge=0)
    actor_config: dict[str, Any] | None = None
    policy_loss_config: dict[str, Any] | None = None
    load_balancer: Any = None


class ForwardBackwardResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    job_id: int
    metrics: dict[str, Any]
    avg_loss: float | None = None


class ForwardResponse(BaseModel):
    """Decoded from DSSST1; ``batch`` holds ``logprobs`` (and ``entropy``) tensors."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    job_id: int
    batch: dict[str, Any]
    metrics: dict[str, Any] = Field(default_factory=dict)


class StepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: accepted for parity with the managed service; the on-prem scheduler decides the LR
    learning_rate: float | None = None


class StepResponse(BaseModel):
    """The vendor's servers answer ``{job_id, workers}`` (no ``metrics``); ours adds ``metrics``."""

    model_config = ConfigDict(extra="allow")

    job_id: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    batch: dict[str, Any] = Field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Checkpoints and weight sync
# --------------------------------------------------------------------------------------------


class SaveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint_id: str | None = None
    checkpoint_type: str = "resumable"
    #: relative to the server's checkpoint root; ``None`` = the job's own directory
    path: str | None = None
    step: int | None = Field(None, ge=0)
    export_hf: bool = False
    save_total_limit: int | None = Field(None, ge=1)
    stage_info: dict[str, Any] | None = None


class SaveResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    job_id: int | None = None
    path: str
    hf_path: str | None = None
    global_step: int | None = None


class LoadCheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    step: int | None = Field(None, ge=0)


class LoadCheckpointResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    job_id: int | None = None
    path: str
    global_step: int


class WeightSyncRequest(BaseModel):
    """v2 ``POST /weight-sync?job_id=<training job>``."""

    model_config = ConfigDict(extra="forbid")

    source_sub_job_id: int
    target_sub_job_ids: list[int] = Field(min_length=1)
    cuda_ipc: bool | None = None
    low_memory: bool | None = None


class V1SyncWeightsRequest(BaseModel):
    """v1 ``POST /sync-weights``."""

    model_config = ConfigDict(extra="forbid")

    training_job_id: int
    sampling_job_id: int
    colocate: bool = False
    cuda_ipc: bool = False
    low_memory: bool = False


class WeightSyncResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    job_id: int | None = None
    synced: list[int] = Field(default_factory=list)
    weight_version: int | None = None


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


class SamplingParams(BaseModel):
    """``sampling_params`` of ``/generate`` (the subset of vLLM's that the protocol uses).
    Non-finite numbers are refused (an infinite temperature is not a distribution)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 or 0 = disabled
    max_tokens: int = Field(16, ge=1)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1)
    #: return the log-prob of each sampled token (vLLM: ``logprobs=0`` or ``1``)
    logprobs: int | bool | None = None
    skip_special_tokens: bool = True
    #: the shape of each result's ``logprobs`` (servers listing ``Features.COMPACT_RESULTS`` only; absent =
    #: "candidates"): "candidates" = the vendor's ``{str(token_id): {logprob, rank}}`` per generated token,
    #: "sampled" = the sampled token's log-prob alone, one float per generated token (no top tokens)
    logprobs_format: Literal["candidates", "sampled"] | None = None
    #: false: results carry no ``text`` (an empty string), the token ids only (servers listing
    #: ``Features.COMPACT_RESULTS`` only; absent = true)
    detokenize: bool | None = None

    @property
    def wants_logprobs(self) -> bool:
        """Log-probs asked for (``logprobs`` set and not ``False``; 0 asks for the sampled token's alone)."""
        return self.logprobs is not None and self.logprobs is not False

    @property
    def sampled_logprobs_only(self) -> bool:
        """Log-probs asked for in the compact shape: the sampled token's value per position, nothing else."""
        return self.logprobs_format == "sampled" and self.wants_logprobs

    @property
    def wants_text(self) -> bool:
        return self.detokenize is not False

    @field_validator("top_k", mode="before")
    @classmethod
    def _none_top_k(cls, value: Any) -> Any:
        return -1 if value is None else value


class GenerateRequest(BaseModel):
    """Body of ``/generate``. ``prompts`` are strings or -- on servers that list
    ``Features.TOKEN_PROMPTS`` -- lists of token ids (no re-tokenisation drift)."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str] | list[list[int]] = Field(min_length=1)
    sampling_params: dict[str, Any] | None = None
    routing_key: Any = None
    strict: bool = False


class TokenLogprob(BaseModel):
    """One candidate token of a generated position: its log-prob and its rank (1 = most likely)."""

    model_config = ConfigDict(extra="allow")

    logprob: float
    rank: int | None = None


def sampled_logprobs(token_ids: list[int], logprobs: list[Any]) -> list[float]:
    """The sampled tokens' log-probs of a result: ``logprobs[i][str(token_ids[i])]`` (vendor format) or
    the floats as given. ``ValueError`` (``TypeError`` for a malformed entry) naming the position when an
    entry lacks its sampled token."""
    if len(logprobs) != len(token_ids):
        raise ValueError(f"logprobs: {len(logprobs)} entries for {len(token_ids)} generated tokens")
    out: list[float] = []
    for i, (token, entry) in enumerate(zip(token_ids, logprobs)):
        if isinstance(entry, (int, float)) and not isinstance(entry, bool):
            out.append(float(entry))
            continue
        if not isinstance(entry, dict):
            raise TypeError(f"logprobs[{i}]: expected an object {{token_id: {{logprob, rank}}}}, got "
                             f"{type(entry).__name__}")
        value = entry.get(str(int(token)), entry.get(int(token)))
        if value is None:
            raise ValueError(f"logprobs[{i}]: no entry for the sampled token {int(token)} (keys {sorted(entry)[:8]})")
        out.append(float(value.logprob if isinstance(value, TokenLogprob) else value["logprob"]))
    return out


class GenerateResult(BaseModel):
    """One sample. With ``n > 1`` results are grouped by prompt: prompt ``i``'s samples are
    ``results[i*n:(i+1)*n]`` (``prompt_index``/``sample_index`` say so too)."""

    model_config = ConfigDict(extra="allow")

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_len: int
    generation_len: int
    prefix_cache_len: int = 0
    #: on the wire (vendor v2 and ours): one ``{str(token_id): TokenLogprob}`` per generated token,
    #: holding the sampled token and the top ``sampling_params.logprobs`` tokens (vLLM's rule). The
    #: adapter hands verl the sampled tokens' values as floats (:func:`sampled_logprobs`).
    logprobs: list[dict[str, TokenLogprob]] | list[float] | None = None
    prompt_index: int | None = None
    sample_index: int | None = None
    weight_version: int | None = None


class GenerateResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    job_id: int
    results: list[GenerateResult]
    #: the sampler's weight version every sample of this answer ran on (servers that batch continuously say so;
    #: absent at the vendor's: read each result's ``weight_version`` then, itself optional)
    weight_version: int | None = None


# --------------------------------------------------------------------------------------------
# Vendor v2 control routes: sleep/wake, prefix cache, /operation, weight norm, /log-probs
# --------------------------------------------------------------------------------------------


class ResetPrefixCacheRequest(BaseModel):
    """``POST /reset-prefix-cache?job_id=<sampling>``. The knobs are the vendor's (accepted for parity
    with its managed service); the cache is dropped at once either way."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    drain: bool = True
    timeout_s: float = Field(60.0, ge=0.0)
    retry_interval_s: float = Field(0.1, ge=0.0)


class OperationType(str, enum.Enum):
    """``operation_type`` values ``/operation`` dispatches (the vendor's four)."""

    WEIGHT_SYNC = "weight-sync"
    RESET_PREFIX_CACHE = "reset-prefix-cache"
    SLEEP_INFERENCE = "sleep-inference"
    WAKE_INFERENCE = "wake-inference"


class OperationRequest(BaseModel):
    """``POST /operation?job_id=<id>``: one envelope for the control operations. ``sub_job_id`` and
    ``sub_job_type`` are routing hints of the vendor's managed service (jobs are named by
    ``?job_id=`` here); ``payload`` is the body of the named operation."""

    model_config = ConfigDict(extra="forbid")

    operation_type: str
    sub_job_id: int | str | None = None
    sub_job_type: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)


class WeightNormRequest(BaseModel):
    """``POST /weight-norm``: compare the training and sampling models after a weight sync."""

    model_config = ConfigDict(extra="forbid")

    training_job_id: int
    sampling_job_id: int


class WeightNormResponse(BaseModel):
    """Global L2 norms (sqrt of the sum of squares over all parameters) and parameter counts."""

    model_config = ConfigDict(extra="allow")

    training_norm: float
    sampling_norm: float
    training_num_params: int
    sampling_num_params: int


class LogProbsRequest(BaseModel):
    """``POST /log-probs?job_id=<log_prob>`` (JSON): per-token log-probs of ``prompts[i] +
    completions[i]`` (or of ``prompts[i]`` alone). The answer is DSSST1 ``{job_id, results}`` with
    ``results`` ``[B, S-1]``: column ``c`` = log p(token ``c+1``), rows right-padded by the tokenizer.
    ``top_k`` is accepted and, as by the vendor's DeepSpeed engine, not used."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(min_length=1)
    completions: list[str] | None = None
    top_k: int = Field(1, ge=0)
