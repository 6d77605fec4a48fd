"""Checks of a verl command line that selects a remote backend, made before Hydra composes it.

Hydra reports a typo late and about the wrong thing: ``remote_backend=arctc`` ends in
``Could not override 'remote_backend.server.url'`` (after our entry point has already written the
bad name into other keys), and ``remote_backend.server.urll=x`` in a hint to append it with ``+``.
This module reads the overrides instead and says, in one line, what was given, what exists and
the closest match:

* :func:`check_backend_name` -- ``remote_backend=<name>`` / ``+remote_backend=<name>`` against the
  registered backends (``RemoteBackendRegistry.list()``);
* :func:`check_backend_keys` -- every ``remote_backend.<key>=<value>`` (no ``+``: Hydra would refuse
  a new key) against the backend's option group ``remote_backend/<name>.yaml``;
* :func:`check_command_line` -- both, for ``python -m verl.remote_backend.main_ppo`` and, through the
  plugin hook, for stock ``verl.trainer.main_ppo`` (:func:`is_stock_main_ppo`).

Not here: the settings a run derives (``settings.py``) or anything after composition.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = [
    "check_backend_keys",
    "check_backend_name",
    "check_command_line",
    "exit_on_usage_error",
    "is_stock_main_ppo",
    "option_group_file",
    "stock_main_ppo_overrides",
]

_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2}|~)(?P<key>[A-Za-z0-9_.@/\-]+)=(?P<value>.*)$", re.DOTALL)
_GROUP = "remote_backend"
_STOCK_MODULE = "verl.trainer.main_ppo"


def _overrides(args: Sequence[str]) -> Iterator[tuple[str, str, str]]:
    for token in args:
        match = _OVERRIDE.match(token)
        if match:
            yield match.group("prefix"), match.group("key"), match.group("value").strip()


def _closest(word: str, choices: Sequence[str], n: int = 1) -> list[str]:
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)


def check_backend_name(args: Sequence[str], registered: Sequence[str]) -> str | None:
    """The backend selected in ``args`` (the last ``[+]remote_backend=<name>``), or ``None``.

    Raises :class:`RemoteBackendConfigError` when the name is not one of ``registered``.
    """
    chosen = None
    for prefix, key, value in _overrides(args):
        if key == _GROUP and prefix != "~":
            chosen = value or None
    if chosen is None or chosen in registered:
        return chosen
    guess = _closest(chosen, registered)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    raise RemoteBackendConfigError(
        _GROUP, f"unknown remote backend {chosen!r}{hint}", allowed=", ".join(sorted(registered)) or "none registered",
        received=chosen,
    )


def _dotted_keys(node: DictConfig, prefix: str) -> Iterator[str]:
    for key in node:
        dotted = f"{prefix}.{key}"
        yield dotted
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            yield from _dotted_keys(child, dotted)


def check_backend_keys(args: Sequence[str], group: DictConfig) -> None:
    """Raise :class:`RemoteBackendConfigError` for a ``remote_backend.<key>=`` override (without ``+``)
    that ``group`` (the selected option group) does not have, naming the nearest valid keys."""
    valid = list(_dotted_keys(group, _GROUP))
    for prefix, key, _value in _overrides(args):
        if prefix or not key.startswith(_GROUP + "."):
            continue  # `+`/`++` add keys on purpose; `~` deletes
        node: object = group
        walked = _GROUP
        for part in key.split(".")[1:]:
            if not isinstance(node, DictConfig) or node._is_none() or len(node) == 0:
                break  # a leaf, a list or a free-form mapping: Hydra and the backend's config judge the rest
            if part not in node:
                depth = key.count(".")
                near = _closest(key, [k for k in valid if k.count(".") == depth], n=2) or _closest(key, valid, n=2)
                hint = f" (did you mean {' or '.join(near)}?)" if near else ""
                raise RemoteBackendConfigError(
                    key, f"unknown key {part!r} under {walked} in the {group.get('name', '?')!r} option group{hint}",
                    allowed=", ".join(str(k) for k in node), received=part,
                )
            node = node._get_node(part)
            walked = f"{walked}.{part}"


def _package_dirs(package: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def option_group_file(name: str) -> Path | None:
    """``remote_backend/<name>.yaml`` of this distribution, of verl's config folder or of an installed
    plug-in's config package (``verl_remote_backend.configs`` entry points), if present."""
    from verl.remote_backend.plugins import config_packages

    roots = []
    ours = importlib.util.find_spec("verl.remote_backend")
    if ours is not None and ours.submodule_search_locations:
        package = Path(next(iter(ours.submodule_search_locations))).resolve()
        roots.append(package.parent / "trainer" / "config")
    roots.extend(_package_dirs("verl.trainer.config"))
    for package in config_packages():
        roots.extend(_package_dirs(package))
    for root in roots:
        path = root / _GROUP / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def check_command_line(args: Sequence[str]) -> str | None:
    """:func:`check_backend_name` against the registry, then :func:`check_backend_keys` against the
    backend's option group when its file is found. Returns the selected backend (or ``None``)."""
    from verl.remote_backend.base import RemoteBackendRegistry
    from verl.remote_backend.context import ensure_backends_registered

    ensure_backends_registered()
    name = check_backend_name(args, RemoteBackendRegistry.list())
    if name is None:
        return None
    path = option_group_file(name)
    if path is not None:
        group = OmegaConf.load(path)
        if isinstance(group, DictConfig):
            check_backend_keys(args, group)
    return name


def is_stock_main_ppo(orig_argv: Sequence[str] | None = None) -> bool:
    """Whether this process is ``python -m verl.trainer.main_ppo`` or ``python .../verl/trainer/main_ppo.py``.

    Reads the interpreter's own command line (``sys.orig_argv``): while ``python -m`` imports the
    parent packages, ``sys.argv[0]`` is still ``-m``.
    """
    argv = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    for i, token in enumerate(argv):
        if token == "-m" and i + 1 < len(argv):
            return argv[i + 1] == _STOCK_MODULE
        if token.endswith(".py"):
            return Path(token).as_posix().endswith("verl/trainer/main_ppo.py")
    return False


def stock_main_ppo_overrides(orig_argv: Sequence[str] | None = None) -> list[str]:
    """The arguments after the module or script of a stock ``main_ppo`` command line."""
    argv = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    for i, token in enumerate(argv):
        if token == "-m":
            return argv[i + 2 :]
        if token.endswith(".py"):
            return argv[i + 1 :]
    return []


def exit_on_usage_error(exc: RemoteBackendConfigError) -> NoReturn:
    """End the process with ``exc`` as one line on stderr and exit status 2 (a usage error)."""
    print(f"[remote_backend] error: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(2)
