"""Strict conversion of a config mapping into frozen dataclasses, shared by the backends' config mirrors.

Whatever its vendor, a backend reads its ``remote_backend`` node through here: ``select(cfg, "a.b.c")``
reads one dotted key of verl's main config (``default`` when absent or null); ``build(cls, data, prefix)``
turns a mapping (``to_plain`` resolves an OmegaConf node first) into ``cls``: an unknown key, a value of
the wrong type, a null where none is allowed or a value outside a ``Literal`` raises
:class:`~verl.remote_backend.errors.RemoteBackendConfigError` naming the dotted key, the allowed values and
what was received; then each dataclass's ``_validate(prefix)`` checks ranges (with :func:`require`).
What is not here: any backend's keys.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = ["build", "require", "select", "to_plain"]

_MISSING = object()


def require(ok: bool, key: str, message: str, allowed: Any, received: Any) -> None:
    """Raise :class:`RemoteBackendConfigError` for ``key`` unless ``ok``."""
    if not ok:
        raise RemoteBackendConfigError(key, message, allowed=allowed, received=received)


def select(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b.c`` for a DictConfig or nested mappings; ``default`` when a level is missing or null."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part, _MISSING) if hasattr(node, "get") else getattr(node, part, _MISSING)
        except Exception:  # noqa: BLE001 - omegaconf raises on missing mandatory values ("???")
            return default
        if node is _MISSING:
            return default
    return default if node is None else to_plain(node)


def to_plain(section: Any) -> Any:
    """A plain container out of an OmegaConf node (resolved); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(section, (DictConfig, ListConfig)):
            return OmegaConf.to_container(section, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with verl
        pass
    return section


def build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise RemoteBackendConfigError(prefix, "expected a mapping", allowed=f"keys of {cls.__name__}",
                                       received=data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise RemoteBackendConfigError(f"{prefix}.{unknown[0]}", "unknown key", allowed=sorted(fields),
                                       received=unknown[0])
    kwargs = {name: _convert(hints[name], data[name], f"{prefix}.{name}") for name in fields if name in data}
    obj = cls(**kwargs)
    for name in fields:  # nested dataclasses validate themselves when built from data or defaults
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value) and name not in data:
            build(type(value), {}, f"{prefix}.{name}")
    validate = getattr(obj, "_validate", None)
    if validate is not None:
        validate(prefix)
    return obj


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise RemoteBackendConfigError(key, "must not be null", allowed=_describe(tp), received=value)
        inner = [o for o in options if o is not type(None)]
        return _convert(inner[0], value, key) if len(inner) == 1 else value
    if origin is Literal:
        allowed = list(typing.get_args(tp))
        if value not in allowed:
            raise RemoteBackendConfigError(key, "not one of the allowed values", allowed=allowed, received=value)
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise RemoteBackendConfigError(key, "expected a boolean", allowed="true or false", received=value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RemoteBackendConfigError(key, "expected an integer", allowed="an integer", received=value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RemoteBackendConfigError(key, "expected a number", allowed="a number", received=value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RemoteBackendConfigError(key, "expected a string", allowed="a string", received=value)
        return value
    if tp is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise RemoteBackendConfigError(key, "expected a mapping", allowed="a mapping ({} for none)",
                                           received=value)
        return dict(value)
    return value  # pragma: no cover - every field type is handled above


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
