"""Checks of a composed config that end a run in seconds, before Ray, a server or a job starts.

verl finds some mistakes late and one at a time: a bare ``python -m verl.remote_backend.main_ppo
remote_backend=arctic`` first fails on the critic a ``gae`` run would train, then, a run later, on
verl's micro-batch assertion, then on a missing data file inside Ray; ``actor.optim.lr=abc`` ends in
``could not convert string to float: 'abc'`` without the key; an unreachable server URL in four
retry warnings and a traceback. Here:

* :func:`missing_settings` lists every setting a run needs and lacks (or has a value the remote
  backend cannot run, or a logger that cannot start: verl's default ``wandb`` without a login),
  all at once;
* :func:`unconvertible_values` names every value that verl's config dataclasses cannot convert,
  with its dotted key, the type expected and what was given;
* :func:`check_settings` raises one :class:`PreflightError` holding both lists;
* :func:`check_server_reachable` opens one TCP connection to ``remote_backend.server.url`` (when
  set) and raises naming the key, what was tried and ``null`` (the backend's default server).

The entry point prints a :class:`PreflightError` as one line (``[remote_backend] error: ...``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import socket
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.remote_backend.base import RemoteBackendRegistry
from verl.remote_backend.context import ensure_backends_registered
from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = [
    "NULL_URL_ATTRIBUTE",
    "PreflightError",
    "check_server_reachable",
    "check_settings",
    "missing_settings",
    "unconvertible_values",
]

#: seconds one TCP connection attempt to the server may take
CONNECT_TIMEOUT_S = 5.0
_URL_KEY = "remote_backend.server.url"
#: the backend class attribute saying what ``remote_backend.server.url: null`` means for it (optional)
NULL_URL_ATTRIBUTE = "null_url_means"
_CRITIC_FREE = "grpo, rloo, reinforce_plus_plus, remax, opo, gpg, ... (no critic)"


class PreflightError(RemoteBackendConfigError):
    """Settings that stop the run before anything starts; the message lists every one of them."""


def _null_url_means(name: str) -> str:
    """What ``server.url: null`` means for backend ``name``: its class's :data:`NULL_URL_ATTRIBUTE`."""
    ensure_backends_registered()
    try:
        backend_cls = RemoteBackendRegistry.get(name)
    except KeyError:
        backend_cls = None
    return str(getattr(backend_cls, NULL_URL_ATTRIBUTE, None) or "use the backend's default server")


def _select(config: DictConfig, key: str) -> Any:
    return OmegaConf.select(config, key, default=None, throw_on_missing=False)


def _unset_micro_batch(config: DictConfig, node: str, per_gpu: str, dynamic: str) -> bool:
    return (_select(config, f"{node}.{per_gpu}") is None and _select(config, f"{node}.{per_gpu.replace('_per_gpu', '')}") is None
            and not _select(config, f"{node}.{dynamic}"))


def _local_paths(value: Any) -> list[str]:
    items = list(value) if isinstance(value, (ListConfig, list, tuple)) else [value]
    return [str(v) for v in items if v is not None and "://" not in str(v)]


def _needs_reference(config: DictConfig) -> bool:
    return bool(_select(config, "actor_rollout_ref.actor.use_kl_loss") or _select(config, "algorithm.use_kl_in_reward"))


#: loggers of verl's ``trainer.logger`` -> the module each imports (``verl.utils.tracking``)
_LOGGER_MODULES = {"wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow", "tensorboard": "tensorboard",
                   "clearml": "clearml", "trackio": "trackio"}


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")


def _logger_problems(config: DictConfig) -> list[str]:
    loggers = _select(config, "trainer.logger")
    names = [str(n) for n in (loggers if isinstance(loggers, (ListConfig, list)) else [loggers]) if n is not None]
    kept = [n for n in names if n not in _LOGGER_MODULES or importlib.util.find_spec(_LOGGER_MODULES[n]) is not None]
    why = [f"{n} is not installed" for n in names if n not in kept]
    if "wandb" in kept and not _wandb_logged_in():
        kept.remove("wandb")
        why.append("wandb has no login here: set WANDB_API_KEY, or WANDB_MODE=offline")
    if not why:
        return []
    return [f"trainer.logger=[{','.join(kept or ['console'])}] (got {names}: {'; '.join(why)})"]


def missing_settings(config: DictConfig) -> list[str]:
    """One ``key=<what to set> (why)`` entry per setting the run needs and lacks, in command-line order."""
    problems: list[str] = []
    estimator = _select(config, "algorithm.adv_estimator")
    if estimator == "gae" or _select(config, "critic.enable"):
        problems.append(f"algorithm.adv_estimator=grpo (got {estimator!r}, which trains a critic on this machine; "
                        f"the remote backend runs critic-free estimators: {_CRITIC_FREE})")
    for key in ("data.train_files", "data.val_files"):
        for path in _local_paths(_select(config, key)):
            if not Path(os.path.expanduser(path)).exists():
                problems.append(f"{key}=<parquet file> (no file {path!r}; verl reads the data on this machine)")
    model = _select(config, "actor_rollout_ref.model.path")
    if model is None or (str(model).startswith(("/", "~", ".")) and not Path(os.path.expanduser(str(model))).exists()):
        problems.append(f"actor_rollout_ref.model.path=<model directory or hub id> (no directory {model!r}; verl "
                        "reads its tokenizer and config on this machine)")
    if _unset_micro_batch(config, "actor_rollout_ref.actor", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz"):
        problems.append("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=<rows> (rows per forward/backward "
                        "on the server; or actor.use_dynamic_bsz=True)")
    if _unset_micro_batch(config, "actor_rollout_ref.rollout", "log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz"):
        problems.append("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=<rows> (rows per old-log-prob "
                        "forward; or rollout.log_prob_use_dynamic_bsz=True)")
    if _needs_reference(config) and _unset_micro_batch(config, "actor_rollout_ref.ref", "log_prob_micro_batch_size_per_gpu",
                                                       "log_prob_use_dynamic_bsz"):
        problems.append("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=<rows> (the KL term needs "
                        "reference log-probs; or ref.log_prob_use_dynamic_bsz=True)")
    return problems + _logger_problems(config)


def _dataclass_of(target: Any) -> type | None:
    if not isinstance(target, str) or "." not in target:
        return None
    module_name, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None
    return cls if dataclasses.is_dataclass(cls) else None


def _scalar_type(hint: Any) -> type | None:
    """``int``, ``float`` or ``bool`` for a field hinted as one of them (or ``Optional`` of one), else None."""
    if hint in (int, float, bool):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _scalar_type(args[0])
    return None


def _converts(value: str, kind: type) -> bool:
    text = value.strip()
    if kind is bool:
        return text.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off")
    try:
        number = float(text)
    except ValueError:
        return False
    return kind is float or (math.isfinite(number) and number == int(number))


def _typed_nodes(node: DictConfig, prefix: str) -> Iterator[tuple[str, DictConfig]]:
    if "_target_" in node:
        yield prefix, node
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from _typed_nodes(child, f"{prefix}.{key}" if prefix else str(key))


def unconvertible_values(config: DictConfig) -> list[str]:
    """``key: expected <type>, got <value>`` for every string value that the ``int``/``float``/``bool`` field
    of verl's config dataclass behind its node (``_target_``) cannot take."""
    problems: list[str] = []
    for prefix, node in _typed_nodes(config, ""):
        cls = _dataclass_of(node.get("_target_"))
        if cls is None:
            continue
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001, S112 - a hint that does not resolve: leave the node to verl
            continue
        for field in dataclasses.fields(cls):
            kind = _scalar_type(hints.get(field.name))
            if kind is None or field.name not in node:
                continue
            child = node._get_node(field.name)
            if child is None or child._is_interpolation() or child._is_missing():
                continue
            value = child._value()
            if isinstance(value, str) and not _converts(value, kind):
                problems.append(f"{prefix}.{field.name}: expected {'a' if kind is not int else 'an'} "
                                f"{kind.__name__}, got {value!r}")
    return problems


def check_settings(config: DictConfig) -> None:
    """Raise one :class:`PreflightError` listing every missing setting and unconvertible value."""
    missing, bad = missing_settings(config), unconvertible_values(config)
    if not missing and not bad:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} setting{'s' if len(missing) > 1 else ''} to add or change: " + "; ".join(missing))
    if bad:
        parts.append(f"{len(bad)} value{'s' if len(bad) > 1 else ''} verl cannot convert: " + "; ".join(bad))
    field = "command line" if missing else bad[0].split(":", 1)[0]
    raise PreflightError(field, " | ".join(parts))


def check_server_reachable(config: DictConfig, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Open (and close) one TCP connection to ``remote_backend.server.url``; nothing when it is null.

    Raises :class:`PreflightError` naming the key, the address tried, the reason and what ``null`` does.
    """
    url = _select(config, _URL_KEY)
    if url in (None, ""):
        return
    parts = urlsplit(str(url))
    null_means = _null_url_means(str(_select(config, "remote_backend.name") or ""))
    hint = f"start the server or correct the URL, or set {_URL_KEY}=null to {null_means}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PreflightError(_URL_KEY, f"expected http://host:port or https://host[:port]; {hint}", received=str(url))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            pass
    except OSError as exc:
        if isinstance(exc, TimeoutError):
            reason = f"no answer in {timeout_s:g} s"
        else:
            reason = exc.strerror or type(exc).__name__
        raise PreflightError(_URL_KEY, f"cannot reach {url} (tried a TCP connection to {parts.hostname}:{port}: "
                                       f"{reason}); {hint}") from None
