"""The vendor's v2 control routes: sleep/wake, ``/reset-prefix-cache``, ``/operation``,
``/weight-norm`` and ``/log-probs``.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import Field

from .base import Strict, Tolerant

__all__ = [
    "LogProbsRequest",
    "OperationRequest",
    "OperationType",
    "ResetPrefixCacheRequest",
    "WeightNormRequest",
    "WeightNormResponse",
]


class ResetPrefixCacheRequest(Strict):
    """``POST /reset-prefix-cache?job_id=<sampling>``. The knobs are the vendor's (accepted for parity
    with its managed service); the cache is dropped at once either way."""

    drain: bool = True
    timeout_s: float = Field(60.0, ge=0.0)
    retry_interval_s: float = Field(0.1, ge=0.0)


class OperationType(str, enum.Enum):
    """``operation_type`` values ``/operation`` dispatches (the vendor's four)."""

    WEIGHT_SYNC = "weight-sync"
    RESET_PREFIX_CACHE = "reset-prefix-cache"
    SLEEP_INFERENCE = "sleep-inference"
    WAKE_INFERENCE = "wake-inference"


class OperationRequest(Strict):
    """``POST /operation?job_id=<id>``: one envelope for the control operations. ``sub_job_id`` and
    ``sub_job_type`` are routing hints of the vendor's managed service (jobs are named by
    ``?job_id=`` here); ``payload`` is the body of the named operation."""

    operation_type: str
    sub_job_id: int | str | None = None
    sub_job_type: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)


class WeightNormRequest(Strict):
    """``POST /weight-norm``: compare the training and sampling models after a weight sync."""

    training_job_id: int
    sampling_job_id: int


class WeightNormResponse(Tolerant):
    """Global L2 norms (sqrt of the sum of squares over all parameters) and parameter counts."""

    training_norm: float
    sampling_norm: float
    training_num_params: int
    sampling_num_params: int


class LogProbsRequest(Strict):
    """``POST /log-probs?job_id=<log_prob>`` (JSON): per-token log-probs of ``prompts[i] +
    completions[i]`` (or of ``prompts[i]`` alone). The answer is DSSST1 ``{job_id, results}`` with
    ``results`` ``[B, S-1]``: column ``c`` = log p(token ``c+1``), rows right-padded by the tokenizer.
    ``top_k`` is accepted and, as by the vendor's DeepSpeed engine, not used."""

    prompts: list[str] = Field(min_length=1)
    completions: list[str] | None = None
    top_k: int = Field(1, ge=0)
