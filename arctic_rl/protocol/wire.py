"""Where calls go and what travels beside their bodies: wire generations, endpoint paths, media
types, headers and the capability names a server lists in ``/health``.

What is not here: the bodies (the other modules of :mod:`arctic_rl.protocol`).
"""

from __future__ import annotations

import enum

__all__ = [
    "AUTH_HEADER",
    "JSON_MEDIA_TYPE",
    "OCTET_STREAM",
    "REPLAY_HEADER",
    "REQUEST_ID_HEADER",
    "STEP_HEADER",
    "V1_ONLY_PATHS",
    "V2_ONLY_PATHS",
    "Features",
    "Paths",
    "ProtocolVersion",
]


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
#: Set (to ``"true"``) on an answer a server replayed from its idempotency cache instead of running the call.
REPLAY_HEADER = "X-Idempotent-Replay"


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
    #: engines; no sleep between them): a client may generate the next batch while this one trains; a weight sync
    #: keeps each /generate answer on one weight version (the calls in flight finish first or run again)
    CONCURRENT_JOBS = "concurrent_jobs"
    #: /sleep-inference frees the sampler's memory and /wake-inference restores it; waking an awake part is a
    #: no-op and a weight sync wakes the weights it loads into, so a client may sleep the sampler between phases
    SAMPLER_SLEEP = "sampler_sleep"
    #: /initialize takes ``ds_worker_config.batch_shape`` (:class:`~.jobs.BatchShape`: the sizes of the batches the
    #: client will send) and the job's warm-up runs at those sizes too (compiles that depend on a batch's size happen
    #: before the first step)
    BATCH_SHAPE = "batch_shape"
