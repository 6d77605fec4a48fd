"""Test-suite wiring: refuse to test a stale install, keep processes to one thread, skip GPU tests.

PyPI verl is a regular package, so our sub-packages reach ``verl.*`` either through the editable
install's import hook (which points at this checkout) or as copies in site-packages. A copy goes
stale the moment a file here is edited; the check below stops the session before a single test
runs against one.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS_DIR = pathlib.Path(__file__).resolve().parent
# Material shared with the project: golden DSSST1 frames etc. (a sibling of the checkout).
SHARED_DIR = pathlib.Path(os.environ.get("VERL_REMOTE_BACKEND_SHARED", REPO_ROOT.parent / "shared"))

# One thread per process: the server, Ray workers and the driver share two cores in CI.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_var, "1" if _var != "TOKENIZERS_PARALLELISM" else "false")

if str(TESTS_DIR) not in sys.path:  # test helper modules (server_process.py, ...) import by name
    sys.path.insert(0, str(TESTS_DIR))

_OUR_PACKAGES = ("verl.remote_backend", "arctic_rl")


def _stale_copies() -> list[str]:
    problems = []
    for name in _OUR_PACKAGES:
        mod = importlib.import_module(name)
        where = pathlib.Path(mod.__file__).resolve()
        if REPO_ROOT not in where.parents:
            problems.append(f"{name} is imported from {where}, not from this checkout ({REPO_ROOT})")
    return problems


def pytest_configure(config: pytest.Config) -> None:
    problems = _stale_copies()
    if problems:
        raise pytest.UsageError(
            "refusing to test a stale copy: "
            + "; ".join(problems)
            + ". Run `bash scripts/install.sh --test` (editable install) or `pip uninstall verl-remote-backend` first."
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    if not SHARED_DIR.is_dir():
        pytest.skip(f"shared material not found at {SHARED_DIR} (set VERL_REMOTE_BACKEND_SHARED)")
    return SHARED_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny Qwen3 + char tokenizer, built once per session (no hub)."""
    from arctic_rl.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=0)
