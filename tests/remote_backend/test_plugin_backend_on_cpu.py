"""An out-of-tree backend, built and pip-installed in a temp dir, runs GRPO with no edit to this repository.

The package (``verl-backend-mirror``) is what ``docs/ADDING_A_BACKEND.md`` tells a third vendor to
write: its own ``pyproject.toml`` with the two entry points (``verl_remote_backend.backends``: a
registration callable; ``verl_remote_backend.configs``: the package holding its yaml group), its own
``remote_backend/mirror.yaml``, and a backend that reuses the Arctic adapter's classes under the name
``mirror``. It is built with this venv's pip (``--no-deps --no-build-isolation``) into a temp
``--target`` directory that only the subprocesses below see on ``PYTHONPATH``: the test venv is left
as it was.

With it on the path:

* ``remote_backend=mirror`` is registered in every registry (ours and verl's ``RolloutReplicaRegistry``);
* the backend contract test (``test_remote_backend_contract_on_cpu.py``) runs over ``mirror`` too;
* ``python -m verl.remote_backend.main_ppo <the shrunk GRPO recipe> remote_backend=mirror`` runs 2 steps
  against a real reference server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.e2e import (
    build_task,
    entry_point_command,
    entry_point_env,
    parse_console_metrics,
    run_in_own_session,
    tiny_grpo_overrides,
)
from tests.support.server import running_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NAME = "mirror"

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "verl-backend-mirror"
version = "0.1.0"
description = "The Arctic adapter registered as a third backend, from outside the repository"
requires-python = ">=3.10"

[project.entry-points."verl_remote_backend.backends"]
mirror = "mirror_backend.plugin:register"

[project.entry-points."verl_remote_backend.configs"]
mirror = "mirror_backend.config"

[tool.setuptools]
packages = ["mirror_backend", "mirror_backend.config"]

[tool.setuptools.package-data]
"mirror_backend.config" = ["remote_backend/*.yaml"]
"""

PLUGIN = '''\
"""The ``mirror`` backend: the Arctic adapter, registered under a name of its own."""

from __future__ import annotations

from verl.remote_backend.plugins import register_backend
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient


class MirrorClient(ArcticRLClient):
    """Arctic's adapter as is, under another name: its config mirror (``remote_backend.*``, Arctic's keys)
    accepts any name registered to it or a subclass."""


def register() -> None:
    register_backend(
        "mirror",
        MirrorClient,
        worker="verl.workers.remote_client.arctic.worker:ArcticRLActorRolloutRefWorker",
        replica="verl.workers.remote_client.arctic.replica:ArcticRLRolloutReplica",
    )
'''


def write_package(root: Path) -> Path:
    """The plug-in's source tree under ``root``; its yaml group is Arctic's with its own name."""
    pkg = root / "mirror_backend"
    (pkg / "config" / "remote_backend").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text('"""A remote backend for verl, installed from outside its repository."""\n')
    (pkg / "plugin.py").write_text(PLUGIN)
    (pkg / "config" / "__init__.py").write_text('"""The Hydra option group of the mirror backend."""\n')
    arctic = (REPO / "verl" / "trainer" / "config" / "remote_backend" / "arctic.yaml").read_text()
    assert "\nname: arctic\n" in arctic
    group = arctic.replace("\nname: arctic\n", f"\nname: {NAME}\n").replace('Remote backend "arctic"', f'Remote backend "{NAME}"')
    (pkg / "config" / "remote_backend" / f"{NAME}.yaml").write_text(group)
    return root


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The package built and installed (``pip install --target``) into a directory of its own."""
    src = write_package(tmp_path_factory.mktemp("mirror_src"))
    site = tmp_path_factory.mktemp("mirror_site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--target", str(site), str(src)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(site.glob("verl_backend_mirror-0.1.0.dist-info/entry_points.txt")), sorted(p.name for p in site.iterdir())
    return site


def env_with(site: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return entry_point_env(PYTHONPATH=path, **extra)


def test_the_installed_plugin_is_registered_everywhere(plugin_site):
    probe = textwrap.dedent(f"""
        import verl.remote_backend.builtin
        from verl.remote_backend.base import RemoteBackendRegistry as R
        from verl.workers.rollout.replica import RolloutReplicaRegistry
        from verl.workers.remote_client.arctic.replica import ArcticRLRolloutReplica
        from verl.workers.remote_client.arctic.worker import ArcticRLActorRolloutRefWorker
        assert R.list() == ["arctic", "{NAME}", "tinker"], R.list()
        assert R.get("{NAME}").__module__ == "mirror_backend.plugin"
        assert R.get_worker("{NAME}") is ArcticRLActorRolloutRefWorker
        assert R.get_replica("{NAME}") is RolloutReplicaRegistry.get("{NAME}") is ArcticRLRolloutReplica
        from hydra_plugins.verl_remote_backend_searchpath import our_search_paths
        assert "pkg://mirror_backend.config" in our_search_paths(), our_search_paths()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", probe], env=env_with(plugin_site), cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]


def test_a_misspelt_key_of_the_plugins_group_fails_before_hydra(plugin_site):
    """The command-line check finds the plug-in's yaml group through its config package, so a typo under
    ``remote_backend.*`` is named in one line (with the closest key) before anything starts."""
    probe = textwrap.dedent(f"""
        from verl.remote_backend.command_line import check_command_line, option_group_file
        from verl.remote_backend.errors import RemoteBackendConfigError
        print(option_group_file("{NAME}"))
        try:
            check_command_line(["remote_backend={NAME}", "remote_backend.server.urll=http://x:1"])
        except RemoteBackendConfigError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", probe], env=env_with(plugin_site), cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert f"mirror_backend/config/remote_backend/{NAME}.yaml" in out, out[-3000:]
    assert "refused:" in out and "urll" in out and "url" in out.split("urll", 1)[1], out[-3000:]


def test_the_backend_contract_holds_for_the_plugin(plugin_site):
    contract = REPO / "tests" / "remote_backend" / "test_remote_backend_contract_on_cpu.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
                           str(contract), "-k", NAME], env=env_with(plugin_site), cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert re.search(r"\b4 passed, \d+ deselected", tail), tail  # every per-backend case, run for mirror


def test_two_grpo_steps_with_the_plugin_backend(plugin_site, tmp_path):
    task = build_task(tmp_path / "task")
    with running_server(tmp_path / "server") as server:
        overrides = [
            *tiny_grpo_overrides(task, tmp_path / "run", micro_batch=4),
            f"remote_backend={NAME}",
            f"remote_backend.server.url={server.url}",
            "remote_backend.train.deepspeed.bf16=false",
        ]
        returncode, output = run_in_own_session(entry_point_command(overrides), cwd=tmp_path,
                                                env=env_with(plugin_site), timeout=1200)
        (tmp_path / "run.log").write_text(output)
        assert returncode == 0, output[-6000:]
        steps = parse_console_metrics(output)
        assert sorted(steps) == [1, 2], f"steps logged: {sorted(steps)}"
        for metrics in steps.values():
            assert "actor/pg_loss" in metrics and "critic/score/mean" in metrics
        assert steps[2]["training/global_step"] == 2
        assert f"remote backend '{NAME}' destroyed" in output
        assert "step job=" in server.log_tail(1_000_000)  # the training ran on this server
