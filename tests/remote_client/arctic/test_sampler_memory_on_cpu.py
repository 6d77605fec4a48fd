"""The Arctic adapter's sampler sleep (``verl.workers.remote_client.arctic.sampler_memory``) against the reference
server: ``sleep_sampler`` / ``wake_sampler`` reach the sampling job (its ``/job`` info says what sleeps), a weight
sync on a sleeping sampler wakes its weights first, and a server that does not list ``sampler_sleep`` (the
vendor's) is never sent the calls."""

from __future__ import annotations

import pytest
import requests

import verl.remote_backend.builtin  # noqa: F401  (registers the built-in backends)
from arctic_rl.protocol import Features, JobType
from tests.support.reliability import client_config
from tests.support.server import running_server
from verl.remote_backend import RemoteBackendRegistry
from verl.remote_backend.protocols import SamplerSleep


def _asleep(url: str, client) -> list[str]:
    info = requests.get(f"{url}/job/{client.job_ids[JobType.SAMPLING.value]}", timeout=30).json()
    return sorted(info.get("asleep", info.get("info", {}).get("asleep", [])))


@pytest.mark.slow
def test_sleep_and_wake_reach_the_sampling_job(tmp_path_factory, tiny_model_dir):
    with running_server(tmp_path_factory.mktemp("sleep_srv")) as srv:
        client = RemoteBackendRegistry.create("arctic", client_config(tiny_model_dir, srv.url, run_dir="sleep_run"))
        try:
            assert isinstance(client, SamplerSleep) and Features.SAMPLER_SLEEP in client.features
            assert client._memory.sleep_between_phases  # free_cache_engine (verl's default), sync mode
            assert _asleep(srv.url, client) == []
            assert client.sleep_sampler(1)["released_bytes"] == 0  # the server's allocator figure (none on a CPU)
            assert _asleep(srv.url, client) == ["kv_cache", "weights"]
            assert client.update_weights()["released_bytes"] == 0  # wakes the weights before the sync; none on a CPU
            assert _asleep(srv.url, client) == ["kv_cache"]
            client.wake_sampler(None)
            assert _asleep(srv.url, client) == []
            client.wake_sampler(None)  # waking an awake sampler is a no-op
            out = client.generate([[1, 2, 3]], {"max_tokens": 2, "temperature": 1.0, "logprobs": True})
            assert len(out) == 1
        finally:
            client.destroy()


def test_a_server_without_the_feature_is_not_called():
    from verl.remote_backend.workers.sampler_sleep import SKIPPED
    from verl.workers.remote_client.arctic.sampler_memory import SamplerMemory

    class _State:
        features = frozenset({"token_prompts"})

    class _Calls:
        def call(self, request):
            raise AssertionError(f"no call expected, got {request.what}")

    memory = SamplerMemory(_Calls(), _State(), sleep_between_phases=True)
    assert memory.sleep(1) == {SKIPPED: True}  # the rollout server's sign of a sampler kept resident
    assert memory.wake(None) == {SKIPPED: True}
    assert memory.before_weight_sync() is None  # nothing sent, nothing released


def test_the_servers_released_bytes_become_the_generic_field():
    from verl.remote_backend.workers.sampler_sleep import RELEASED
    from verl.workers.remote_client.arctic.sampler_memory import with_released

    answer = {"job_id": 3, "sampling": {"status": "sleeping", "allocator_released_bytes": 2048}}
    assert with_released(answer) == {**answer, RELEASED: 2048}
    vendor = {"job_id": 3, "sampling": {"status": "sleeping"}}  # no such field: nothing added
    assert with_released(vendor) == vendor and with_released({}) == {}
