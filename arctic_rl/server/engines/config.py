"""Job configuration of the engines: ``ds_worker_config`` knobs and the DeepSpeed config.

Two pure functions of a :class:`~arctic_rl.protocol.JobConfig`'s dicts:

* :func:`parse_worker_knobs` validates the ``ds_worker_config`` keys the reference server reads
  (a wrong type is a 400 naming ``ds_worker_config.<key>``); keys it knows but does not use, and
  unknown keys, are returned so the caller can log them once;
* :func:`build_training_ds_config` turns the client's ``ds_config`` into one DeepSpeed accepts on
  this device: AdamW through ``torch.optim`` (``torch_adam``: no JIT op build), bf16 only where
  the device supports it, ``managed_gradient_accumulation=false`` (the server's ``/step`` is the
  accumulation boundary; each ``/forward-backward`` is split into ``gradient_accumulation_steps``
  micro-batches, as at the vendor), batch sizes made consistent, ZeRO stage 0-3 with the memory
  savers DeepSpeed runs on one process without building an op (``offload_optimizer`` and, at stage 3,
  ``offload_param`` to ``cpu``: the optimizer then steps with ``torch.optim.AdamW`` on the host), and an
  allow-listed scheduler. Every rewrite is reported as a note; what the server cannot honour is a 400
  naming the key (NVMe offload, offload at stage 0, parameter offload below stage 3);
* :func:`build_inference_ds_config` does the same for the forward-only log_prob job: at ZeRO stage 3 a
  DeepSpeed config without an optimizer (DeepSpeed then partitions the parameters and, with
  ``offload_param``, keeps them on the host), below it ``None`` (a plain copy of the model: stages 1-2
  partition optimizer state and gradients, which this job does not hold).

What is not here: building the engine (:mod:`arctic_rl.server.engines.training`).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from arctic_rl.protocol import DsWorkerConfig
from arctic_rl.server.errors import BadRequest, from_validation_error

__all__ = [
    "SCHEDULERS",
    "ZERO_STAGES",
    "WorkerKnobs",
    "build_inference_ds_config",
    "build_training_ds_config",
    "parse_worker_knobs",
]

#: DeepSpeed schedulers the reference server builds (``constant``/absent: no scheduler)
SCHEDULERS = ("WarmupLR", "WarmupCosineLR", "WarmupDecayLR", "constant")
ZERO_STAGES = (0, 1, 2, 3)
#: where ``zero_optimization.offload_optimizer`` / ``offload_param`` may put their tensors (NVMe needs an op build)
OFFLOAD_DEVICES = ("cpu", "none")
_OPTIMIZERS = ("adamw", "adam")
_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay")
#: top-level ds_config keys passed to DeepSpeed (after the rewrites below); others are dropped
_KEPT_KEYS = (
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu",
    "bf16",
    "fp16",
    "zero_optimization",
    "data_types",
    "communication_data_type",
    "seed",
    "prescale_gradients",
    "gradient_predivide_factor",
)
#: zero_optimization keys kept (offload_* are checked by :func:`_offload`)
_ZERO_KEYS = (
    "stage", "reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients", "reduce_scatter", "sub_group_size",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
)  # fmt: skip
_OFFLOAD_KEYS = ("device", "pin_memory")
#: ds_worker_config keys a client may send that this server accepts but does not act on
_KNOWN_UNUSED = (
    "use_unpad",
    "use_liger",
    "zorro_train_load_balancer",
    "logits_compute_from_fp32_inputs",
    "use_autocast",
    "world_size",
)


#: the ``ds_worker_config`` keys the reference server reads: the protocol's model (one definition)
WorkerKnobs = DsWorkerConfig


def parse_worker_knobs(raw: WorkerKnobs | dict[str, Any] | None) -> tuple[WorkerKnobs, list[str], list[str]]:
    """``(knobs, known-but-unused keys, unknown keys)``; 400 on a wrong type (a ``JobConfig`` brings them
    parsed already)."""
    if isinstance(raw, WorkerKnobs):
        knobs, raw = raw, raw.model_dump(exclude_unset=True)
    else:
        raw = dict(raw or {})
        try:
            knobs = WorkerKnobs.model_validate(raw)
        except ValidationError as exc:
            raise from_validation_error(exc, prefix="ds_worker_config") from None
    unused = sorted(k for k in raw if k in _KNOWN_UNUSED)
    unknown = sorted(k for k in (knobs.model_extra or {}) if k not in _KNOWN_UNUSED)
    return knobs, unused, unknown


def _num(cfg: dict, key: str, field: str, *, minimum: float | None = None, integer: bool = False) -> Any:
    value = cfg[key]
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (minimum is not None and value < minimum):
        kind = "an integer" if integer else "a number"
        bound = f" >= {minimum}" if minimum is not None else ""
        raise BadRequest(f"{field}: expected {kind}{bound}", field=field, received=value)
    return value


def _optimizer(cfg: dict, notes: list[str]) -> dict:
    opt = cfg.get("optimizer") or {}
    if not isinstance(opt, dict):
        raise BadRequest("ds_config.optimizer: expected an object", field="ds_config.optimizer", received=opt)
    kind = str(opt.get("type", "AdamW"))
    if kind.lower() not in _OPTIMIZERS:
        raise BadRequest(
            "ds_config.optimizer.type: the reference server trains with AdamW",
            field="ds_config.optimizer.type",
            allowed=["AdamW", "Adam"],
            received=kind,
        )
    given = opt.get("params") or {}
    if not isinstance(given, dict):
        raise BadRequest(
            "ds_config.optimizer.params: expected an object", field="ds_config.optimizer.params", received=given
        )
    params: dict[str, Any] = {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    for key in _ADAM_PARAMS:
        if key in given:
            params[key] = given[key]
    for key in ("lr", "eps", "weight_decay"):
        _num(params, key, f"ds_config.optimizer.params.{key}", minimum=0)
    betas = params["betas"]
    if not (
        isinstance(betas, (list, tuple))
        and len(betas) == 2
        and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)
    ):
        raise BadRequest(
            "ds_config.optimizer.params.betas: expected two numbers in [0, 1)",
            field="ds_config.optimizer.params.betas",
            received=betas,
        )
    params["betas"] = [float(b) for b in betas]
    params["torch_adam"] = True  # torch.optim.AdamW: never JIT-build FusedAdam / cpu_adam
    dropped = sorted(set(given) - set(_ADAM_PARAMS) - {"torch_adam", "adam_w_mode"})
    if dropped:
        notes.append(f"ds_config.optimizer.params: ignored {dropped}")
    if kind.lower() == "adam":
        notes.append("ds_config.optimizer.type 'Adam' is built as AdamW (decoupled weight decay)")
    return {"type": "AdamW", "params": params}


def _scheduler(cfg: dict) -> dict | None:
    sched = cfg.get("scheduler")
    if sched is None:
        return None
    if not isinstance(sched, dict) or sched.get("type") not in SCHEDULERS:
        raise BadRequest(
            "ds_config.scheduler.type: unsupported scheduler",
            field="ds_config.scheduler.type",
            allowed=list(SCHEDULERS),
            received=sched.get("type") if isinstance(sched, dict) else sched,
        )
    if sched["type"] == "constant":
        return None
    params = sched.get("params") or {}
    if not isinstance(params, dict):
        raise BadRequest(
            "ds_config.scheduler.params: expected an object", field="ds_config.scheduler.params", received=params
        )
    return {"type": sched["type"], "params": dict(params)}


def _offload(zero: dict, key: str, stage: int, min_stage: int) -> dict | None:
    """``zero_optimization.<key>`` as DeepSpeed takes it, ``None`` when absent or ``device: none``; a 400 for
    what this server cannot run (NVMe, a stage below ``min_stage``)."""
    section = zero.get(key)
    if section is None:
        return None
    field = f"ds_config.zero_optimization.{key}"
    if not isinstance(section, dict):
        raise BadRequest(f"{field}: expected an object such as {{'device': 'cpu'}}", field=field, received=section)
    device = section.get("device", "none")
    if device not in OFFLOAD_DEVICES:
        raise BadRequest(f"{field}.device: the reference server offloads to host memory only (NVMe offload needs "
                         "DeepSpeed's async-io op)", field=f"{field}.device", allowed=list(OFFLOAD_DEVICES),
                         received=device)
    if device == "none":
        return None
    if stage < min_stage:
        raise BadRequest(f"{field}: DeepSpeed offloads this only at ZeRO stage {min_stage} or above",
                         field="ds_config.zero_optimization.stage", allowed=list(range(min_stage, 4)), received=stage)
    return {k: section[k] for k in _OFFLOAD_KEYS if k in section}


def _zero_stage(src: Any) -> tuple[dict, int]:
    """``(ds_config.zero_optimization, its stage)``, a 400 naming the key for a wrong type or stage."""
    if not isinstance(src, dict):
        raise BadRequest("ds_config: expected an object", field="ds_config", received=type(src).__name__)
    zero = src.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise BadRequest(
            "ds_config.zero_optimization: expected an object", field="ds_config.zero_optimization", received=zero
        )
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES or isinstance(stage, bool):
        raise BadRequest(
            "ds_config.zero_optimization.stage: the reference server runs ZeRO stages 0-3",
            field="ds_config.zero_optimization.stage",
            allowed=list(ZERO_STAGES),
            received=stage,
        )
    return zero, stage


def build_inference_ds_config(
    ds_config: dict[str, Any] | None, *, bf16: bool
) -> tuple[dict[str, Any] | None, list[str]]:
    """The log_prob job's DeepSpeed config (``None``: a plain copy of the model) and notes on what was changed.

    ZeRO-3 partitions the parameters (``offload_param`` to ``cpu`` keeps the partitions on the host); NVMe
    offload and parameter offload below stage 3 are a 400, as for the training job. ``bf16`` is the dtype the
    job computes in (DeepSpeed must not cast the model to another)."""
    zero, stage = _zero_stage(copy.deepcopy(ds_config or {}))
    notes: list[str] = []
    if zero.get("offload_optimizer") is not None:
        notes.append("ds_config.zero_optimization.offload_optimizer: ignored (a log_prob job has no optimizer)")
    offload = _offload(zero, "offload_param", stage, 3)
    if stage < 3:
        if stage:
            notes.append(f"ds_config.zero_optimization.stage {stage}: the job holds a plain copy of the model "
                         "(stages 1-2 partition optimizer state and gradients, which a log_prob job does not hold)")
        return None, notes
    section = {k: zero[k] for k in _ZERO_KEYS if k in zero}
    section["stage"] = 3
    if offload is not None:
        section["offload_param"] = offload
    config = {
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "zero_optimization": section,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return config, notes


def build_training_ds_config(
    ds_config: dict[str, Any] | None, *, device: str, bf16_supported: bool
) -> tuple[dict[str, Any], list[str]]:
    """A DeepSpeed config for a training engine on ``device`` and the notes on what was changed."""
    src = copy.deepcopy(ds_config or {})
    if not isinstance(src, dict):
        raise BadRequest("ds_config: expected an object", field="ds_config", received=type(src).__name__)
    notes: list[str] = []
    dropped = sorted(k for k in src if k not in _KEPT_KEYS and k != "train_batch_size")
    if dropped:
        notes.append(f"ds_config: ignored keys {dropped}")
    out: dict[str, Any] = {k: src[k] for k in _KEPT_KEYS if k in src}

    out["optimizer"] = _optimizer(src, notes)
    sched = _scheduler(src)
    if sched is None:
        out.pop("scheduler", None)
    else:
        out["scheduler"] = sched

    out.setdefault("gradient_accumulation_steps", 1)
    gas = _num(out, "gradient_accumulation_steps", "ds_config.gradient_accumulation_steps", minimum=1, integer=True)
    out.setdefault("train_micro_batch_size_per_gpu", 1)
    micro = _num(
        out, "train_micro_batch_size_per_gpu", "ds_config.train_micro_batch_size_per_gpu", minimum=1, integer=True
    )
    if "train_batch_size" in src and src["train_batch_size"] != micro * gas:
        notes.append(
            f"ds_config.train_batch_size={src['train_batch_size']} replaced by {micro * gas} "
            "(rows per call are not fixed; each /forward-backward is split into gradient_accumulation_steps "
            "micro-batches)"
        )
    out["train_batch_size"] = micro * gas  # one process: micro * gas * world_size(1)
    out.setdefault("gradient_clipping", 1.0)
    _num(out, "gradient_clipping", "ds_config.gradient_clipping", minimum=0)
    out["managed_gradient_accumulation"] = False

    zero, stage = _zero_stage(src)
    ignored_zero = sorted(k for k in zero if k not in _ZERO_KEYS and k not in ("offload_optimizer", "offload_param"))
    if ignored_zero:
        notes.append(f"ds_config.zero_optimization: ignored {ignored_zero}")
    out["zero_optimization"] = {k: zero[k] for k in _ZERO_KEYS if k in zero}
    out["zero_optimization"]["stage"] = stage
    for key, min_stage in (("offload_optimizer", 1), ("offload_param", 3)):
        section = _offload(zero, key, stage, min_stage)
        if section is not None:
            out["zero_optimization"][key] = section
    out["zero_optimization"]["overlap_comm"] = False  # unmanaged accumulation allows it only with stage 2

    bf16 = bool((src.get("bf16") or {}).get("enabled")) if isinstance(src.get("bf16"), dict) else False
    fp16 = bool((src.get("fp16") or {}).get("enabled")) if isinstance(src.get("fp16"), dict) else False
    if device == "cpu" or not bf16_supported:
        if bf16 or fp16:
            notes.append(f"ds_config: bf16/fp16 requested but {device} runs fp32 here")
        out["bf16"] = {"enabled": False}
        out["fp16"] = {"enabled": False}
    else:
        if fp16:
            notes.append("ds_config.fp16: replaced by bf16 (no loss scaling in the reference server)")
        out["bf16"] = {"enabled": bf16 or fp16}
        out["fp16"] = {"enabled": False}
    if out["bf16"]["enabled"]:
        if stage == 0:
            # One process: ZeRO-1 partitions nothing, it only swaps DeepSpeed's per-parameter bf16 optimizer
            # (FP16_UnfusedOptimizer) for BF16_Optimizer on flat buffers -- same fp32 master weights, plus
            # fp32 gradient accumulation, and /step 3x faster on an H200 (benchmarks/RESULTS.md).
            out["zero_optimization"]["stage"] = 1
            notes.append(
                "ds_config.zero_optimization.stage: 0 runs as 1 with bf16 (one process: nothing is partitioned; "
                "DeepSpeed's flat BF16_Optimizer with fp32 gradient accumulation instead of its per-parameter one)"
            )
        out.setdefault("data_types", {"grad_accum_dtype": "fp32"})
    else:
        out.pop("data_types", None)
        out.pop("communication_data_type", None)
    out["steps_per_print"] = 2**31 - 1
    out["wall_clock_breakdown"] = False
    # DeepSpeed's save_checkpoint checks that every rank names the same tag with two all-reduces of a CUDA tensor
    # (default "Warn"), its only collective besides barriers (those run on gloo: common.process_group_backend).
    # The server's group has one rank, so the check compares the tag with itself, and on a GPU its first run makes
    # the group's NCCL communicator: on an H100 the first save raised the device's use by 1,160 MiB, 388 MiB of it
    # for the rest of the process (benchmarks/RESULTS.md §2u). A client's "checkpoint" section is not kept above.
    out["checkpoint"] = {"tag_validation": "Ignore"}
    return out, notes
