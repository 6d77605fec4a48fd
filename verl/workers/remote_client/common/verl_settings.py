"""The verl configuration fields a remote adapter reads, gathered in one typed record (both vendors use it).

An adapter reads its own ``config.remote_backend`` (Arctic: :class:`..arctic.arctic_config.ArcticConfig`,
Tinker: :class:`..tinker.config.TinkerConfig`) plus a handful of standard verl fields -- ``data.*``,
``trainer.*``, ``actor_rollout_ref.{model,actor,rollout}.*``. :func:`VerlSettings.from_main_config`
collects those, with verl 0.9.1's defaults and field aliases (``optim.clip_grad`` / ``actor.grad_clip``,
``optim.warmup_style``), so Arctic's builders (:mod:`..arctic.builders`) and Tinker's run plan
(:mod:`..tinker.options`) are pure functions of small records and can be tested with golden dicts.

What is not here: validation of batch shapes (a vendor's layout module) or of any vendor's yaml.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.strict_config import select
from verl.remote_backend.workers.sampler_sleep import sleep_settings

__all__ = ["KL_TYPE_ALIASES", "ROLLOUT_ENGINE_KEYS", "OptimSettings", "VerlSettings"]

#: verl's ``kl_loss_type`` spellings -> the protocol's ``KL_TYPES``
KL_TYPE_ALIASES = {"kl": "kl", "k1": "kl", "abs": "abs", "mse": "mse", "k2": "mse", "low_var_kl": "low_var_kl",
                   "k3": "low_var_kl"}


#: ``actor_rollout_ref.rollout`` keys that stock verl 0.9.1 passes to its vLLM engine under the same name
ROLLOUT_ENGINE_KEYS = ("gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                       "enforce_eager", "enable_chunked_prefill", "enable_prefix_caching", "quantization")


def _rollout_engine(cfg: Any, rollout: str) -> dict[str, Any]:
    """The sampling engine's options as stock verl builds them from ``rollout.*``: each key of
    :data:`ROLLOUT_ENGINE_KEYS` that is set (null ones are left to the engine), then
    ``rollout.engine_kwargs.vllm`` on top, as verl applies it last too."""
    engine = {key: value for key in ROLLOUT_ENGINE_KEYS if (value := select(cfg, f"{rollout}.{key}", None)) is not None}
    extra = select(cfg, f"{rollout}.engine_kwargs.vllm", None)
    if extra is not None and not isinstance(extra, dict):
        raise RemoteBackendConfigError(f"{rollout}.engine_kwargs.vllm", "expected a mapping of vLLM engine arguments",
                                       allowed="a mapping", received=extra)
    engine.update({key: value for key, value in (extra or {}).items() if value is not None})
    return engine


def _clip_grad(cfg: Any, actor: str) -> float:
    """The clipping norm. verl 0.9.1 has it twice: ``optim.clip_grad`` (engine workers; alias
    ``optim.grad_clip``) and ``actor.grad_clip`` (legacy dp actor), both 1.0 by default. Recipes set
    either one, so the one that differs from the default wins; two different overrides are an error."""
    keys = (f"{actor}.optim.grad_clip", f"{actor}.optim.clip_grad", f"{actor}.grad_clip")
    found = {k: float(v) for k in keys if (v := select(cfg, k, None)) is not None}
    overrides = {k: v for k, v in found.items() if v != 1.0}
    if len(set(overrides.values())) > 1:
        raise RemoteBackendConfigError(
            keys[2], "conflicting gradient clipping norms", allowed="one value", received=overrides
        )
    if overrides:
        return next(iter(overrides.values()))
    return 1.0


def _mapping_or_none(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # verl's RolloutCorrectionConfig itself
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, dict):
        raise RemoteBackendConfigError("actor_rollout_ref.actor.policy_loss.rollout_correction", "expected a mapping "
                                       "of verl's RolloutCorrectionConfig fields", allowed="a mapping", received=value)
    return dict(value)


@dataclass(frozen=True)
class OptimSettings:
    """``actor_rollout_ref.actor.optim`` (verl's ``FSDPOptimizerConfig``) plus the clipping norm."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    #: verl's optim config has no eps; torch AdamW's default
    eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int = -1
    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


@dataclass(frozen=True)
class VerlSettings:
    """What the adapter needs from verl's main config. Field names follow verl's."""

    model_path: str
    tokenizer_path: str
    rollout_n: int = 1
    rollout_temperature: float = 1.0
    rollout_seed: int = 42
    rollout_full_determinism: bool = False
    #: the rollout server sleeps the sampler after each generation phase (``rollout.free_cache_engine``, sync mode)
    rollout_sleeps_between_phases: bool = False
    #: the sampling engine's options from ``rollout.*`` and ``rollout.engine_kwargs.vllm`` (:func:`_rollout_engine`)
    rollout_engine: dict[str, Any] = field(default_factory=dict)
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1
    ppo_mini_batch_size: int = 1
    ppo_micro_batch_size_per_gpu: int | None = None
    ppo_epochs: int = 1
    ppo_max_token_len_per_gpu: int = 16384
    shuffle: bool = False
    data_loader_seed: int = 42
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    loss_mode: str = "vanilla"
    #: ``actor.policy_loss.rollout_correction`` as the config holds it (``None``: absent, verl's dataclass
    #: defaults apply; a mapping: what was set, verl's bypass loss ``.get``-defaults the rest)
    rollout_correction: dict[str, Any] | None = None
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    use_liger: bool = False
    enable_gradient_checkpointing: bool = False
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    default_local_dir: str | None = None
    trainer_total_training_steps: int | None = None
    optim: OptimSettings = field(default_factory=OptimSettings)

    @classmethod
    def from_main_config(cls, cfg: Any) -> VerlSettings:
        arr = "actor_rollout_ref"
        actor = f"{arr}.actor"
        model_path = select(cfg, f"{arr}.model.path")
        if not model_path:
            raise RemoteBackendConfigError(f"{arr}.model.path", "missing: the model the server loads",
                                           allowed="an HF model id or a local directory", received=model_path)
        optim = OptimSettings(
            lr=float(select(cfg, f"{actor}.optim.lr", 1e-6)),
            betas=tuple(float(b) for b in select(cfg, f"{actor}.optim.betas", (0.9, 0.999))),
            weight_decay=float(select(cfg, f"{actor}.optim.weight_decay", 0.01)),
            eps=float(select(cfg, f"{actor}.optim.eps", 1e-8)),
            clip_grad=_clip_grad(cfg, actor),
            lr_warmup_steps=int(select(cfg, f"{actor}.optim.lr_warmup_steps", -1)),
            lr_warmup_steps_ratio=float(select(cfg, f"{actor}.optim.lr_warmup_steps_ratio", 0.0)),
            total_training_steps=int(select(cfg, f"{actor}.optim.total_training_steps", -1)),
            lr_scheduler_type=str(
                select(cfg, f"{actor}.optim.warmup_style", None)
                or select(cfg, f"{actor}.optim.lr_scheduler_type", "constant")
            ),
            min_lr_ratio=float(select(cfg, f"{actor}.optim.min_lr_ratio", 0.0)),
            num_cycles=float(select(cfg, f"{actor}.optim.num_cycles", 0.5)),
        )
        override = select(cfg, f"{arr}.model.override_config", {}) or {}
        total_steps = select(cfg, "trainer.total_training_steps", None)
        return cls(
            model_path=str(model_path),
            tokenizer_path=str(select(cfg, f"{arr}.model.tokenizer_path", None) or model_path),
            rollout_n=int(select(cfg, f"{arr}.rollout.n", 1)),
            rollout_temperature=float(select(cfg, f"{arr}.rollout.temperature", 1.0)),
            rollout_seed=int(select(cfg, f"{arr}.rollout.seed", 42) or 0),
            rollout_full_determinism=bool(select(cfg, f"{arr}.rollout.full_determinism", False)),
            rollout_sleeps_between_phases=sleep_settings(cfg)[0],
            rollout_engine=_rollout_engine(cfg, f"{arr}.rollout"),
            max_prompt_length=int(select(cfg, "data.max_prompt_length", 512)),
            max_response_length=int(select(cfg, "data.max_response_length", 512)),
            train_batch_size=int(select(cfg, "data.train_batch_size", 1)),
            ppo_mini_batch_size=int(select(cfg, f"{actor}.ppo_mini_batch_size", 1)),
            ppo_micro_batch_size_per_gpu=select(cfg, f"{actor}.ppo_micro_batch_size_per_gpu", None),
            ppo_epochs=int(select(cfg, f"{actor}.ppo_epochs", 1)),
            ppo_max_token_len_per_gpu=int(select(cfg, f"{actor}.ppo_max_token_len_per_gpu", 16384)),
            shuffle=bool(select(cfg, f"{actor}.shuffle", False)),
            data_loader_seed=int(select(cfg, f"{actor}.data_loader_seed", 42)),
            clip_ratio=float(select(cfg, f"{actor}.clip_ratio", 0.2)),
            clip_ratio_low=select(cfg, f"{actor}.clip_ratio_low", None),
            clip_ratio_high=select(cfg, f"{actor}.clip_ratio_high", None),
            clip_ratio_c=select(cfg, f"{actor}.clip_ratio_c", 3.0),
            loss_agg_mode=str(select(cfg, f"{actor}.loss_agg_mode", "token-mean")),
            loss_scale_factor=select(cfg, f"{actor}.loss_scale_factor", None),
            loss_mode=str(select(cfg, f"{actor}.policy_loss.loss_mode", "vanilla")),
            rollout_correction=_mapping_or_none(select(cfg, f"{actor}.policy_loss.rollout_correction", None)),
            entropy_coeff=float(select(cfg, f"{actor}.entropy_coeff", 0.0)),
            calculate_entropy=bool(select(cfg, f"{actor}.calculate_entropy", False)),
            use_kl_loss=bool(select(cfg, f"{actor}.use_kl_loss", False)),
            kl_loss_coef=float(select(cfg, f"{actor}.kl_loss_coef", 0.0)),
            kl_loss_type=str(select(cfg, f"{actor}.kl_loss_type", "low_var_kl")),
            use_liger=bool(select(cfg, f"{arr}.model.use_liger", False)),
            enable_gradient_checkpointing=bool(select(cfg, f"{arr}.model.enable_gradient_checkpointing", False)),
            attn_implementation=override.get("attn_implementation") if isinstance(override, dict) else None,
            trust_remote_code=bool(select(cfg, f"{arr}.model.trust_remote_code", False)),
            default_local_dir=select(cfg, "trainer.default_local_dir", None),
            trainer_total_training_steps=None if total_steps is None else int(total_steps),
            optim=optim,
        )
