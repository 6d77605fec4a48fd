"""The test tree's naming rules, which CI's file globs rely on.

verl's CI picks its CPU unit tests with the glob ``*_on_cpu.py`` and its GPU tests by ``_gpu``; the end-to-end
runs in ``tests/special_e2e/`` take minutes each and must not be picked up as CPU unit tests, so they are named
``test_<what>.py`` and marked ``e2e`` and ``slow``. Every other test module ends in ``_on_cpu.py`` or ``_gpu.py``.
Shared helpers live in ``tests/support/`` (no test modules there).
"""

from __future__ import annotations

import fnmatch
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
E2E = TESTS / "special_e2e"


def _test_modules() -> list[pathlib.Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_the_tree_has_end_to_end_and_unit_modules():
    modules = _test_modules()
    assert any(p.parent == E2E for p in modules) and any(p.parent != E2E for p in modules)


def test_no_end_to_end_module_matches_the_cpu_unit_glob():
    matched = [p.name for p in E2E.rglob("*.py") if fnmatch.fnmatch(p.name, "*_on_cpu.py")]
    assert matched == []


def test_every_end_to_end_module_is_marked_e2e_and_slow():
    unmarked = [p.name for p in E2E.rglob("test_*.py")
                if not ("pytest.mark.e2e" in p.read_text() and "pytest.mark.slow" in p.read_text())]
    assert unmarked == []


def test_every_other_test_module_ends_in_on_cpu_or_gpu():
    misnamed = [str(p.relative_to(TESTS)) for p in _test_modules()
                if E2E not in p.parents and not p.name.endswith(("_on_cpu.py", "_gpu.py"))]
    assert misnamed == []


def test_the_support_package_holds_no_test_module():
    assert list((TESTS / "support").rglob("test_*.py")) == []


def test_the_long_modules_listed_first_exist():
    from tests.conftest import _LONG_MODULES_FIRST

    assert [m for m in _LONG_MODULES_FIRST if not (TESTS / m).is_file()] == []
