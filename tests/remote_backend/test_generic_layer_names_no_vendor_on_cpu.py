"""The generic layer (``verl/remote_backend``) imports no module of the vendors' adapters.

Every ``import`` in ``verl/remote_backend/**.py`` is read with :mod:`ast` (nothing is imported),
wherever it stands, lazy ones included. The built-in loaders in ``builtin.py`` name the shipped
adapters as strings (``"module:Class"``) that are imported on first use; that table is the one place
the generic layer knows them, and it is not an import.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
VENDOR_PACKAGE = "verl.workers.remote_client"


def _imports(path: pathlib.Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module or "")
    return names


def test_no_module_of_the_generic_layer_imports_an_adapter():
    found = {
        str(path.relative_to(REPO)): name
        for path in sorted((REPO / "verl" / "remote_backend").rglob("*.py"))
        for name in _imports(path)
        if name == VENDOR_PACKAGE or name.startswith(VENDOR_PACKAGE + ".")
    }
    assert not found, f"the generic layer imports adapter modules: {found}"


def test_the_rollout_batching_options_are_the_generic_layers():
    from verl.remote_backend.workers.batching import RolloutBatching
    from verl.workers.remote_client.arctic.arctic_config import RolloutJobConfig
    from verl.workers.remote_client.tinker.config import TinkerRolloutConfig

    assert issubclass(RolloutJobConfig, RolloutBatching) and issubclass(TinkerRolloutConfig, RolloutBatching)
