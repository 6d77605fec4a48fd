"""Pure builders of what the Arctic server is told: ``ds_config``, ``ds_worker_config``, ``JobConfig``,
and the per-call ``meta`` of forward/backward bodies.

Every function here is a pure function of :class:`..common.verl_settings.VerlSettings` (what verl's config
says) and :class:`.arctic_config.ArcticConfig` (``config.remote_backend``); the golden-dict tests
in ``tests/remote_client/arctic/test_builders_on_cpu.py`` pin their output.

Batch accounting (DeepSpeed counts gradient accumulation in micro-backwards)::

    mini-batch rows  = ppo_mini_batch_size * rollout_n  = ds train_batch_size  (one /forward-backward + one /step)
    micro-batch rows = micro_batch_size_per_device * num_devices
    gradient_accumulation_steps = mini-batch rows / micro-batch rows  = micro-batches the server splits a call into

What is not here: HTTP, tensors, or reading the configs.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from arctic_rl.protocol import (
    MAX_BATCH_SHAPE_SIZE,
    BatchShape,
    DsWorkerConfig,
    Features,
    JobConfig,
    JobType,
    LossConfig,
)
from verl.remote_backend.errors import RemoteBackendConfigError

from ..common.verl_settings import OptimSettings, VerlSettings
from .arctic_config import ArcticConfig, DeepSpeedSettings

__all__ = [
    "VENDOR_ACTOR_KEYS",
    "BatchPlan",
    "build_batch_shape",
    "build_ds_config",
    "build_ds_worker_config",
    "build_job_config",
    "build_log_prob_ds_config",
    "build_lr_scheduler",
    "build_meta",
    "plan_batches",
    "resolve_attn_implementation",
]


_ACTOR = "actor_rollout_ref.actor"
#: the :class:`LossConfig` fields the vendor's ``verl_grpo`` loss reads from ``meta.actor_config``
#: (``integrations/verl/grpo_loss.py`` ``VerlPolicyConfig``); the others travel in ``processing.config`` only
VENDOR_ACTOR_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "use_kl_loss",
                     "kl_loss_coef", "kl_loss_type", "entropy_coeff")
_OPTIM = f"{_ACTOR}.optim"


@dataclass(frozen=True)
class BatchPlan:
    """How one verl training batch maps onto /forward-backward and /step calls."""

    mini_batch_rows: int  # rows per optimizer step (= ds train_batch_size)
    micro_batch_per_device: int  # ds train_micro_batch_size_per_gpu
    num_devices: int
    micro_batch_rows: int  # rows per micro-batch (the server splits each /forward-backward into these)
    gradient_accumulation_steps: int  # micro-batches per /forward-backward (one call + one /step per mini-batch)
    steps_per_global_step: int  # optimizer steps per verl training step (ppo_epochs * mini-batches)


def plan_batches(verl: VerlSettings, arctic: ArcticConfig) -> BatchPlan:
    """Derive and check the batch accounting; raises RemoteBackendConfigError on a mismatch."""
    n = verl.rollout_n
    mini_rows = verl.ppo_mini_batch_size * n
    devices = arctic.train.num_devices
    if verl.ppo_mini_batch_size < 1 or n < 1:
        raise RemoteBackendConfigError(f"{_ACTOR}.ppo_mini_batch_size", "must be positive", allowed=">= 1",
                                       received=verl.ppo_mini_batch_size)
    micro = arctic.train.micro_batch_size or verl.ppo_micro_batch_size_per_gpu
    key = "remote_backend.train.micro_batch_size" if arctic.train.micro_batch_size else f"{_ACTOR}.ppo_micro_batch_size_per_gpu"
    if micro is None:  # one /forward-backward per /step
        if mini_rows % devices:
            raise RemoteBackendConfigError(
                "remote_backend.train.num_devices", "must divide the mini-batch rows (ppo_mini_batch_size * rollout.n)",
                allowed=f"a divisor of {mini_rows}", received=devices)
        micro = mini_rows // devices
        key = "remote_backend.train.micro_batch_size"
    micro = int(micro)
    micro_rows = micro * devices
    if micro < 1 or mini_rows % micro_rows:
        raise RemoteBackendConfigError(
            key, f"micro-batch rows ({micro} per device x {devices} devices) must divide the mini-batch rows "
            f"(ppo_mini_batch_size {verl.ppo_mini_batch_size} x rollout.n {n} = {mini_rows})",
            allowed=f"a per-device size s with {mini_rows} % (s * {devices}) == 0", received=micro)
    if verl.train_batch_size % verl.ppo_mini_batch_size:
        raise RemoteBackendConfigError(
            "data.train_batch_size", "must be a multiple of actor.ppo_mini_batch_size",
            allowed=f"a multiple of {verl.ppo_mini_batch_size}", received=verl.train_batch_size)
    mini_batches = max(1, verl.train_batch_size // verl.ppo_mini_batch_size)
    return BatchPlan(
        mini_batch_rows=mini_rows,
        micro_batch_per_device=micro,
        num_devices=devices,
        micro_batch_rows=micro_rows,
        gradient_accumulation_steps=mini_rows // micro_rows,
        steps_per_global_step=verl.ppo_epochs * mini_batches,
    )


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _zero_section(ds: DeepSpeedSettings, *, with_optimizer: bool) -> dict:
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if with_optimizer and ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return zero


def build_lr_scheduler(optim: OptimSettings, *, total_global_steps: int | None, steps_per_global_step: int) -> dict | None:
    """DeepSpeed ``scheduler`` section matching verl's LR schedule, or ``None`` for a constant LR.

    verl steps its scheduler once per training step (``update_lr_scheduler`` on the last
    mini-batch), DeepSpeed once per optimizer step, so horizons and warm-up are multiplied by the
    optimizer steps per training step (``ppo_epochs * mini-batches``).
    """
    kind = optim.lr_scheduler_type
    if kind not in ("constant", "cosine"):
        raise RemoteBackendConfigError(f"{_OPTIM}.lr_scheduler_type", "unsupported LR schedule",
                                       allowed=["constant", "cosine"], received=kind)
    total = total_global_steps if total_global_steps and total_global_steps > 0 else None
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps > 0:
        warmup = int(optim.lr_warmup_steps)
    elif optim.lr_warmup_steps_ratio > 0:
        if total is None:
            raise RemoteBackendConfigError(
                f"{_OPTIM}.total_training_steps", "unknown, but lr_warmup_steps_ratio needs it (verl injects it once "
                "the dataloader is built; create the backend after that or set trainer.total_training_steps)",
                allowed="> 0", received=optim.total_training_steps)
        warmup = int(optim.lr_warmup_steps_ratio * total)
    else:
        warmup = 0
    k = steps_per_global_step
    if kind == "constant":
        if warmup <= 0:
            return None
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": optim.lr,
                                               "warmup_num_steps": warmup * k, "warmup_type": "linear"}}
    if total is None:
        raise RemoteBackendConfigError(f"{_OPTIM}.total_training_steps", "unknown, but the cosine schedule needs it",
                                       allowed="> 0", received=optim.total_training_steps)
    if optim.num_cycles != 0.5:
        raise RemoteBackendConfigError(f"{_OPTIM}.num_cycles", "DeepSpeed's WarmupCosineLR is a half cosine",
                                       allowed=[0.5], received=optim.num_cycles)
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": total * k,
            # WarmupCosineLR needs >= 1 warm-up step; with ratio 1.0 that step is already at full LR
            "warmup_num_steps": max(1, warmup * k),
            "warmup_min_ratio": 0.0 if warmup > 0 else 1.0,
            "cos_min_ratio": float(optim.min_lr_ratio or 0.0),
            "warmup_type": "linear",
        },
    }


def build_ds_config(verl: VerlSettings, arctic: ArcticConfig) -> dict:
    """DeepSpeed config of the training job (optimizer from ``actor.optim``, batch sizes from the plan)."""
    plan = plan_batches(verl, arctic)
    ds = arctic.train.deepspeed
    optim = verl.optim
    config: dict[str, Any] = {
        "train_batch_size": plan.mini_batch_rows,
        "train_micro_batch_size_per_gpu": plan.micro_batch_per_device,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps,
                       "weight_decay": optim.weight_decay},
        },
        "gradient_clipping": optim.clip_grad,
        "bf16": {"enabled": ds.bf16},
        "zero_optimization": _zero_section(ds, with_optimizer=True),
    }
    total = optim.total_training_steps if optim.total_training_steps > 0 else verl.trainer_total_training_steps
    scheduler = build_lr_scheduler(optim, total_global_steps=total, steps_per_global_step=plan.steps_per_global_step)
    if scheduler is not None:
        config["scheduler"] = scheduler
    return _deep_merge(config, ds.extra)


def build_log_prob_ds_config(arctic: ArcticConfig) -> dict:
    """DeepSpeed config of the forward-only log_prob job: no optimizer, one row per device per batch.

    Without an optimizer DeepSpeed refuses ZeRO stages 1 and 2 (``zero stage N requires an optimizer``):
    the job runs stage 3 when the training job does, else stage 0."""
    ds = arctic.train.deepspeed
    devices = arctic.log_prob.num_devices
    stage = 3 if ds.zero_stage == 3 else 0
    config = {
        "train_batch_size": devices,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": ds.bf16},
        "zero_optimization": _zero_section(dataclasses.replace(ds, zero_stage=stage), with_optimizer=False),
    }
    extra = {k: v for k, v in ds.extra.items() if k not in ("optimizer", "scheduler", "gradient_clipping")}
    return _deep_merge(config, extra)


def build_ds_worker_config(verl: VerlSettings, arctic: ArcticConfig) -> dict:
    """``ds_worker_config`` of the training and log_prob jobs.

    The server reads the ``logits_*`` knobs ONLY from here (per-call meta copies alone are silently
    ignored), so they are always sent. Two server knobs are treated specially:

    * ``zorro_train_load_balancer`` is forwarded for forward compatibility: no server release
      consumes it yet, so it must not be relied on for anything today.
    * ``logits_compute_from_fp32_inputs`` is deliberately not exposed: it upcasts the LM-head
      input and runs the vocabulary projection in fp32 on the ZoRRO path only, so the same config
      would compute log-probs differently with ZoRRO on and off; ``logits_compute_in_fp32``
      covers the precision need on both paths.
    """
    train = arctic.train
    config: dict[str, Any] = {
        "attn_implementation": resolve_attn_implementation(verl, arctic),
        "zorro_train_enable": train.zorro_train.enable,
        "response_len": verl.max_response_length,
        "max_token_len": verl.ppo_max_token_len_per_gpu,
        "rollout_n": verl.rollout_n,
        "temperature": verl.rollout_temperature,
        "logits_optimization": train.logits.optimization,
        "logits_optimization_peak_mem_size_in_gib": train.logits.peak_mem_size_in_gib,
        "logits_compute_in_fp32": train.logits.compute_in_fp32,
        "use_liger": verl.use_liger,
        "enable_gradient_checkpointing": (verl.enable_gradient_checkpointing if train.gradient_checkpointing is None
                                          else train.gradient_checkpointing),
    }
    if train.zorro_train.enable:
        config["use_unpad"] = True  # the vendor's ZoRRO path runs unpadded
        config["zorro_train_load_balancer"] = train.zorro_train.load_balancer
    return DsWorkerConfig.model_validate(config).model_dump(mode="json", exclude_unset=True)


def resolve_attn_implementation(verl: VerlSettings, arctic: ArcticConfig) -> str:
    """``train.attn_implementation``, where ``auto`` is verl's model override if it sets one, else
    ``flash_attention_2``: the vendor packs the rows of a call into one sequence, which only a
    flash-attention backend keeps apart (with eager/sdpa rows attend to each other there), and its
    ZoRRO patch needs one. The reference server runs eager/sdpa itself and accepts any name."""
    attn = arctic.train.attn_implementation
    if attn != "auto":
        return attn
    return verl.attn_implementation or "flash_attention_2"


def build_batch_shape(verl: VerlSettings, arctic: ArcticConfig) -> dict:
    """``ds_worker_config.batch_shape`` (:class:`arctic_rl.protocol.BatchShape`): the largest batches verl will
    send -- prompts of ``data.max_prompt_length`` tokens at most, responses of ``data.max_response_length``, a
    ``/forward`` per step's batch (``data.train_batch_size`` x ``rollout.n`` rows) and a ``/forward-backward`` per
    mini-batch. A warm-up hint: sizes beyond the protocol's bound are sent at the bound."""
    plan = plan_batches(verl, arctic)
    sizes = {"prompt_len": verl.max_prompt_length, "response_len": verl.max_response_length,
             "forward_rows": verl.train_batch_size * verl.rollout_n, "forward_backward_rows": plan.mini_batch_rows}
    return BatchShape(**{k: min(int(v), MAX_BATCH_SHAPE_SIZE) for k, v in sizes.items()}).model_dump(mode="json")


def build_job_config(job_type: JobType | str, verl: VerlSettings, arctic: ArcticConfig, *,
                     client_tag: str | None = None, features: frozenset[str] = frozenset()) -> dict:
    """The ``/initialize`` body of one job, validated by ``arctic_rl.protocol.JobConfig``. ``client_tag``
    labels the run's jobs (servers that do not know it ignore it: ``JobConfig`` is tolerant). ``features``
    are the server's (``/health``): one listing ``Features.BATCH_SHAPE`` gets the training and log_prob jobs'
    ``ds_worker_config.batch_shape`` (:func:`build_batch_shape`); others never see the key."""
    job_type = JobType(job_type)
    seed = arctic.train.seed if arctic.train.seed is not None else verl.data_loader_seed
    body: dict[str, Any] = {
        "model_name": verl.model_path,
        "job_type": job_type.value,
        "seed": seed,
        "full_determinism": arctic.train.full_determinism,
    }
    if job_type is JobType.SAMPLING and verl.rollout_full_determinism:
        body["full_determinism"] = True  # verl's rollout.full_determinism: the sampler may not batch calls together
    if client_tag:
        body["client_tag"] = client_tag
    if job_type is JobType.TRAINING:
        checkpoint_path = arctic.train.checkpoint_path or verl.default_local_dir
        if not checkpoint_path:
            raise RemoteBackendConfigError("remote_backend.train.checkpoint_path",
                                           "required for the training job (trainer.default_local_dir is unset too)",
                                           allowed="a directory on the server", received=checkpoint_path)
        body.update(
            num_devices=arctic.train.num_devices,
            ds_config=build_ds_config(verl, arctic),
            ds_worker_config=build_ds_worker_config(verl, arctic),
            checkpoint_path=str(checkpoint_path),
            cuda_ipc=arctic.weight_sync.cuda_ipc,
            low_memory=arctic.weight_sync.low_memory,
        )
    elif job_type is JobType.LOG_PROB:
        ds_config = build_log_prob_ds_config(arctic)
        # the vendor builds its forward-only engine from log_prob_config; others read ds_config
        body.update(num_devices=arctic.log_prob.num_devices, ds_config=ds_config, log_prob_config=ds_config,
                    ds_worker_config=build_ds_worker_config(verl, arctic))
    else:
        # as stock verl sizes its vLLM engine (and the vendor's own verl integration its sampler): verl's
        # rollout engine options, the context prompt + response unless rollout.max_model_len says otherwise;
        # remote_backend.rollout.vllm_config wins key by key
        vllm = {"max_model_len": verl.max_prompt_length + verl.max_response_length}
        vllm.update(verl.rollout_engine)
        vllm.update(arctic.rollout.vllm_config)
        body.update(num_devices=arctic.rollout.num_devices, vllm_config=vllm)
    if Features.BATCH_SHAPE in features and job_type is not JobType.SAMPLING:
        body["ds_worker_config"] = {**body["ds_worker_config"], "batch_shape": build_batch_shape(verl, arctic)}
    return JobConfig.model_validate(body).model_dump(mode="json")


def build_meta(
    verl: VerlSettings,
    arctic: ArcticConfig,
    *,
    max_prompt_len: int,
    max_response_len: int,
    temperature: float,
    calculate_entropy: bool,
    pad_token_id: int,
    global_batch_size: int | None = None,
    batch_num_tokens: float | None = None,
    loss: LossConfig | None = None,
    response_logprobs_only: bool = False,
) -> dict:
    """``meta`` of one /forward or /forward-backward body (JSON values only). ``response_logprobs_only``
    (a ``/forward`` to a server listing ``Features.RESPONSE_LOGPROBS``: the response tokens' values only)
    is sent only when true, so other servers never see the key."""
    train = arctic.train
    meta: dict[str, Any] = {
        "zorro_train_enable": train.zorro_train.enable,
        "rollout_n": verl.rollout_n,
        "max_prompt_len": int(max_prompt_len),
        "max_response_len": int(max_response_len),
        "max_token_len_per_gpu": verl.ppo_max_token_len_per_gpu,
        "temperature": float(temperature),
        "calculate_entropy": bool(calculate_entropy),
        "pad_token_id": int(pad_token_id),
        "load_balancer": train.zorro_train.load_balancer,
        # copies of the ds_worker_config knobs (that is where the server reads them)
        "logits_optimization": train.logits.optimization,
        "logits_optimization_peak_mem_size_in_gib": train.logits.peak_mem_size_in_gib,
        "logits_compute_in_fp32": train.logits.compute_in_fp32,
    }
    if response_logprobs_only:
        meta["response_logprobs_only"] = True
    if global_batch_size is not None:
        meta["global_batch_size"] = int(global_batch_size)
    if batch_num_tokens is not None:
        meta["batch_num_tokens"] = float(batch_num_tokens)
    if loss is not None:  # where the vendor's verl_grpo loss reads its settings; ours reads processing.config
        policy = loss.wire_body()
        meta["policy_loss_config"] = {"loss_mode": verl.loss_mode}  # the one key the vendor's loss reads there
        meta["actor_config"] = {
            "ppo_mini_batch_size": verl.ppo_mini_batch_size,
            "ppo_epochs": verl.ppo_epochs,
            "rollout_n": verl.rollout_n,
            **{k: policy[k] for k in VENDOR_ACTOR_KEYS},
        }
    return meta
