"""Which verl options the Tinker backend supports, emulates or refuses, checked at start-up.

:func:`plan_run` reads verl's main config plus :class:`~.config.TinkerConfig` into one
:class:`TinkerRun` record, or raises :class:`~verl.remote_backend.errors.RemoteBackendConfigError`
naming the verl key it cannot honour:

* **supported**: GRPO/RLOO/... advantages (computed by verl), ``ppo_epochs``, ``ppo_mini_batch_size``
  (one ``forward_backward`` + ``optim_step`` per mini-batch), ``shuffle``, ``clip_ratio`` /
  ``clip_ratio_low`` / ``clip_ratio_high`` (-> the ``ppo`` loss's clip thresholds), Adam
  ``lr``/``betas``/``weight_decay``/``clip_grad``, ``use_kl_in_reward`` (reference log-probs come
  from a base-model sampler), ``rollout.n``, top-p/top-k/seed/stop;
* **emulated**: ``loss_agg_mode`` (advantage scaling, see :mod:`.batch`), the learning-rate
  warm-up and constant/cosine schedule (computed here, one value per ``optim_step``),
  ``rollout_is_weights`` (multiplied into the advantages), the entropy verl logs (the sampled
  token's ``-log p``, a one-sample estimate);
* **refused**: ``model.lora_rank`` 0 (Tinker trains LoRA adapters), ``actor.use_kl_loss`` and
  ``actor.entropy_coeff`` != 0 (the built-in losses have no KL or entropy term),
  ``policy_loss.loss_mode`` other than ``vanilla``, a ``loss_agg_mode`` outside
  :data:`~.batch.LOSS_AGG_MODES`, ``rollout.temperature`` != 1 (Tinker's forward scores at
  temperature 1, so old log-probs would not match the sampler);
* **not applied, with a warning**: verl's dual-clip ``clip_ratio_c`` (the built-in ``ppo`` loss
  has no dual clip); verl's rollout engine keys (``rollout.gpu_memory_utilization``, ``max_num_seqs``,
  ``max_model_len``, ``engine_kwargs.vllm``, ...: :data:`~verl.workers.remote_client.common.verl_settings.ROLLOUT_ENGINE_KEYS`)
  set away from verl's own defaults -- they size the local vLLM engine stock verl would start, and Tinker's
  service samples on its own; except ``rollout.quantization``, which would change what is sampled: refused.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.strict_config import select
from verl.workers.remote_client.common.verl_settings import OptimSettings, VerlSettings
from verl.workers.remote_client.tinker.batch import LOSS_AGG_MODES
from verl.workers.remote_client.tinker.config import TinkerConfig

__all__ = ["TinkerRun", "learning_rate", "plan_run"]

logger = logging.getLogger(__name__)

_ACTOR = "actor_rollout_ref.actor"


@dataclass(frozen=True)
class TinkerRun:
    """Everything the adapter derives from verl's config and ``remote_backend.*``."""

    base_model: str
    lora_rank: int
    seed: int
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    loss_agg_mode: str
    loss_scale_factor: float | None
    mini_batch_rows: int
    epochs: int
    shuffle: bool
    data_seed: int
    optim: OptimSettings
    lr_schedule: str
    adam_eps: float
    max_response_length: int
    #: verl's actor_rollout_ref.model.path (the tokenizer and generation config verl uses)
    model_path: str = ""


def _refuse(ok: bool, key: str, message: str, allowed: object, received: object) -> None:
    if not ok:
        raise RemoteBackendConfigError(key, message, allowed=allowed, received=received)


@functools.lru_cache(maxsize=1)
def _verl_rollout_defaults() -> dict[str, Any]:
    """verl's own defaults of the rollout group (its packaged ``rollout/rollout.yaml``)."""
    from omegaconf import OmegaConf

    text = resources.files("verl.trainer.config").joinpath("rollout", "rollout.yaml").read_text()
    return dict(OmegaConf.to_container(OmegaConf.create(text), resolve=False))


def _check_engine_keys(engine: dict[str, Any]) -> None:
    """Refuse ``rollout.quantization``; warn once about the other engine keys set away from verl's defaults."""
    rollout = "actor_rollout_ref.rollout"
    _refuse(engine.get("quantization") is None, f"{rollout}.quantization", "Tinker samples with the service's own "
            "weights; a quantized sampler has no counterpart there", None, engine.get("quantization"))
    defaults = _verl_rollout_defaults()
    changed = {key: value for key, value in engine.items() if key in defaults and value != defaults[key]}
    changed.update({f"engine_kwargs.vllm.{key}": value for key, value in engine.items() if key not in defaults})
    if changed:
        logger.warning("%s: %s not applied: they size the local vLLM engine stock verl would start, and Tinker's "
                       "service samples on its own", rollout,
                       ", ".join(f"{key}={value!r}" for key, value in sorted(changed.items())))


def plan_run(main_config: object, tinker: TinkerConfig) -> TinkerRun:
    """Check verl's options against what Tinker can do; see the module docstring."""
    verl = VerlSettings.from_main_config(main_config)
    model_rank = int(select(main_config, "actor_rollout_ref.model.lora.rank", 0) or 0)  # verl's newer spelling
    if model_rank <= 0:
        model_rank = int(select(main_config, "actor_rollout_ref.model.lora_rank", 0) or 0)
    rank = tinker.train.lora_rank if tinker.train.lora_rank is not None else model_rank
    _refuse(rank > 0, "actor_rollout_ref.model.lora_rank", "Tinker trains LoRA adapters only: set a LoRA rank "
            "(or remote_backend.train.lora_rank)", "> 0", model_rank)
    if tinker.train.lora_rank is not None and model_rank > 0:
        _refuse(model_rank == tinker.train.lora_rank, "remote_backend.train.lora_rank",
                "disagrees with actor_rollout_ref.model.lora_rank", model_rank, tinker.train.lora_rank)
    _refuse(not verl.use_kl_loss, f"{_ACTOR}.use_kl_loss", "Tinker's built-in losses have no KL term; use "
            "algorithm.use_kl_in_reward=true for a KL penalty", False, verl.use_kl_loss)
    _refuse(verl.entropy_coeff == 0, f"{_ACTOR}.entropy_coeff", "Tinker's built-in losses have no entropy bonus",
            0.0, verl.entropy_coeff)
    loss_mode = str(select(main_config, f"{_ACTOR}.policy_loss.loss_mode", "vanilla") or "vanilla")
    _refuse(loss_mode == "vanilla", f"{_ACTOR}.policy_loss.loss_mode", "only verl's PPO clipped objective maps "
            "onto Tinker's built-in losses (verl's gspo and bypass_mode run on the Arctic reference server)", "vanilla",
            loss_mode)
    _refuse(verl.loss_agg_mode in LOSS_AGG_MODES, f"{_ACTOR}.loss_agg_mode", "not expressible with Tinker's "
            "summed losses", list(LOSS_AGG_MODES), verl.loss_agg_mode)
    _refuse(verl.rollout_temperature == 1.0, "actor_rollout_ref.rollout.temperature", "Tinker scores log-probs at "
            "temperature 1; another sampling temperature would make the old log-probs disagree with the sampler",
            1.0, verl.rollout_temperature)
    _check_engine_keys(verl.rollout_engine)
    low = verl.clip_ratio_low if verl.clip_ratio_low is not None else verl.clip_ratio
    high = verl.clip_ratio_high if verl.clip_ratio_high is not None else verl.clip_ratio
    _refuse(0 <= low < 1, f"{_ACTOR}.clip_ratio_low", "a PPO clip ratio", "0 <= value < 1", low)
    _refuse(high >= 0, f"{_ACTOR}.clip_ratio_high", "a PPO clip ratio", ">= 0", high)
    if tinker.train.loss_fn == "ppo":
        loss_fn_config: dict[str, float] | None = {"clip_low_threshold": 1.0 - low, "clip_high_threshold": 1.0 + high}
        if verl.clip_ratio_c is not None:
            logger.warning("%s.clip_ratio_c=%s (dual clip) is not applied: Tinker's ppo loss has no dual clip",
                           _ACTOR, verl.clip_ratio_c)
    else:
        loss_fn_config = None
    base_model = tinker.server.base_model or verl.model_path
    seed = tinker.train.seed if tinker.train.seed is not None else verl.data_loader_seed
    run = TinkerRun(
        base_model=str(base_model), lora_rank=int(rank), seed=int(seed), loss_fn=tinker.train.loss_fn,
        loss_fn_config=loss_fn_config, loss_agg_mode=verl.loss_agg_mode, loss_scale_factor=verl.loss_scale_factor,
        mini_batch_rows=int(verl.ppo_mini_batch_size) * int(verl.rollout_n), epochs=int(verl.ppo_epochs),
        shuffle=bool(verl.shuffle), data_seed=int(verl.data_loader_seed), optim=verl.optim,
        lr_schedule=tinker.train.lr_schedule, adam_eps=tinker.train.adam_eps,
        max_response_length=int(verl.max_response_length), model_path=str(verl.model_path),
    )
    learning_rate(run, 0)  # an unknown schedule fails now, not at the first update
    return run


def learning_rate(run: TinkerRun, step: int) -> float:
    """The learning rate of the optimizer steps of trainer step ``step`` (0-based), following
    verl's schedulers: linear warm-up from 0, then constant or cosine down to ``min_lr_ratio``."""
    o = run.optim
    if run.lr_schedule == "constant":
        return o.lr
    if o.lr_scheduler_type not in ("constant", "cosine"):
        raise RemoteBackendConfigError(f"{_ACTOR}.optim.lr_scheduler_type", "no such schedule in verl",
                                       allowed=["constant", "cosine"], received=o.lr_scheduler_type)
    total = max(int(o.total_training_steps), 1)
    warmup = o.lr_warmup_steps if o.lr_warmup_steps > 0 else int(o.lr_warmup_steps_ratio * total)
    if step < warmup:
        return o.lr * step / max(1, warmup)
    if o.lr_scheduler_type == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        factor = 0.5 * (1.0 + math.cos(math.pi * o.num_cycles * 2.0 * progress))
        return o.lr * max(0.0, factor * (1.0 - o.min_lr_ratio) + o.min_lr_ratio)
    return o.lr
