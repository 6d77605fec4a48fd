"""The log-prob role of the Arctic adapter: verl's ``compute_log_prob`` and ``compute_ref_log_prob``.

One ``/forward`` (v1: ``/fwd-no-grad``) per call -- on the training job for the current policy, on
the log_prob job for the reference policy -- with the ``apply_temperature`` post-processor, so old
log-probs are computed at the sampling temperature exactly as the update's are. The answer's
``batch.logprobs`` (and ``entropy``) come back nested with the offsets of ``input_ids``; their
layout is the job's: response-aligned with ZoRRO, shifted without (the vendor's answer carries no
key saying so, ours may, and a disagreement is a protocol error).

What is not here: the wire layout (:mod:`.layout`), sending (:mod:`.session`).
"""

from __future__ import annotations

import time

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from arctic_rl.protocol import (
    ENTROPY_KEY,
    LOGPROB_ALIGNMENT_KEY,
    LOGPROBS_KEY,
    Features,
    ForwardResponse,
    JobType,
    LogprobAlignment,
    Processing,
)
from verl.remote_backend.errors import RemoteBackendConfigError, RemoteProtocolError

from ..common.verl_settings import VerlSettings
from .answers import parse_answer
from .arctic_config import ArcticConfig
from .builders import build_meta
from .layout import dense_batch, nested_from_server, plan_layout
from .metrics import FlopsEstimator
from .session import JobCalls, ModelTokens
from .state import RunState
from .training import TRAIN_POST, forward_body, sampling_temperature

__all__ = ["LogProbs"]

#: the same post-processors as the update's (:data:`.training.TRAIN_POST`), without a loss
FORWARD_POST = TRAIN_POST


class LogProbs:
    """Log-probs of the current (training job) and reference (log_prob job) policies."""

    def __init__(self, calls: JobCalls, state: RunState, *, verl: VerlSettings, arctic: ArcticConfig,
                 flops: FlopsEstimator, tokens: ModelTokens) -> None:
        self.calls = calls
        self.state = state
        self.verl = verl
        self.arctic = arctic
        self.flops = flops
        self.tokens = tokens

    def compute(self, data: TensorDict, job_type: JobType) -> TensorDict:
        """``log_probs`` (and ``entropy`` when the batch asks ``calculate_entropy``) from the job of
        ``job_type``; ``metrics{mfu}``."""
        t0 = time.perf_counter()
        zorro = self.arctic.train.zorro_train.enable
        key = "train" if job_type is JobType.TRAINING else "log_prob"
        devices = self.arctic.train.num_devices if job_type is JobType.TRAINING else self.arctic.log_prob.num_devices
        entropy = bool(tu.get(data, "calculate_entropy", False))
        layout = plan_layout(data, response_width=self.verl.max_response_length if zorro else None, group_rows=zorro)
        if layout.rows < devices:
            raise RemoteBackendConfigError(f"remote_backend.{key}.num_devices",
                                           f"a batch of {layout.rows} rows cannot be spread over the job's devices",
                                           allowed=f"<= {layout.rows}", received=devices)
        pad = self.tokens.pad_token_id
        meta = build_meta(self.verl, self.arctic, max_prompt_len=layout.prompt_width,
                          max_response_len=layout.response_width, temperature=sampling_temperature(data, self.verl),
                          calculate_entropy=entropy, pad_token_id=pad,
                          response_logprobs_only=Features.RESPONSE_LOGPROBS in self.state.features)
        body = forward_body(dense_batch(data, layout, pad_token_id=pad, keys=()), meta,
                            Processing(loss_fn=None, post=list(FORWARD_POST)))
        path = self.state.dialect.forward_path
        endpoint = "POST /forward"
        out = self.calls.post_tensors(path, job_type, body, op="forward", idempotent=True).answer(endpoint)
        tensors = parse_answer(ForwardResponse, out, endpoint).batch
        # the job config says which layout comes back (the vendor's answer carries no key for it)
        alignment = LogprobAlignment.RESPONSE if zorro else LogprobAlignment.SHIFTED
        said = out.get(LOGPROB_ALIGNMENT_KEY) or (out.get("metrics") or {}).get(LOGPROB_ALIGNMENT_KEY)
        if said is not None and said != alignment.value:
            raise RemoteProtocolError(endpoint, f"{LOGPROB_ALIGNMENT_KEY}: the server answered {said!r} log-probs, "
                                      f"but a job with zorro_train.enable={zorro} answers {alignment.value!r} ones")
        result = {"log_probs": nested_from_server(_tensor(tensors, (LOGPROBS_KEY, "log_probs"), endpoint), layout,
                                                  alignment, key=LOGPROBS_KEY, endpoint=endpoint)}
        if entropy:
            result["entropy"] = nested_from_server(_tensor(tensors, (ENTROPY_KEY,), endpoint), layout, alignment,
                                                   key=ENTROPY_KEY, endpoint=endpoint)
        seconds = time.perf_counter() - t0
        metrics = {"mfu": self.flops.mfu(int(layout.offsets[-1]), seconds, devices=devices, training=False)}
        return tu.get_tensordict(result, non_tensor_dict={"metrics": metrics})


def _tensor(tensors: dict, names: tuple[str, ...], endpoint: str) -> torch.Tensor:
    for name in names:
        value = tensors.get(name)
        if isinstance(value, torch.Tensor):
            return value.float()
    raise RemoteProtocolError(endpoint, f"the answer has no batch.{names[0]} tensor (keys: {sorted(tensors)})")
