"""Hydra search path of verl-remote-backend (discovered by Hydra in every app; acts in verl's only).

When an app's search path holds verl's trainer configs, this plugin appends:

* ``pkg://verl.trainer.config``: verl's ``ppo_trainer`` (needed when the primary config is ours);
* the folder holding the ``remote_backend/`` option group (``verl/trainer/config`` of this
  distribution; differs from verl's own in an editable install);
* ``verl/remote_backend/config``: our primary config ``remote_backend_ppo_trainer``, so stock
  ``main_ppo --config-name remote_backend_ppo_trainer remote_backend=arctic`` works too;
* ``pkg://<package>`` for each installed plug-in's ``verl_remote_backend.configs`` entry point: the
  package holding its ``remote_backend/<name>.yaml`` option group (see ``docs/ADDING_A_BACKEND.md``).

It also refuses, before any Ray process starts, a stock ``verl.trainer.main_ppo`` command line that
selects a remote backend but would silently train locally: the plugin hook
(``VERL_USE_EXTERNAL_MODULES=verl.remote_backend.register``) missing, or
``trainer.v1.trainer_mode`` not ``remote_backend``.

Kept light on purpose: it imports nothing from verl unless the app is verl's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from importlib import metadata

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

__all__ = ["VerlRemoteBackendSearchPathPlugin", "check_stock_command_line", "plugin_config_packages"]

PROVIDER = "verl-remote-backend"
PLUGIN_MODULE = "verl.remote_backend.register"
TRAINER_MODE = "remote_backend"
PRIMARY_CONFIG = "remote_backend_ppo_trainer"
#: entry-point group naming plug-ins' config packages (``verl.remote_backend.plugins.CONFIG_GROUP``)
CONFIG_GROUP = "verl_remote_backend.configs"
_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2}|~)(?P<key>[A-Za-z0-9_.@/\-]+)=(?P<value>.*)$", re.DOTALL)


def _is_verl_config(path: str) -> bool:
    path = path.replace("\\", "/").rstrip("/")
    return path.endswith(("verl/trainer/config", "verl.trainer.config", "verl/remote_backend/config"))


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def our_search_paths() -> list[str]:
    """The entries this plugin appends (see the module docstring)."""
    paths = ["pkg://verl.trainer.config"]
    ours = _package_dir("verl.remote_backend")
    if ours is not None:
        ours = os.path.abspath(ours)
        # the option group ships in the same tree as verl/remote_backend (this distribution)
        group_root = os.path.join(os.path.dirname(os.path.dirname(ours)), "verl", "trainer", "config")
        if os.path.isdir(os.path.join(group_root, "remote_backend")):
            paths.append("file://" + group_root)
        if os.path.isdir(os.path.join(ours, "config")):
            paths.append("file://" + os.path.join(ours, "config"))
    for package in plugin_config_packages():
        if "pkg://" + package not in paths:
            paths.append("pkg://" + package)
    return paths


def plugin_config_packages() -> list[str]:
    """The packages installed plug-ins name in the ``verl_remote_backend.configs`` entry-point group."""
    return sorted({entry.value for entry in metadata.entry_points(group=CONFIG_GROUP)})


def _overrides(argv: list[str]) -> dict[str, str]:
    found = {}
    for token in argv:
        match = _OVERRIDE.match(token)
        if match and match.group("prefix") != "~":
            found[match.group("key")] = match.group("value")
    return found


def _config_name(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token in ("--config-name", "-cn") and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config-name="):
            return token.split("=", 1)[1]
    return None


def check_stock_command_line(argv: list[str], environ: dict[str, str]) -> list[str]:
    """Problems of a stock ``verl.trainer.main_ppo`` command line that selects a remote backend
    (empty when it does not select one, or is fine)."""
    args = argv[1:]
    values = _overrides(args)
    if not values.get("remote_backend"):
        return []
    problems = []
    modules = [m.strip() for m in environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    if PLUGIN_MODULE not in modules:
        problems.append(f"the plugin is not loaded: set VERL_USE_EXTERNAL_MODULES={PLUGIN_MODULE}")
    if values.get("trainer.use_v1", "true").lower() in ("false", "0"):
        problems.append("trainer.use_v1=False: the plugin route needs verl's V1 trainer")
    uses_our_primary = _config_name(args) == PRIMARY_CONFIG
    mode = values.get("trainer.v1.trainer_mode", TRAINER_MODE if uses_our_primary else "sync")
    if mode != TRAINER_MODE:
        problems.append(f"trainer.v1.trainer_mode={mode}: it must be {TRAINER_MODE} (else verl trains locally)")
    return problems


class VerlRemoteBackendSearchPathPlugin(SearchPathPlugin):
    """Appends our config folders to verl apps' search paths (see the module docstring)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        entries = [element.path for element in search_path.get_path()]
        if not any(_is_verl_config(path) for path in entries):
            return
        if os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0]))) == "trainer" and sys.argv[0].endswith("main_ppo.py"):
            problems = check_stock_command_line(sys.argv, dict(os.environ))
            if problems:
                raise ValueError(
                    "remote_backend is selected but this run would not use it: "
                    + "; ".join(problems)
                    + ". Simplest: `python -m verl.remote_backend.main_ppo <overrides> remote_backend=<name>`."
                )
        for path in our_search_paths():
            if path not in entries:
                search_path.append(provider=PROVIDER, path=path)
                entries.append(path)
