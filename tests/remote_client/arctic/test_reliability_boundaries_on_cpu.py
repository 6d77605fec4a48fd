"""Two boundaries of recovery on a server that does not replay request ids, through a dropping proxy.

* A lost answer to a harmless call -- ``/forward``, ``/generate``, a weight sync -- is re-sent with
  the *same* ``X-Request-Id``: by the HTTP layer's own retries, or (``retry.max_attempts: 1``) by
  recovery. It is never settled by a counter nor answered by rebuilding the training job.
* A lost ``/step`` answer while the server's step counter moved by more than one (another client
  stepped the job too) or went back (a checkpoint was loaded meanwhile): recovery cannot tell whether
  the call was applied, says so, and rebuilds the training job from the checkpoint and the journal --
  so the run ends exactly where an undisturbed run ends.

The client treats the reference server as the vendor's (``retry.server_idempotency: off``): it never
relies on the server's replay cache. Real server, real client; the proxy is
``tests.support.reliability.DropProxy``.
"""

from __future__ import annotations

import logging

import pytest
import requests
import torch

from arctic_rl import dssst1
from tests.support.reliability import DropProxy, client_config, final_logprobs, train_batch
from tests.support.server import good_body, running_server
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

pytestmark = pytest.mark.slow

VENDOR_LIKE = {"server_idempotency": "off"}


@pytest.fixture(scope="module")
def owner(reference_server, tiny_model_dir):
    client = ArcticRLClient.from_config(client_config(tiny_model_dir, reference_server.url))
    try:
        yield client
    finally:
        client.destroy()


def _greedy(client: ArcticRLClient) -> list:
    return [r.token_ids for r in client.generate([[5, 6, 7], [8, 9]], {"max_tokens": 3, "temperature": 0.0})]


HARMLESS = {  # call -> (route through the proxy, what the call returns for the comparison)
    "forward": ("/forward", final_logprobs),
    "generate": ("/generate", _greedy),
    "weight_sync": ("/weight-sync", lambda c: (c.update_weights(), _greedy(c))[1]),
}


@pytest.mark.parametrize("max_attempts", [5, 1], ids=["http_retry", "recovery"])
@pytest.mark.parametrize("call", list(HARMLESS))
def test_a_lost_answer_to_a_harmless_call_is_resent_with_the_same_id(reference_server, owner, tiny_model_dir,
                                                                      call, max_attempts):
    path, do = HARMLESS[call]
    expected = do(owner)
    with DropProxy(reference_server.port) as proxy:
        proxy.drop("POST", path, 1)
        cfg = client_config(tiny_model_dir, proxy.url, retry={**VENDOR_LIKE, "max_attempts": max_attempts},
                            recovery={"watch_interval_s": 0})
        client = ArcticRLClient.from_config(cfg, handle=dict(owner.reconnect_handle(), url=proxy.url))
        try:
            got = do(client)
            stats = client.reliability_stats()
        finally:
            client.destroy()
        assert len(proxy.fired) == 1
        sent = [s for s in proxy.seen if s["method"] == "POST" and s["path"] == path]
    assert len(sent) == 2, [s["path"] for s in proxy.seen]
    ids = {s["headers"]["x-request-id"] for s in sent}
    assert len(ids) == 1, f"the re-sent {path} got a new X-Request-Id: {ids}"
    # neither settled nor rebuilt: no counter read, no job created or destroyed
    assert not [s for s in proxy.seen if s["path"].startswith("/job/")], "a harmless call was settled by a counter"
    assert not [s for s in proxy.seen if s["path"] in ("/initialize", "/destroy")], "the training job was rebuilt"
    assert not {k: v for k, v in stats.items() if k.startswith(("recovery/ambiguous", "recovery/training_rebuilds"))}
    if max_attempts == 1:
        assert stats["ambiguous"] == 1  # the HTTP layer gave up; recovery re-sent it
    else:
        assert stats["retries"] == 1
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    else:
        assert got == expected


def _post_step_directly(url: str, job: int) -> None:
    """Another client's /forward-backward and /step on the training job (the counter moves once more)."""
    body = dssst1.dumps(good_body())
    fb = requests.post(f"{url}/forward-backward?job_id={job}", data=bytes(body), timeout=300,
                       headers={"Content-Type": "application/octet-stream"})
    assert fb.status_code == 200, fb.text
    st = requests.post(f"{url}/step?job_id={job}", json={}, timeout=300)
    assert st.status_code == 200, st.text


@pytest.mark.parametrize("counter", ["jumped", "went_back"])
def test_a_step_counter_that_jumped_or_went_back_cannot_settle_the_call(tmp_path_factory, tiny_model_dir, caplog,
                                                                        counter):
    caplog.set_level(logging.WARNING, logger="verl.workers.remote_client")
    with running_server(tmp_path_factory.mktemp("server")) as srv, DropProxy(srv.port) as proxy:
        cfg = client_config(tiny_model_dir, proxy.url, retry=VENDOR_LIKE,
                            recovery={"watch_interval_s": 0, "checkpoint_every_n_steps": 0})
        client = ArcticRLClient.from_config(cfg)
        try:
            start = client.save_checkpoint(step=0, path="start")["path"]
            client.update_actor(train_batch(0))  # steps 1, 2: the undisturbed reference
            reference = final_logprobs(client)
            client.load_checkpoint(path=start)

            def meddle() -> None:  # after the server applied /step 2, before the client reads the counter
                job = client.job_ids["training"]
                if counter == "jumped":
                    _post_step_directly(srv.url, job)  # 1 -> 3
                else:
                    loaded = requests.post(f"{srv.url}/load-checkpoint?job_id={job}", json={"path": start}, timeout=300)
                    assert loaded.status_code == 200, loaded.text  # 2 -> 0

            proxy.counts.clear()
            proxy.drop("POST", "/step", 2, "drop_response", callback=meddle)
            client.update_actor(train_batch(0))
            assert len(proxy.fired) == 1
            stats = client.reliability_stats()
            assert stats["recovery/training_rebuilds"] == 1, stats
            assert not stats.get("recovery/ambiguous_applied") and not stats.get("recovery/ambiguous_resent"), stats
            said = "global_step is 3 (was 1" if counter == "jumped" else "global_step is 0 (was 1"
            assert said in caplog.text and "cannot tell" in caplog.text, caplog.text
            assert client.step == 2
            info = requests.get(f"{srv.url}/job/{client.job_ids['training']}", timeout=30).json()
            assert info["global_step"] == 2 and info["pending_forward_backward"] == 0
            got = final_logprobs(client)
            assert torch.equal(got, reference), (got - reference).abs().max()
        finally:
            client.destroy()
