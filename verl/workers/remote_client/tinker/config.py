"""Typed configuration of the Tinker remote backend: ``config.remote_backend`` as dataclasses.

``TinkerConfig`` mirrors ``verl/trainer/config/remote_backend/tinker.yaml`` key for key (a test
loads the shipped yaml and checks both directions). :meth:`TinkerConfig.from_dict` is strict: an
unknown key, a value of the wrong type or out of range raises
:class:`~verl.remote_backend.errors.RemoteBackendConfigError` naming the dotted key
(``remote_backend.train.loss_fn``), the allowed values and the value received.

The API key is never configuration: it comes from the ``TINKER_API_KEY`` environment variable.
What is not here: the verl options the adapter supports or refuses (:mod:`.options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from verl.remote_backend.strict_config import build as _build
from verl.remote_backend.strict_config import require as _require
from verl.remote_backend.strict_config import to_plain as _to_plain
from verl.remote_backend.workers.batching import RolloutBatching

__all__ = [
    "API_KEY_ENV",
    "TinkerCheckpointConfig",
    "TinkerConfig",
    "TinkerRolloutConfig",
    "TinkerServerConfig",
    "TinkerTimeoutsConfig",
    "TinkerTrainConfig",
]

ROOT = "remote_backend"
#: environment variable the API key is read from (the SDK's own convention)
API_KEY_ENV = "TINKER_API_KEY"


@dataclass(frozen=True)
class TinkerServerConfig:
    url: str | None = None
    base_model: str | None = None

    def _validate(self, p: str) -> None:
        if self.url is not None:
            ok = self.url.startswith(("http://", "https://")) and len(self.url.split("://", 1)[1].strip("/")) > 0
            _require(ok, f"{p}.url", "not an http(s) URL", "http://host:port, https://host[:port] or null", self.url)
        if self.base_model is not None:
            _require(bool(self.base_model.strip()), f"{p}.base_model", "empty", "a model name or null",
                     self.base_model)


@dataclass(frozen=True)
class TinkerTrainConfig:
    lora_rank: int | None = None
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    loss_fn: Literal["ppo", "importance_sampling"] = "ppo"
    lr_schedule: Literal["verl", "constant"] = "verl"
    adam_eps: float = 1e-8

    def _validate(self, p: str) -> None:
        if self.lora_rank is not None:
            _require(self.lora_rank >= 1, f"{p}.lora_rank", "must be positive", ">= 1 or null", self.lora_rank)
        _require(self.train_mlp or self.train_attn or self.train_unembed, f"{p}.train_mlp",
                 "at least one of train_mlp, train_attn, train_unembed must be true", True, False)
        _require(self.adam_eps > 0, f"{p}.adam_eps", "must be positive", "> 0", self.adam_eps)


@dataclass(frozen=True)
class TinkerTimeoutsConfig:
    call_s: float = 600.0
    connect_s: float = 30.0

    def _validate(self, p: str) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _require(value > 0, f"{p}.{f.name}", "must be positive", "> 0 seconds", value)


@dataclass(frozen=True)
class TinkerRolloutConfig(RolloutBatching):
    """The shared batching options; Tinker's sampler takes concurrent calls, so 4 batches in flight."""

    max_in_flight: int = 4


@dataclass(frozen=True)
class TinkerCheckpointConfig:
    index_dir: str | None = None
    load_path: str | None = None

    def _validate(self, p: str) -> None:
        if self.load_path is not None:
            _require(self.load_path.startswith("tinker://"), f"{p}.load_path", "not a Tinker state path",
                     "tinker://<run>/weights/<name> or null", self.load_path)


@dataclass(frozen=True)
class TinkerConfig:
    name: Literal["tinker"] = "tinker"
    server: TinkerServerConfig = field(default_factory=TinkerServerConfig)
    train: TinkerTrainConfig = field(default_factory=TinkerTrainConfig)
    timeouts: TinkerTimeoutsConfig = field(default_factory=TinkerTimeoutsConfig)
    rollout: TinkerRolloutConfig = field(default_factory=TinkerRolloutConfig)
    checkpoint: TinkerCheckpointConfig = field(default_factory=TinkerCheckpointConfig)

    def _validate(self, p: str) -> None:
        return None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, prefix: str = ROOT) -> TinkerConfig:
        """Build and validate from a plain mapping (``None`` = all defaults)."""
        return _build(cls, {} if data is None else data, prefix)

    @classmethod
    def from_main_config(cls, main_config: Any) -> TinkerConfig:
        """``TinkerConfig.from_dict(main_config.remote_backend)`` (resolves an OmegaConf node first)."""
        node = main_config.get("remote_backend") if hasattr(main_config, "get") else None
        return cls.from_dict(_to_plain(node))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
