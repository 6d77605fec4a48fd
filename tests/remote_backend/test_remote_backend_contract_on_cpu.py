"""The contract every registered remote backend keeps, checked for each one (``arctic``, ``tinker``, ...).

* the adapter class passes the contract kit's static check (``verl.remote_backend.contract.
  check_backend_class``): a concrete ``RemoteBackend`` offering both compute protocols (``RemoteActor``,
  ``RemoteSampler``) with the signatures the worker and replica call, an optional capability it has
  (``adopt_sampler``) declared as its Protocol (``SamplerAdopter``); and it registers only through
  ``register_backend`` (no class decorator of its own);
* its worker is a ``RemoteActorRolloutRefWorker``, its replica a ``RemoteRolloutReplica``, and
  verl's own ``RolloutReplicaRegistry`` resolves ``rollout.name=<backend>`` to that replica;
* its Hydra option group file exists (here, or in an installed plug-in's config package), names the
  backend, has a comment over every key, and ``remote_backend=<name>`` composes to a config whose
  rollout is that backend's.

Installed plug-ins are registered backends too: ``test_plugin_backend_on_cpu.py`` runs this module with
one on the path.
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata, resources
from pathlib import Path

import pytest
import yaml

import verl.remote_backend.builtin  # noqa: F401  (registers the built-in backends)
from verl.remote_backend.base import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend.contract import check_backend_class
from verl.remote_backend.plugins import CONFIG_GROUP
from verl.remote_backend.protocols import ACTOR_METHODS, SAMPLER_METHODS, RemoteActor, RemoteSampler
from verl.remote_backend.workers.replica import RemoteRolloutReplica
from verl.remote_backend.workers.worker import RemoteActorRolloutRefWorker

REPO = Path(__file__).resolve().parents[2]
GROUP_DIR = REPO / "verl" / "trainer" / "config" / "remote_backend"
BACKENDS = RemoteBackendRegistry.list()


def test_both_built_in_backends_are_registered():
    assert {"arctic", "tinker"} <= set(BACKENDS)


@pytest.mark.parametrize("name", BACKENDS)
def test_adapter_keeps_the_static_contract(name):
    cls = RemoteBackendRegistry.get(name)
    check_backend_class(cls)
    if callable(getattr(cls, "adopt_sampler", None)):
        inspect.signature(cls.adopt_sampler).bind(None, {"model_path": "x"})


def test_each_method_is_declared_once_lifecycle_in_the_abc_compute_in_the_protocols():
    lifecycle = set(RemoteBackend.__abstractmethods__)
    compute = {*ACTOR_METHODS, *SAMPLER_METHODS}
    assert lifecycle == {"from_config", "reconnect_handle", "destroy", "requires_single_forwarder", "update_weights",
                         "save_checkpoint"}  # PR #7102's abstract methods
    assert not lifecycle & compute
    protocol_methods = {m for p in (RemoteActor, RemoteSampler) for m in vars(p) if not m.startswith("_")}
    assert protocol_methods == compute


@pytest.mark.parametrize("module", ["verl.workers.remote_client.arctic.arctic_rl", "verl.workers.remote_client.tinker.client"])
def test_built_in_adapters_register_through_register_backend_only(module):
    source = inspect.getsource(importlib.import_module(module))
    assert "RemoteBackendRegistry.register(" not in source, f"{module}: a class decorator; use register_backend"


@pytest.mark.parametrize("name", BACKENDS)
def test_worker_and_replica_are_the_generic_ones_or_subclasses(name):
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    worker, replica = RemoteBackendRegistry.get_worker(name), RemoteBackendRegistry.get_replica(name)
    assert issubclass(worker, RemoteActorRolloutRefWorker)
    assert issubclass(replica, RemoteRolloutReplica)
    assert RolloutReplicaRegistry.get(name) is replica


def test_arctic_keeps_its_documented_entry_points():
    from verl.workers.remote_client.arctic.replica import ArcticRLRolloutReplica
    from verl.workers.remote_client.arctic.worker import ArcticRLActorRolloutRefWorker

    assert RemoteBackendRegistry.get_worker("arctic") is ArcticRLActorRolloutRefWorker
    assert RemoteBackendRegistry.get_replica("arctic") is ArcticRLRolloutReplica


def _keys_without_comment(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    missing = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        above = lines[i - 1].strip() if i else ""
        if not above.startswith("#"):
            missing.append(stripped.split(":", 1)[0])
    return missing


def option_group_file(name: str) -> Path:
    """``remote_backend/<name>.yaml``: in this repository, or in the config package an installed plug-in
    names (its ``verl_remote_backend.configs`` entry point)."""
    if (GROUP_DIR / f"{name}.yaml").exists():
        return GROUP_DIR / f"{name}.yaml"
    for entry in metadata.entry_points(group=CONFIG_GROUP):
        if entry.name == name:
            return Path(str(resources.files(entry.value) / "remote_backend" / f"{name}.yaml"))
    return GROUP_DIR / f"{name}.yaml"


@pytest.mark.parametrize("name", BACKENDS)
def test_option_group_file_names_the_backend_with_a_comment_over_every_key(name):
    path = option_group_file(name)
    assert path.exists(), f"no Hydra option group file for {name}"
    assert yaml.safe_load(path.read_text(encoding="utf-8"))["name"] == name
    assert _keys_without_comment(path) == []


@pytest.mark.parametrize("name", BACKENDS)
def test_remote_backend_option_composes_to_that_backends_rollout(name):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl.remote_backend.main_ppo import CONFIG_DIR, CONFIG_NAME, register_searchpath_plugin
    from verl.remote_backend.settings import rewrite_overrides

    register_searchpath_plugin()
    overrides, _ = rewrite_overrides([f"remote_backend={name}", "actor_rollout_ref.rollout.name=vllm"],
                                     has_accelerator=False)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name=CONFIG_NAME, overrides=overrides)
    assert cfg.remote_backend.name == name
    assert cfg.actor_rollout_ref.rollout.name == name
    assert cfg.trainer.v1.trainer_mode == "remote_backend"
