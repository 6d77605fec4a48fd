"""``ArcticRLActorRolloutRefWorker``: the backend context, checkpoint markers and (slow) the worker
in a real Ray worker group forwarding to the real reference server through a real ArcticRLClient.

The slow test compares every forwarded call with the same call made directly on the driver's
adapter: forwarding must not change a number.
"""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from omegaconf import OmegaConf

from verl.remote_backend.context import BackendContext, install_context, read_context
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.workers.worker import CHECKPOINT_MARKER, attach_rollout_server, checkpoint_step
from verl.workers.remote_client.arctic.worker import ArcticRLActorRolloutRefWorker

N = 2  # rollout.n
MINI = 2  # ppo_mini_batch_size (prompts): 4 rows per optimizer step


def _worker_env(monkeypatch):
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)


def _main_config(extra: dict | None = None):
    return OmegaConf.create({
        "remote_backend": {"name": "arctic", "server": {"url": "http://127.0.0.1:1"}},
        "trainer": {"default_local_dir": "x"},
        "actor_rollout_ref": {"rollout": {"name": "arctic", "custom": None, "prompt_length": 8}, "model": {"path": "m"}},
        **(extra or {}),
    })


# ------------------------------------------------------------------ context & small pieces
def test_context_round_trips_through_the_rollout_node_without_the_recursion():
    cfg = _main_config()
    installed = install_context(cfg, name="arctic", handle={"url": "http://h:1", "job_ids": {"training": 3}})
    found = read_context(cfg.actor_rollout_ref)  # what the worker receives
    assert found == read_context(cfg) == read_context(OmegaConf.to_container(cfg.actor_rollout_ref.rollout))
    assert found.handle == {"url": "http://h:1", "job_ids": {"training": 3}} and found.name == "arctic"
    assert isinstance(cfg.actor_rollout_ref.rollout.custom.remote_backend.main_config, str)  # inert for Hydra
    snapshot = installed.main_config_node()
    assert snapshot.remote_backend.server.url == "http://127.0.0.1:1"
    assert snapshot.actor_rollout_ref.rollout.custom is None  # the context does not contain itself
    install_context(cfg, name="arctic", handle={"url": "http://h:2", "job_ids": {}})  # refresh replaces
    assert read_context(cfg).handle["url"] == "http://h:2"


def test_missing_context_is_a_clear_error(monkeypatch):
    _worker_env(monkeypatch)
    with pytest.raises(RemoteBackendConfigError, match="remote-backend trainer"):
        ArcticRLActorRolloutRefWorker(_main_config().actor_rollout_ref, role="actor_rollout_ref")
    with pytest.raises(RemoteBackendConfigError, match="incomplete"):
        BackendContext.from_mapping({"name": "arctic"})


def test_unknown_role_is_refused_by_name(monkeypatch):
    _worker_env(monkeypatch)
    cfg = _main_config()
    install_context(cfg, name="arctic", handle={"url": "u"})
    with pytest.raises(RemoteBackendConfigError, match="role"):
        ArcticRLActorRolloutRefWorker(cfg.actor_rollout_ref, role="critic")


def test_rollout_servers_are_attached_through_verls_worker_dict(monkeypatch):
    _worker_env(monkeypatch)
    cfg = _main_config()
    install_context(cfg, name="arctic", handle={"url": "u"})
    worker = ArcticRLActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")

    class Holder:  # the shape of verl's colocated WorkerDict: {role: worker}
        worker_dict: ClassVar[dict] = {"actor_rollout_ref": worker, "other": object()}

    assert attach_rollout_server(Holder(), "server-a") == 1
    assert attach_rollout_server(worker, "server-a") == 1  # idempotent, and works on a bare worker
    assert worker._rollout_servers == ["server-a"]


def test_memory_released_as_a_weight_sync_wakes_the_sampler_is_reported_once(monkeypatch):
    import asyncio

    from verl.remote_backend.workers.sampler_sleep import RELEASED, RELEASED_METRIC

    _worker_env(monkeypatch)
    cfg = _main_config()
    install_context(cfg, name="arctic", handle={"url": "u"})
    worker = ArcticRLActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    answers = [{RELEASED: 3 << 30}, {RELEASED: 1 << 30}, {}]

    class Backend:  # a backend that says what its server released as the weights woke (the Arctic client's answer)
        def update_weights(self):
            return answers.pop(0)

    worker._backend = Backend()
    asyncio.run(worker.update_weights(global_steps=None))
    asyncio.run(worker.update_weights(global_steps=None))
    timings = worker.collect_phase_timings()
    assert timings[RELEASED_METRIC] == float(4 << 30) and timings["update_weights/adapter"] >= 0
    asyncio.run(worker.update_weights(global_steps=None))  # says nothing: no figure, not a zero
    assert RELEASED_METRIC not in worker.collect_phase_timings()


def test_compute_calls_are_timed_around_verls_bridge_and_keep_their_registration(monkeypatch):
    import time

    from tensordict import TensorDict
    from verl.single_controller.base.decorator import MAGIC_ATTR

    _worker_env(monkeypatch)
    cfg = _main_config()
    install_context(cfg, name="arctic", handle={"url": "u"})
    worker = ArcticRLActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    for name in ("compute_log_prob", "compute_ref_log_prob", "update_actor"):  # verl binds these by the attribute
        assert getattr(type(worker), name).__dict__[MAGIC_ATTR]["blocking"] is True, name

    class Backend:  # the adapter's compute: 50 ms each
        def compute_log_prob(self, data):
            time.sleep(0.05)
            return data

        update_actor = compute_log_prob

    worker._backend = Backend()
    batch = TensorDict({"x": torch.zeros(4, 3)}, batch_size=[4])
    worker.compute_log_prob(batch)
    worker.update_actor(batch)
    worker.update_actor(batch)
    timings = worker.collect_phase_timings()
    for phase, calls in (("old_log_prob", 1), ("update_actor", 2)):
        assert timings[f"{phase}/worker"] >= timings[f"{phase}/adapter"] >= 0.05 * calls, (phase, timings)
    assert "ref/worker" not in timings and worker.collect_phase_timings() == {}  # drained


def test_checkpoint_step_from_marker_or_path(tmp_path):
    folder = tmp_path / "global_step_7" / "actor"
    assert checkpoint_step(str(folder)) == 7
    folder.mkdir(parents=True)
    (folder / CHECKPOINT_MARKER).write_text(json.dumps({"global_step": 9}))
    assert checkpoint_step(str(folder)) == 9
    with pytest.raises(RemoteBackendConfigError, match="global_step_<N>"):
        checkpoint_step(str(tmp_path / "elsewhere"))


# ------------------------------------------------------------------ the real thing
@pytest.mark.slow
def test_worker_group_forwards_every_call_unchanged(tmp_path, tiny_model_dir):
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from tests.support.arctic import grpo_rows, legacy_batch, start_ray, verl_main_config
    from tests.support.server import running_server
    from verl.remote_backend.lifecycle import BackendOwner
    from verl.remote_backend.trainer import CpuResourcePoolManager

    with running_server(tmp_path / "srv") as srv:
        cfg = verl_main_config({
            "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 8},
            "trainer": {"default_local_dir": str(tmp_path / "run")},
            "actor_rollout_ref": {
                "rollout": {"n": N, "temperature": 1.0, "name": "arctic"},
                "actor": {"ppo_mini_batch_size": MINI, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1,
                          "optim": {"lr": 5e-3}, "use_kl_loss": True, "kl_loss_coef": 0.01, "shuffle": False},
            },
            "remote_backend": {"server": {"url": srv.url}, "train": {"deepspeed": {"bf16": False}}},
        }, model_path=str(tiny_model_dir))
        prompts, responses = grpo_rows(0, [4, 7], n=N, interleave=True)
        data = legacy_batch(prompts, responses, p0=9, r0=8)
        tu.assign_non_tensor(data, calculate_entropy=True, temperature=1.0)

        with BackendOwner.create(cfg) as owner:
            direct = owner.backend
            start_ray(num_cpus=3, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            try:
                pools = CpuResourcePoolManager(resource_pool_spec={"global_pool": [1]}, mapping={}, max_colocate_count=1)
                pools.create_resource_pool()
                cls = RayClassWithInitArgs(cls=ray.remote(ArcticRLActorRolloutRefWorker), config=cfg.actor_rollout_ref,
                                           role="actor_rollout_ref")
                wg = RayWorkerGroup(resource_pool=pools.resource_pool_dict["global_pool"], ray_cls_with_init=cls,
                                    device_name="cpu")
                wg.init_model()

                old = wg.compute_log_prob(data)
                assert torch.equal(old["log_probs"].offsets(), data["input_ids"].offsets())
                assert torch.allclose(old["log_probs"].values(), direct.compute_log_prob(data)["log_probs"].values())
                assert "entropy" in old.keys() and "mfu" in tu.get(old, "metrics")  # noqa: SIM118 - a TensorDict refuses `in`
                ref = wg.compute_ref_log_prob(data)
                assert torch.allclose(ref["log_probs"].values(), direct.compute_ref_log_prob(data)["log_probs"].values())

                data["old_log_probs"] = no_padding_2_padding(old["log_probs"], data).float()
                data["ref_log_prob"] = no_padding_2_padding(ref["log_probs"], data).float()
                tu.assign_non_tensor(data, global_batch_size=MINI * N, mini_batch_size=MINI * N, epochs=1, seed=1,
                                     dataloader_kwargs={"shuffle": False})
                metrics = tu.get(wg.update_actor(data), "metrics")
                # named like verl's own worker returns them (its trainer adds the "actor/" prefix where missing)
                for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "grad_norm", "lr", "mfu"):
                    assert name in metrics, f"{name} missing from {sorted(metrics)}"
                trained = wg.compute_log_prob(data)["log_probs"].values()
                assert not torch.allclose(trained, old["log_probs"].values())  # the remote actor learned

                ray.get(wg.update_weights(global_steps=1, mode="naive"))  # wakes the sleep-ready sampler's weights
                ckpt = tmp_path / "ckpt" / "global_step_1" / "actor"
                wg.save_checkpoint(str(ckpt), None, 1, max_ckpt_to_keep=None)
                marker = json.loads((ckpt / CHECKPOINT_MARKER).read_text())
                assert marker["global_step"] == 1 and marker["backend"] == "arctic"

                # each phase's seconds split into the worker's, HTTP's and the server's own (Server-Timing)
                timings = wg.collect_phase_timings()[0]
                for phase in ("old_log_prob", "ref", "update_actor", "update_weights"):
                    adapter, http, server = (timings[f"{phase}/{part}"] for part in ("adapter", "http", "server"))
                    assert 0 < server <= http <= adapter, (phase, timings)
                assert timings["gen/sampler_released_bytes"] == 0.0  # the server's figure (a CPU releases none)
                assert wg.collect_phase_timings()[0] == {}  # collected once

                wg.update_actor(data)  # move on, then come back
                assert not torch.allclose(wg.compute_log_prob(data)["log_probs"].values(), trained)
                wg.load_checkpoint(str(ckpt))
                assert torch.allclose(wg.compute_log_prob(data)["log_probs"].values(), trained, atol=1e-6)
            finally:
                ray.shutdown()
