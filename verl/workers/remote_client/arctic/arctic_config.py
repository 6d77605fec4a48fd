"""Typed configuration of the Arctic remote backend: ``config.remote_backend`` as dataclasses.

``ArcticConfig`` mirrors ``verl/trainer/config/remote_backend/arctic.yaml`` key for key (a test
loads the shipped yaml and checks both directions). :meth:`ArcticConfig.from_dict` is strict: an
unknown key, a value of the wrong type or out of range raises
:class:`~verl.remote_backend.errors.RemoteBackendConfigError` naming the dotted key
(``remote_backend.train.logits.optimization``), the allowed values and the value received.

What is not here: the verl fields the adapter reads (:mod:`..common.verl_settings`) and what is built from
both (:mod:`.builders`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.strict_config import build as _build
from verl.remote_backend.strict_config import require as _require
from verl.remote_backend.strict_config import to_plain as _to_plain
from verl.remote_backend.workers.batching import RolloutBatching

__all__ = [
    "ArcticConfig",
    "DeepSpeedSettings",
    "LocalServerConfig",
    "LogProbJobConfig",
    "LogitsConfig",
    "MfuConfig",
    "RecoveryConfig",
    "RetryConfig",
    "RolloutJobConfig",
    "ServerConfig",
    "TimeoutsConfig",
    "TrainJobConfig",
    "WeightSyncConfig",
    "ZorroTrainConfig",
]

ROOT = "remote_backend"
ZERO_STAGES = (0, 1, 2, 3)
#: ``train.attn_implementation``; ``auto`` resolves to verl's override or flash_attention_2 (``builders``)
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
#: ``local_server.in_flight_on_weight_load``, ``local_server.warm_up``, ``local_server.training_stream``,
#: ``local_server.release_at_sync`` and ``local_server.vllm_engine_process``: the server's flags of those names
IN_FLIGHT_POLICIES = ("wait", "restart")
WARM_UP_MODES = ("auto", "on", "off")
TRAINING_STREAM_MODES = ("on", "off")
RELEASE_AT_SYNC_MODES = ("on", "off")
VLLM_ENGINE_PROCESS_MODES = ("same", "own")


@dataclass(frozen=True)
class LocalServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    sampler: Literal["auto", "vllm", "transformers"] = "auto"
    threads: int = 1
    checkpoint_root: str | None = None
    log_dir: str | None = None
    startup_timeout_s: float = 180.0
    zorro_min_saving: float | None = None
    zorro_trials: int | None = None
    in_flight_on_weight_load: str | None = None
    warm_up: str | None = None
    training_stream: str | None = None
    release_at_sync: str | None = None
    vllm_engine_process: str | None = None

    def _validate(self, p: str) -> None:
        _require(0 <= self.port <= 65535, f"{p}.port", "not a TCP port", "0 (a free port) .. 65535", self.port)
        if self.zorro_min_saving is not None:
            _require(0.0 <= self.zorro_min_saving <= 1.0, f"{p}.zorro_min_saving", "not a share",
                     "0 .. 1 (0 = ZoRRO whenever asked) or null (the server's default, 0.55)", self.zorro_min_saving)
        if self.zorro_trials is not None:
            _require(not isinstance(self.zorro_trials, bool) and isinstance(self.zorro_trials, int)
                     and self.zorro_trials >= 0, f"{p}.zorro_trials", "not a count",
                     "an integer >= 0 (0 = no timing) or null (the server's default, 2)", self.zorro_trials)
        if self.in_flight_on_weight_load is not None:
            _require(self.in_flight_on_weight_load in IN_FLIGHT_POLICIES, f"{p}.in_flight_on_weight_load",
                     "not a policy", f"one of {list(IN_FLIGHT_POLICIES)} or null (the server's default, wait)",
                     self.in_flight_on_weight_load)
        if self.warm_up is not None:
            _require(self.warm_up in WARM_UP_MODES, f"{p}.warm_up", "not a mode",
                     f"one of {list(WARM_UP_MODES)} or null (the server's default, auto)", self.warm_up)
        if self.training_stream is not None:
            _require(self.training_stream in TRAINING_STREAM_MODES, f"{p}.training_stream", "not a mode",
                     f"one of {list(TRAINING_STREAM_MODES)} or null (the server's default, off)",
                     self.training_stream)
        if self.release_at_sync is not None:
            _require(self.release_at_sync in RELEASE_AT_SYNC_MODES, f"{p}.release_at_sync", "not a mode",
                     f"one of {list(RELEASE_AT_SYNC_MODES)} or null (the server's default, on)",
                     self.release_at_sync)
        if self.vllm_engine_process is not None:
            _require(self.vllm_engine_process in VLLM_ENGINE_PROCESS_MODES, f"{p}.vllm_engine_process", "not a mode",
                     f"one of {list(VLLM_ENGINE_PROCESS_MODES)} or null (the server's default, same)",
                     self.vllm_engine_process)
        _require(self.threads >= 1, f"{p}.threads", "must be positive", ">= 1", self.threads)
        _require(self.startup_timeout_s > 0, f"{p}.startup_timeout_s", "must be positive", "> 0", self.startup_timeout_s)


@dataclass(frozen=True)
class ServerConfig:
    url: str | None = None
    token: str | None = None
    protocol: Literal["auto", "v1", "v2"] = "auto"
    pool_size: int = 64
    reclaim_idle_jobs_s: float | None = None
    concurrent_jobs: bool | None = None
    local: LocalServerConfig = field(default_factory=LocalServerConfig)

    def _validate(self, p: str) -> None:
        if self.url is not None:
            ok = self.url.startswith(("http://", "https://")) and len(self.url.split("://", 1)[1].strip("/")) > 0
            _require(ok, f"{p}.url", "not an http(s) URL", "http://host:port, https://host[:port] or null", self.url)
        _require(self.pool_size >= 1, f"{p}.pool_size", "must be positive", ">= 1", self.pool_size)
        if self.reclaim_idle_jobs_s is not None:
            _require(self.reclaim_idle_jobs_s > 0, f"{p}.reclaim_idle_jobs_s", "must be positive",
                     "> 0 seconds or null", self.reclaim_idle_jobs_s)

    def __repr__(self) -> str:  # never print the token
        token = None if self.token is None else "***"
        return (
            f"ServerConfig(url={self.url!r}, token={token!r}, protocol={self.protocol!r}, "
            f"pool_size={self.pool_size!r}, reclaim_idle_jobs_s={self.reclaim_idle_jobs_s!r}, "
            f"concurrent_jobs={self.concurrent_jobs!r}, local={self.local!r})"
        )


@dataclass(frozen=True)
class TimeoutsConfig:
    connect_s: float = 10.0
    initialize_s: float = 600.0
    forward_backward_s: float = 600.0
    forward_s: float = 600.0
    step_s: float = 300.0
    generate_s: float = 600.0
    weight_sync_s: float = 600.0
    save_s: float = 600.0
    default_s: float = 60.0

    def _validate(self, p: str) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _require(value > 0, f"{p}.{f.name}", "must be positive", "> 0 seconds", value)


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    server_idempotency: Literal["auto", "off"] = "auto"

    def _validate(self, p: str) -> None:
        _require(self.max_attempts >= 1, f"{p}.max_attempts", "must be positive", ">= 1", self.max_attempts)
        _require(self.backoff_initial_s >= 0, f"{p}.backoff_initial_s", "negative", ">= 0", self.backoff_initial_s)
        _require(
            self.backoff_max_s >= self.backoff_initial_s,
            f"{p}.backoff_max_s",
            "smaller than backoff_initial_s",
            f">= {self.backoff_initial_s}",
            self.backoff_max_s,
        )


@dataclass(frozen=True)
class RecoveryConfig:
    enable: bool = True
    checkpoint_every_n_steps: int = 10
    checkpoint_path: str | None = None
    checkpoint_keep: int = 2
    journal_max_mb: float = 2048.0
    wait_s: float = 900.0
    watch_interval_s: float = 5.0

    def _validate(self, p: str) -> None:
        _require(self.checkpoint_every_n_steps >= 0, f"{p}.checkpoint_every_n_steps", "negative",
                 ">= 0 (0 = only verl's own checkpoints)", self.checkpoint_every_n_steps)
        _require(self.checkpoint_keep >= 1, f"{p}.checkpoint_keep", "must be positive", ">= 1", self.checkpoint_keep)
        _require(self.journal_max_mb >= 0, f"{p}.journal_max_mb", "negative", ">= 0 (0 = no journal)",
                 self.journal_max_mb)
        _require(self.wait_s > 0, f"{p}.wait_s", "must be positive", "> 0 seconds", self.wait_s)
        _require(self.watch_interval_s >= 0, f"{p}.watch_interval_s", "negative", ">= 0 (0 = no watcher)",
                 self.watch_interval_s)


@dataclass(frozen=True)
class ZorroTrainConfig:
    enable: bool = False
    load_balancer: Any = None


@dataclass(frozen=True)
class LogitsConfig:
    optimization: Literal["none", "memory", "compute"] = "none"
    peak_mem_size_in_gib: int = 4
    compute_in_fp32: bool = False

    def _validate(self, p: str) -> None:
        _require(self.peak_mem_size_in_gib > 0, f"{p}.peak_mem_size_in_gib", "must be positive", "> 0",
                 self.peak_mem_size_in_gib)


@dataclass(frozen=True)
class DeepSpeedSettings:
    zero_stage: int = 1
    bf16: bool = True
    offload_optimizer: bool = False
    offload_param: bool = False
    extra: dict = field(default_factory=dict)

    def _validate(self, p: str) -> None:
        _require(self.zero_stage in ZERO_STAGES, f"{p}.zero_stage", "unknown ZeRO stage", list(ZERO_STAGES),
                 self.zero_stage)
        if self.offload_optimizer:
            _require(self.zero_stage >= 1, f"{p}.offload_optimizer", "needs ZeRO stage >= 1",
                     "false, or zero_stage 1/2/3", self.offload_optimizer)
        if self.bf16 and self.zero_stage == 0:
            accum = (self.extra.get("data_types") or {}).get("grad_accum_dtype", "fp32") \
                if isinstance(self.extra.get("data_types"), Mapping) else "fp32"
            _require(accum != "fp32", f"{p}.zero_stage", "bf16 training accumulates gradients in fp32 (the Arctic "
                     "server's default), which DeepSpeed refuses at ZeRO stage 0", "1, 2 or 3 (or bf16: false)",
                     self.zero_stage)
        if self.offload_param:
            _require(self.zero_stage == 3, f"{p}.offload_param", "needs ZeRO stage 3", "false, or zero_stage 3",
                     self.offload_param)


@dataclass(frozen=True)
class TrainJobConfig:
    micro_batch_size: int | None = None
    num_devices: int = 1
    checkpoint_path: str | None = None
    seed: int | None = None
    full_determinism: bool = False
    attn_implementation: str = "auto"
    #: activation checkpointing of the server's model; None = verl's actor_rollout_ref.model.enable_gradient_checkpointing
    gradient_checkpointing: bool | None = None
    zorro_train: ZorroTrainConfig = field(default_factory=ZorroTrainConfig)
    logits: LogitsConfig = field(default_factory=LogitsConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)

    def _validate(self, p: str) -> None:
        if self.micro_batch_size is not None:
            _require(self.micro_batch_size >= 1, f"{p}.micro_batch_size", "must be positive", ">= 1 or null",
                     self.micro_batch_size)
        _require(self.num_devices >= 1, f"{p}.num_devices", "must be positive", ">= 1", self.num_devices)
        _require(self.attn_implementation in ATTN_IMPLEMENTATIONS, f"{p}.attn_implementation",
                 "unknown attention implementation", list(ATTN_IMPLEMENTATIONS), self.attn_implementation)
        if self.logits.optimization == "memory":
            _require(self.zorro_train.enable, f"{p}.logits.optimization", "`memory` exists only on the ZoRRO path",
                     "none or compute (or enable train.zorro_train.enable)", self.logits.optimization)


@dataclass(frozen=True)
class LogProbJobConfig:
    num_devices: int = 1

    def _validate(self, p: str) -> None:
        _require(self.num_devices >= 1, f"{p}.num_devices", "must be positive", ">= 1", self.num_devices)


@dataclass(frozen=True)
class WeightSyncConfig:
    cuda_ipc: bool = False
    low_memory: bool = False
    sync_log_prob: bool = False

    def _validate(self, p: str) -> None:
        if self.low_memory:
            _require(self.cuda_ipc, f"{p}.low_memory", "applies to CUDA IPC sync only", "false, or cuda_ipc: true",
                     self.low_memory)


@dataclass(frozen=True)
class RolloutJobConfig(RolloutBatching):
    """The sampling job (devices, vLLM options) and the shared rollout batching options."""

    num_devices: int = 1
    vllm_config: dict = field(default_factory=dict)

    def _validate(self, p: str) -> None:
        super()._validate(p)
        _require(self.num_devices >= 1, f"{p}.num_devices", "must be positive", ">= 1", self.num_devices)


@dataclass(frozen=True)
class MfuConfig:
    peak_tflops_per_device: float | None = None

    def _validate(self, p: str) -> None:
        if self.peak_tflops_per_device is not None:
            _require(self.peak_tflops_per_device > 0, f"{p}.peak_tflops_per_device", "must be positive",
                     "> 0 or null", self.peak_tflops_per_device)


def arctic_backend_names() -> list[str]:
    """The registered backend names whose adapter takes this config (``arctic`` and plug-ins built on it)."""
    from verl.remote_backend.base import RemoteBackendRegistry
    from verl.remote_backend.context import ensure_backends_registered

    ensure_backends_registered()
    return [n for n in RemoteBackendRegistry.list()
            if getattr(RemoteBackendRegistry.get(n), "config_class", None) is ArcticConfig]


@dataclass(frozen=True)
class ArcticConfig:
    """``config.remote_backend`` for ``remote_backend=arctic`` (see arctic.yaml for each key)."""

    name: str = "arctic"
    server: ServerConfig = field(default_factory=ServerConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    train: TrainJobConfig = field(default_factory=TrainJobConfig)
    log_prob: LogProbJobConfig = field(default_factory=LogProbJobConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    rollout: RolloutJobConfig = field(default_factory=RolloutJobConfig)
    mfu: MfuConfig = field(default_factory=MfuConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def _validate(self, p: str) -> None:
        if self.name != "arctic":  # a plug-in may register this adapter (or a subclass) under a name of its own
            names = arctic_backend_names()
            _require(self.name in names, f"{p}.name", "not a backend built on the Arctic adapter", names, self.name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, prefix: str = ROOT) -> ArcticConfig:
        """Build and validate from a plain mapping (``OmegaConf.to_container(cfg, resolve=True)``)."""
        return _build(cls, {} if data is None else data, prefix)

    @classmethod
    def from_main_config(cls, main_config: Any) -> ArcticConfig:
        """Read ``main_config.remote_backend`` (a DictConfig or a mapping)."""
        section = main_config.get("remote_backend") if hasattr(main_config, "get") else None
        if section is None:
            raise RemoteBackendConfigError(ROOT, "missing: select the backend with `remote_backend=arctic`",
                                           received=None)
        return cls.from_dict(_to_plain(section))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
