"""The training role of the Arctic adapter: verl's ``update_actor`` and the optimizer step.

For each of ``epochs`` x mini-batches: one ``/forward-backward`` (the server splits it into
``gradient_accumulation_steps`` micro-batches, the vendor's contract), then one ``/step``. Rollout
importance weights are folded into the advantages, or dropped for verl's ``bypass_mode`` loss, which makes its
own (:func:`.loss_config.apply_is_weights`); metrics come
back under verl's names (:mod:`.metrics`), the call's token means as the server reports them. The
body is ``{batch, meta, processing}``: ``meta`` from :func:`.builders.build_meta` (validated by
:func:`arctic_rl.protocol.validate_meta`), ``processing`` a :class:`arctic_rl.protocol.Processing`.

What is not here: the lifecycle of the jobs (:mod:`.arctic_rl`), sending (:mod:`.session`), what
happens when an answer is lost (:mod:`.recovery`), when a recovery checkpoint is due (:mod:`.checkpoint_schedule`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from arctic_rl.protocol import (
    FieldError,
    ForwardBackwardResponse,
    JobType,
    Paths,
    Processing,
    StepResponse,
    validate_meta,
)
from verl.remote_backend.errors import RemoteBackendConfigError

from ..common.verl_settings import VerlSettings
from .answers import parse_answer
from .arctic_config import ArcticConfig
from .builders import BatchPlan, build_meta
from .checkpoint_schedule import CheckpointSchedule
from .dialect import Payload
from .layout import RESPONSE_KEYS, dense_batch, plan_layout, shuffled_rows, split_rows
from .loss_config import apply_is_weights, build_loss_config, loss_fn_name
from .metrics import FlopsEstimator, mini_batch_metrics
from .request import JobRequest
from .session import JobCalls, ModelTokens
from .state import RunState

__all__ = ["TRAIN_POST", "Trainer", "sampling_temperature"]

#: the vendor scales logits by ``meta.temperature`` only under ``apply_temperature``: the update and the
#: old log-probs (:mod:`.log_probs`) are computed at the sampling temperature alike
TRAIN_POST = ("apply_temperature", "compute_entropy_and_logprobs")


def sampling_temperature(data: TensorDict, verl: VerlSettings) -> float:
    """The batch's sampling temperature (verl's ``rollout.temperature`` when it says none); greedy
    sampling (``<= 0``) is scored with the plain distribution (1.0)."""
    value = tu.get(data, "temperature", None)
    value = verl.rollout_temperature if value is None else float(value)
    return 1.0 if value <= 0 else value


def forward_body(batch: dict, meta: dict, processing: Processing) -> dict[str, Any]:
    """A ``/forward`` or ``/forward-backward`` body, its JSON parts checked by the protocol's models: a meta key
    the protocol does not define raises here, naming it, the allowed keys and the keys given, before sending."""
    try:
        checked = validate_meta(meta)
    except FieldError as exc:
        raise RemoteBackendConfigError(exc.field, exc.message, allowed=exc.allowed, received=exc.received) from None
    return {"batch": batch, "meta": checked.model_dump(mode="json", exclude_unset=True),
            "processing": processing.model_dump(mode="json")}


@dataclass(eq=False)
class Trainer:
    """``update_actor`` on the training job, and the optimizer step it ends every mini-batch with; after a
    step, a recovery checkpoint (``save_checkpoint``) when ``schedule`` says one is due."""

    calls: JobCalls
    state: RunState
    schedule: CheckpointSchedule
    verl: VerlSettings
    arctic: ArcticConfig
    plan: BatchPlan
    flops: FlopsEstimator
    tokens: ModelTokens
    save_checkpoint: Callable[..., dict]

    def update_actor(self, data: TensorDict) -> TensorDict:
        """PPO/GRPO update: ``epochs`` x mini-batches of (one ``/forward-backward``, one ``/step``)."""
        plan, verl = self.plan, self.verl
        mini_rows = plan.mini_batch_rows
        for name in ("mini_batch_size", "global_batch_size"):
            asked = tu.get(data, name, None)
            if asked is not None and int(asked) != mini_rows:
                raise RemoteBackendConfigError(
                    "actor_rollout_ref.actor.ppo_mini_batch_size", f"the trainer asks for mini-batches of {asked} rows "
                    f"({name}) but the training job was created for {mini_rows} (ds_config.train_batch_size)",
                    allowed=mini_rows, received=int(asked))
        epochs = int(tu.get(data, "epochs", None) or verl.ppo_epochs)
        loader = tu.get(data, "dataloader_kwargs", None) or {}
        shuffle = bool(loader.get("shuffle", verl.shuffle)) if isinstance(loader, dict) else verl.shuffle
        seed = tu.get(data, "seed", None)
        seed = int(verl.data_loader_seed if seed is None else seed)
        entropy = bool(tu.get(data, "calculate_entropy", False)) or verl.calculate_entropy or verl.entropy_coeff != 0
        zorro = self.arctic.train.zorro_train.enable
        layout = plan_layout(data, response_width=verl.max_response_length if zorro else None, group_rows=zorro)
        if layout.rows % mini_rows:
            raise RemoteBackendConfigError(
                "actor_rollout_ref.actor.ppo_mini_batch_size", f"a batch of {layout.rows} rows does not split into "
                f"mini-batches of {mini_rows} rows (ppo_mini_batch_size x rollout.n)",
                allowed=f"a batch of a multiple of {mini_rows} rows", received=layout.rows)
        if verl.use_kl_loss and "ref_log_prob" not in data.keys():  # noqa: SIM118 - TensorDict has no `in`
            raise RemoteBackendConfigError("data.ref_log_prob", "use_kl_loss needs the reference log-probs",
                                           allowed="compute_ref_log_prob before update_actor", received=None)
        pad = self.tokens.pad_token_id
        present = set(data.keys())  # a TensorDict answers no `in`
        keys = tuple(k for k in RESPONSE_KEYS if k in present and (k != "ref_log_prob" or verl.use_kl_loss))
        batch = dense_batch(data, layout, pad_token_id=pad, keys=keys)
        if "response_mask" not in batch:
            raise RemoteBackendConfigError("data.response_mask", "required by update_actor", received=None)
        apply_is_weights(batch, verl)
        seq_lens = layout.offsets.diff().index_select(0, layout.order)
        temperature = sampling_temperature(data, verl)
        token_mean = verl.loss_agg_mode == "token-mean"
        path = self.state.dialect.forward_backward_path
        out: dict[str, list] = {}
        for epoch in range(epochs):
            rows = shuffled_rows(layout, seed=seed + epoch if shuffle else None)
            for mini in split_rows(rows, mini_rows):
                t0 = time.perf_counter()
                tokens = float(batch["response_mask"].index_select(0, mini).sum())
                # verl 0.9.1's token-mean divides by the mini-batch's tokens (loss_scale_factor is read by
                # seq-mean-token-sum-norm only, which the protocol refuses)
                scale = max(tokens, 1.0) if token_mean else None
                loss = build_loss_config(verl, loss_scale_tokens=scale)
                # one /forward-backward per mini-batch (the server splits it into its GAS micro-batches),
                # then one /step: the vendor's contract. batch_num_tokens in meta is where the vendor reads it.
                meta = build_meta(verl, self.arctic, max_prompt_len=layout.prompt_width,
                                  max_response_len=layout.response_width, temperature=temperature,
                                  calculate_entropy=entropy, pad_token_id=pad,
                                  global_batch_size=mini_rows, batch_num_tokens=scale or tokens, loss=loss)
                processing = Processing(loss_fn=loss_fn_name(verl), post=list(TRAIN_POST), config=loss)
                body = forward_body({k: v.index_select(0, mini) for k, v in batch.items()}, meta, processing)
                res = self.calls.post_tensors(path, JobType.TRAINING, body, op="forward_backward", idempotent=False,
                                              counter=("pending_forward_backward", 0))
                call_metrics: dict[str, Any] = {}
                if res.answered:  # else applied, its answer (and metrics) lost
                    answer = parse_answer(ForwardBackwardResponse, res.value, f"POST {path}")
                    call_metrics = dict(answer.metrics)
                    if answer.avg_loss is not None:
                        call_metrics.setdefault("loss", answer.avg_loss)
                step = self.optimizer_step()
                values = mini_batch_metrics(call_metrics, step, kl_coef=verl.kl_loss_coef if verl.use_kl_loss else None)
                values["mfu"] = self.flops.mfu(int(seq_lens.index_select(0, mini).sum()), time.perf_counter() - t0,
                                               devices=plan.num_devices, training=True)
                for name, value in values.items():
                    out.setdefault(name, []).append(value)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": out})

    def optimizer_step(self) -> dict:
        """One ``/step``; its metrics (``global_step``, ``last_lr``, ``grad_norm`` where the server says)."""
        state = self.state
        request = JobRequest("POST", Paths.STEP, op="step", idempotent=False, job=JobType.TRAINING,
                             payload=Payload(json=state.dialect.step_body()))
        answer = self.calls.read(request, StepResponse, counter=("global_step", state.step))  # journalled
        if not answer.answered:  # applied, answer lost: what the server's job info still tells
            # count the step first: a restart during the read replays the journal, which now holds it
            state.set_step(state.step + 1)
            info = self.calls.job_info(JobType.TRAINING)
            metrics = {"global_step": state.step, "last_lr": info.get("lr"), "grad_norm": None}
        else:
            metrics = dict(answer.answer(request.what).metrics)
        step = metrics.get("global_step")
        state.set_step(int(step) if isinstance(step, int) and not isinstance(step, bool) else state.step + 1)
        if state.dialect.can_load_checkpoints:  # a recovery checkpoint is only useful where it can be loaded
            self.schedule.after_step(state.step, self.save_checkpoint)
        return metrics
