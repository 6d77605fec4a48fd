"""The generic layer (``verl/remote_backend``) imports no module of the vendors' adapters and names no vendor.

Every ``import`` in ``verl/remote_backend/**.py`` is read with :mod:`ast` (nothing is imported),
wherever it stands, lazy ones included; so is every string in its code (docstrings aside: they may
give a shipped backend as an example). The built-in loaders in ``builtin.py`` name the shipped
adapters as strings (``"module:Class"``) that are imported on first use; that table is the one place
the generic layer knows them. What differs by backend (e.g. what ``server.url: null`` means) is an
attribute of the backend's class.
"""

from __future__ import annotations

import ast
import pathlib

from tests.support.scripts import REPO_ROOT as REPO

VENDOR_PACKAGE = "verl.workers.remote_client"
VENDORS = ("arctic", "tinker")


def _generic_modules() -> list[pathlib.Path]:
    return sorted((REPO / "verl" / "remote_backend").rglob("*.py"))


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
        for path in _generic_modules()
        for name in _imports(path)
        if name == VENDOR_PACKAGE or name.startswith(VENDOR_PACKAGE + ".")
    }
    assert not found, f"the generic layer imports adapter modules: {found}"


def _code_strings(path: pathlib.Path) -> list[ast.Constant]:
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_code_of_the_generic_layer_names_a_vendor():
    found = [f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:60]!r}"
             for path in _generic_modules() if path.name != "builtin.py"
             for node in _code_strings(path) if any(v in node.value.lower() for v in VENDORS)]
    assert not found, "vendor names in the generic layer's code:\n" + "\n".join(found)


def test_the_rollout_batching_options_are_the_generic_layers():
    from verl.remote_backend.workers.batching import RolloutBatching
    from verl.workers.remote_client.arctic.arctic_config import RolloutJobConfig
    from verl.workers.remote_client.tinker.config import TinkerRolloutConfig

    assert issubclass(RolloutJobConfig, RolloutBatching) and issubclass(TinkerRolloutConfig, RolloutBatching)
