"""Load a script of this repository (an example, a benchmark) as a module, by its path.

Examples and benchmarks are scripts, not packages: a test that calls their functions loads the one file
under a module name of its own (``<folder>_<file>``, e.g. ``arithmetic_make_data``), without putting the
script's folder on ``sys.path``. The module is registered in ``sys.modules`` under that name while it runs
(dataclasses and pickling look a class's module up there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str | Path) -> ModuleType:
    """The module of ``REPO_ROOT / relative`` (a ``.py`` file), executed once per call."""
    path = REPO_ROOT / relative
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file that can be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module
