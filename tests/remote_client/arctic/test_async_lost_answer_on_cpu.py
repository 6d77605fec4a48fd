"""The asynchronous mode's traffic under a lost answer: a ``/generate`` answer lost while an update runs.

In the asynchronous mode (``trainer.v1.remote_backend.async_mode=true``) the rollout server's client generates
while the worker's client trains, on the same server. Through a dropping proxy
(``tests.support.reliability.DropProxy``) in front of the reference server, treated as the vendor's (no replay
cache): the worker's client runs an update (``/forward-backward`` + ``/step``) while the rollout's client
generates, and the proxy drops the first ``/generate`` answer. The generate is re-sent with the same
``X-Request-Id`` and answers what it answers undisturbed; the update beside it is neither re-sent, settled
nor rebuilt: each of its ``/forward-backward`` and ``/step`` calls reaches the server once, and the step counter
moves by its two optimizer steps.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.reliability import DropProxy, client_config, train_batch
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

pytestmark = pytest.mark.slow

VENDOR_LIKE = {"server_idempotency": "off"}


def _greedy(client: ArcticRLClient) -> list:
    return [r.token_ids for r in client.generate([[5, 6, 7], [8, 9]], {"max_tokens": 6, "temperature": 0.0})]


def test_a_lost_generate_answer_during_an_update_is_resent_and_leaves_the_update_alone(reference_server,
                                                                                        tiny_model_dir):
    owner = ArcticRLClient.from_config(client_config(tiny_model_dir, reference_server.url))
    try:
        expected = _greedy(owner)  # the sampler's weights do not change without a weight sync
        step_before = owner.step
        with DropProxy(reference_server.port) as proxy:
            proxy.drop("POST", "/generate", 1)
            cfg = client_config(tiny_model_dir, proxy.url, retry=VENDOR_LIKE, recovery={"watch_interval_s": 0})
            handle = dict(owner.reconnect_handle(), url=proxy.url)
            trainer = ArcticRLClient.from_config(cfg, handle=handle)
            sampler = ArcticRLClient.from_config(cfg, handle=handle)
            outcome: dict = {}

            def update() -> None:
                try:
                    outcome["metrics"] = trainer.update_actor(train_batch(0))
                except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                    outcome["error"] = exc

            try:
                thread = threading.Thread(target=update)
                thread.start()
                deadline = time.monotonic() + 120
                while not [s for s in proxy.seen if s["path"] == "/forward-backward"]:
                    assert time.monotonic() < deadline and thread.is_alive(), outcome
                    time.sleep(0.005)
                got = _greedy(sampler)
                thread.join(timeout=300)
                trainer_stats, sampler_stats = trainer.reliability_stats(), sampler.reliability_stats()
                step_after = trainer.step
            finally:
                trainer.destroy()
                sampler.destroy()
            seen = list(proxy.seen)
            assert len(proxy.fired) == 1
    finally:
        owner.destroy()
    assert "error" not in outcome, outcome.get("error")
    assert got == expected
    generates = [s for s in seen if s["method"] == "POST" and s["path"] == "/generate"]
    assert len(generates) == 2 and len({s["headers"]["x-request-id"] for s in generates}) == 1
    assert sampler_stats["retries"] == 1
    updates = [s for s in seen if s["path"] in ("/forward-backward", "/step")]
    ids = [s["headers"]["x-request-id"] for s in updates]
    assert len(ids) == len(set(ids)), "an update call was re-sent"
    assert len([s for s in updates if s["path"] == "/step"]) == step_after - step_before
    assert not [s for s in seen if s["path"] in ("/initialize", "/destroy")], "a job was rebuilt"
    assert not {k: v for k, v in trainer_stats.items() if k.startswith(("recovery/ambiguous",
                                                                        "recovery/training_rebuilds")) and v}
    assert step_after == step_before + 2  # the batch's two mini-batches: two optimizer steps, each sent once
