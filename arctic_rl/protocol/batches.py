"""``/forward``, ``/forward-backward`` and ``/step``: the tensors a body carries, its ``meta`` and
``processing`` (with :class:`~.loss.LossConfig` typed in), and the answers.

A body is ``{batch, meta, processing}``. ``batch`` holds the tensors named here; ``meta`` is
:class:`BatchMeta`, which refuses unknown keys (:func:`validate_meta` names the key, the allowed ones
and what was received) but lists every key the vendor's clients send, so their calls still pass.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_serializer

from .base import FieldError, Strict, Tolerant
from .loss import LossConfig

__all__ = [
    "ENTROPY_KEY",
    "LOGPROBS_KEY",
    "LOGPROB_ALIGNMENT_KEY",
    "OPTIONAL_FORWARD_TENSORS",
    "OPTIONAL_TRAIN_TENSORS",
    "REQUIRED_FORWARD_TENSORS",
    "REQUIRED_TRAIN_TENSORS",
    "BatchMeta",
    "ForwardBackwardResponse",
    "ForwardResponse",
    "LogprobAlignment",
    "Processing",
    "StepRequest",
    "StepResponse",
    "validate_meta",
]

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


class Processing(Strict):
    """``processing`` of a forward/backward body: which loss and post-processors to run, and the loss's
    settings (``config``, read by the ``/forward-backward`` loss; ``{}`` on the wire when absent)."""


    loss_fn: str | None = None
    post: str | list[str] | None = None
    config: LossConfig | None = None

    @field_serializer("config")
    def _config_body(self, value: LossConfig | None) -> dict[str, Any]:
        return {} if value is None else value.wire_body()


class BatchMeta(Strict):
    """``meta`` of a forward/backward body. Strict: a misspelt key is refused (:func:`validate_meta`).

    Besides the keys our client sends, the fields list every key the vendor's clients send (its verl
    adapter and its SFT client), which our server accepts and does not act on (``Any`` where the
    protocol does not define the value).
    """

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
    #: verl's actor settings as the vendor's ``verl_grpo`` loss reads them (``loss_agg_mode``, clip ratios, KL)
    actor_config: dict[str, Any] | None = None
    #: verl's ``policy_loss`` settings; the vendor's loss reads ``loss_mode`` from it
    policy_loss_config: dict[str, Any] | None = None
    load_balancer: Any = None
    #: copies of the ``ds_worker_config`` knobs (the vendor's plain path reads them per call)
    logits_optimization: Literal["none", "memory", "compute"] | None = None
    logits_optimization_peak_mem_size_in_gib: float | None = Field(None, gt=0)
    logits_compute_in_fp32: bool | None = None
    #: read from meta only, as the vendor's loss does: a number or a tensor (checked by the server)
    rollout_is_weights: Any = None
    #: sent by the vendor's verl adapter
    zorro_train_max_rollouts: Any = None
    drop_position_ids: bool | None = None
    #: sent by the vendor's SFT client
    gas_microbatches: bool | None = None
    sample_packing: bool | None = None


def validate_meta(raw: Mapping[str, Any]) -> BatchMeta:
    """``raw`` as :class:`BatchMeta`; an unknown key raises :class:`~.base.FieldError` naming it, the allowed
    keys and the keys received (other bad values raise pydantic's ``ValidationError``)."""
    allowed = sorted(BatchMeta.model_fields)
    unknown = sorted(str(k) for k in raw if k not in BatchMeta.model_fields)
    if unknown:
        raise FieldError(f"meta.{unknown[0]}", f"unknown meta key {unknown[0]!r} (a misspelling?); "
                         f"received keys {sorted(map(str, raw))}", allowed=allowed, received=unknown[0])
    return BatchMeta.model_validate(dict(raw))


class ForwardBackwardResponse(Tolerant):
    """``/forward-backward``: the call's metrics (token means) and mean loss."""

    job_id: int
    metrics: dict[str, Any]
    avg_loss: float | None = None


class ForwardResponse(Tolerant):
    """Decoded from DSSST1; ``batch`` holds ``logprobs`` (and ``entropy``) tensors."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    job_id: int
    batch: dict[str, Any]
    metrics: dict[str, Any] = Field(default_factory=dict)


class StepRequest(Strict):
    """``POST /step`` (v2)."""

    #: accepted for parity with the managed service; the on-prem scheduler decides the LR
    learning_rate: float | None = None


class StepResponse(Tolerant):
    """The vendor's servers answer ``{job_id, workers}`` (no ``metrics``); ours adds ``metrics``."""

    job_id: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    batch: dict[str, Any] = Field(default_factory=dict)
