"""The shape of our packages: no import circle, no oversized module.

Every ``.py`` under ``verl/remote_backend``, ``verl/workers/remote_client`` and ``arctic_rl`` is parsed
with :mod:`ast` (nothing is imported). Each ``import`` / ``from ... import`` that names one of these
modules is an edge -- wherever it stands: at the top, inside a function or under ``if TYPE_CHECKING``,
since a circle that a lazy import hides is still a circle in the design. An edge goes to the module
named, not to the packages above it (Python initialises those first, which makes no circle).

Checked: the graph has no cycle (each one found is reported as ``a -> b -> ... -> a``) and no module
of ours under ``verl/`` or ``arctic_rl/`` is longer than 400 lines (the longest is printed either way).
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = ("verl/remote_backend", "verl/workers/remote_client", "arctic_rl")
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of ours (a package is its ``__init__``)."""
    found = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """``name`` if it is one of our modules, else the nearest enclosing one of ours (``a.b.attr``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import mod`` names the module ``pkg.mod``; ``from mod import obj`` names ``mod``
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_closed_path(graph, set(component)) for component in components]


def _closed_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, for the report."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return sorted(component)


def test_the_checker_finds_a_cycle_and_resolves_relative_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    real = import_graph()
    # relative imports resolve to our modules: the Arctic client imports its roles
    assert "verl.workers.remote_client.arctic.training" in real["verl.workers.remote_client.arctic.arctic_rl"]
    assert "verl.workers.remote_client.common.verl_settings" in real["verl.workers.remote_client.arctic.builders"]


def test_no_import_circle_among_our_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_of_ours_is_over_400_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert any(n.startswith("verl.") for n in sizes) and any(n.startswith("arctic_rl.") for n in sizes), sorted(sizes)
    longest = max(sizes, key=sizes.get)
    print(f"longest module under verl/ and arctic_rl/: {longest} ({sizes[longest]} lines)")
    over = {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
