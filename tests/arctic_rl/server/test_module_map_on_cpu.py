"""``arctic_rl/server/__init__.py``'s module map names every module of the server, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

import arctic_rl.server

SERVER = Path(arctic_rl.server.__file__).parent


def _modules() -> set[str]:
    """Every module under ``arctic_rl/server`` as ``.a.b`` (package ``__init__`` files aside)."""
    found = set()
    for path in SERVER.rglob("*.py"):
        parts = path.relative_to(SERVER).with_suffix("").parts
        if parts[-1] != "__init__":
            found.add("." + ".".join(parts))
    return found


def _mapped() -> set[str]:
    return set(re.findall(r":mod:`(\.[\w.]+)`", arctic_rl.server.__doc__ or ""))


def test_every_server_module_is_in_the_module_map():
    missing = sorted(_modules() - _mapped())
    assert not missing, f"add these to the module map in arctic_rl/server/__init__.py: {missing}"


def test_the_module_map_names_no_module_that_is_gone():
    stale = sorted(_mapped() - _modules() - {".engines", ".http", ".jobs", ".compute", ".zorro"})
    assert not stale, f"arctic_rl/server/__init__.py maps modules that do not exist: {stale}"
