"""Plug-in discovery and its errors, with installed-distribution metadata written into a temp dir.

Each case puts ``<name>-<version>.dist-info`` folders (``METADATA`` + ``entry_points.txt``, what pip
installs) and, where needed, the plug-in's module on ``sys.path``, then calls
:func:`verl.remote_backend.plugins.load_plugins` -- ``importlib.metadata`` finds them as it finds
any installed distribution. The full route (a package built and pip-installed, a GRPO run with it) is
``test_plugin_backend_on_cpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import verl.remote_backend.builtin  # noqa: F401  (the built-in backends, as in every process)
from verl.remote_backend import plugins
from verl.remote_backend.base import RemoteBackendRegistry
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.plugins import BACKEND_GROUP, CONFIG_GROUP, load_plugins, register_backend

BUILTIN = frozenset({"arctic", "tinker"})


def install(site: Path, dist: str, version: str, entries: dict[str, dict[str, str]],
            modules: dict[str, str] | None = None) -> None:
    """What pip leaves behind for a distribution: its dist-info folder (and its modules)."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = []
    for group, points in entries.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in points.items())
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in (modules or {}).items():
        (site / f"{module}.py").write_text(source)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh sys.path entry; whatever a case registers is removed from the registries afterwards."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(RemoteBackendRegistry.list())
    yield tmp_path
    for name in set(RemoteBackendRegistry.list()) - before:
        for table in (RemoteBackendRegistry._backends, RemoteBackendRegistry._workers, RemoteBackendRegistry._replicas):
            table.entries.pop(name, None)
        for kind in ("worker", "replica"):
            RemoteBackendRegistry._loaded.pop((kind, name), None)
        RolloutReplicaRegistry._registry.pop(name, None)
        plugins._loaded_plugins.pop(name, None)


PLUGIN_MODULE = '''
from verl.remote_backend.plugins import register_backend
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

calls = []


def register():
    calls.append(1)
    register_backend("{name}", ArcticRLClient,
                     worker="verl.workers.remote_client.arctic.worker:ArcticRLActorRolloutRefWorker",
                     replica="verl.workers.remote_client.arctic.replica:ArcticRLRolloutReplica")
'''


def test_an_installed_plugin_is_registered_once_with_its_config_package(site):
    import importlib

    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from verl.workers.remote_client.arctic.replica import ArcticRLRolloutReplica

    install(site, "vendor-three", "0.2", {BACKEND_GROUP: {"three": "three_plugin:register"},
                                          CONFIG_GROUP: {"three": "three_plugin_config"}},
            {"three_plugin": PLUGIN_MODULE.format(name="three")})
    assert load_plugins(BUILTIN) == ["three"]
    assert load_plugins(BUILTIN) == ["three"]  # idempotent: the callable ran once
    assert importlib.import_module("three_plugin").calls == [1]
    assert RemoteBackendRegistry.list() == ["arctic", "three", "tinker"]
    assert RemoteBackendRegistry.get_replica("three") is RolloutReplicaRegistry.get("three") is ArcticRLRolloutReplica
    assert "three_plugin_config" in plugins.config_packages()


def test_two_distributions_claiming_one_name_are_both_named(site):
    install(site, "vendor-a", "1.0", {BACKEND_GROUP: {"same": "a_plugin:register"}})
    install(site, "vendor-b", "2.0", {BACKEND_GROUP: {"same": "b_plugin:register"}})
    with pytest.raises(RemoteBackendConfigError) as err:
        load_plugins(BUILTIN)
    text = str(err.value)
    assert "vendor-a 1.0" in text and "vendor-b 2.0" in text and "'same'" in text
    assert err.value.field == f"entry point {BACKEND_GROUP}:same"
    assert "same" not in RemoteBackendRegistry.list()


def test_a_plugin_failing_to_import_names_its_distribution(site):
    install(site, "broken-vendor", "0.3", {BACKEND_GROUP: {"broken": "no_such_module_for_verl:register"}})
    with pytest.raises(RemoteBackendConfigError) as err:
        load_plugins(BUILTIN)
    text = str(err.value)
    assert "broken-vendor 0.3" in text and "failed to import" in text and "ModuleNotFoundError" in text
    assert err.value.received == "no_such_module_for_verl:register"


def test_a_plugin_failing_to_register_names_its_distribution(site):
    install(site, "raising-vendor", "1.1", {BACKEND_GROUP: {"raises": "raising_plugin:register"}},
            {"raising_plugin": "def register():\n    raise RuntimeError('no licence key')\n"})
    with pytest.raises(RemoteBackendConfigError, match=r"raising-vendor 1\.1 failed to register .*no licence key"):
        load_plugins(BUILTIN)


def test_a_plugin_that_registers_another_name_is_refused(site):
    install(site, "misnamed-vendor", "1.0", {BACKEND_GROUP: {"wanted": "misnamed_plugin:register"}},
            {"misnamed_plugin": PLUGIN_MODULE.format(name="other")})
    with pytest.raises(RemoteBackendConfigError, match="registered no backend under its entry-point name"):
        load_plugins(BUILTIN)


def test_a_plugin_may_not_take_a_built_in_name(site):
    install(site, "squatter", "0.1", {BACKEND_GROUP: {"arctic": "squat:register"}})
    with pytest.raises(RemoteBackendConfigError, match="squatter 0.1 claims 'arctic', the name of a built-in backend"):
        load_plugins(BUILTIN)


def test_register_backend_refuses_bad_references_and_verls_own_engine_names(site):
    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

    with pytest.raises(RemoteBackendConfigError) as err:
        register_backend("badref", ArcticRLClient, worker="no_colon_here")
    assert err.value.field == "register_backend('badref').worker" and err.value.received == "no_colon_here"
    with pytest.raises(ValueError, match="taken by verl's own rollout engine"):
        register_backend("vllm", ArcticRLClient)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("arctic", type("Other", (ArcticRLClient,), {}))
    register_backend("arctic", ArcticRLClient, worker="verl.workers.remote_client.arctic.worker:"
                     "ArcticRLActorRolloutRefWorker", replica="verl.workers.remote_client.arctic.replica:"
                     "ArcticRLRolloutReplica")  # the built-in registration again: a no-op
