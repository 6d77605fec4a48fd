"""Unanswered calls are applied exactly once: dropped answers, dropped requests, with and without
server-side idempotency (real reference server, real ArcticRLClient, a dropping TCP proxy).

The proxy (``tests.support.reliability.DropProxy``) drops the *answer* of chosen ``/forward-backward`` and
``/step`` calls after the server applied them, or drops the *request* before the server saw it. The
client cannot tell the two apart. The run's final weights -- read as ``/forward`` log-probs of a
fixed batch -- must equal those of an undisturbed run bit for bit, and the server's step counter
must equal the number of steps asked for:

* against a server that replays ``X-Request-Id`` (ours), the HTTP layer re-sends with the same id
  and the server answers from its cache;
* with ``retry.server_idempotency: off`` (how the vendor's server is treated), the client reads the
  server's ``global_step`` / ``pending_forward_backward`` to decide whether to re-send;
* with recovery disabled, an unanswered ``/forward-backward`` is an error, never a silent re-send.

Every run starts from the same saved state (``/load-checkpoint`` of a step-0 checkpoint), so one set
of jobs serves all runs.
"""

from __future__ import annotations

import copy

import pytest
import requests
import torch

from arctic_rl import dssst1
from tests.support.reliability import DropProxy, client_config, final_logprobs, train_batch
from tests.support.server import make_batch
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient
from verl.workers.remote_client.arctic.http import AmbiguousCallError

pytestmark = pytest.mark.slow

UPDATES = 2  # update_actor calls per run: 2 steps each, one /forward-backward per step


@pytest.fixture(scope="module")
def setup(reference_server, tiny_model_dir):
    owner = ArcticRLClient.from_config(client_config(tiny_model_dir, reference_server.url))
    try:
        start = owner.save_checkpoint(step=0, path="start")["path"]
        yield reference_server, tiny_model_dir, owner, start
    finally:
        owner.destroy()


def run(setup, url: str, proxy: DropProxy | None = None, **remote) -> tuple[torch.Tensor, ArcticRLClient]:
    """Reset to the start state, then UPDATES update_actor calls through a client attached at ``url``."""
    _srv, model, owner, start = setup
    owner.load_checkpoint(path=start)
    handle = dict(owner.reconnect_handle(), url=url)
    cfg = client_config(model, url, **remote)
    client = ArcticRLClient.from_config(cfg, handle=handle)
    try:
        for i in range(UPDATES):
            client.update_actor(train_batch(i))
        if proxy is not None:
            proxy.rules.clear()
        return final_logprobs(client), client
    finally:
        client.destroy()  # attached: owns no job; stops its watcher


def job_info(srv, job_id):
    return requests.get(f"{srv.url}/job/{job_id}", timeout=30).json()


def test_dropped_answers_and_requests_are_applied_exactly_once(setup, caplog):
    srv, _model, owner, start = setup
    training = owner.job_ids["training"]
    reference, _ = run(setup, srv.url)
    assert job_info(srv, training)["global_step"] == 2 * UPDATES

    # sanity: the weights moved, so an extra or a missing step would show
    owner.load_checkpoint(path=start)
    untrained = final_logprobs(owner)
    assert (untrained - reference).abs().max() > 1e-3

    # 1) the server replays X-Request-Ids: the HTTP layer re-sends with the same id
    with DropProxy(srv.port) as proxy:
        proxy.drop("POST", "/forward-backward", 2)
        proxy.drop("POST", "/step", 1)
        proxy.drop("POST", "/forward-backward", 5, "drop_request")
        proxy.drop("POST", "/step", 3)
        got, client = run(setup, proxy.url, proxy)
        assert len(proxy.fired) == 4
        assert torch.equal(got, reference), (got - reference).abs().max()
        assert job_info(srv, training)["global_step"] == 2 * UPDATES
        stats = client.reliability_stats()
        assert stats["replayed"] == 3  # the three calls whose answers were dropped, answered from the cache
        assert stats["retries"] == 4
        posts = [p for p in proxy.mutating() if p["path"] in ("/forward-backward", "/step")]
        assert len(posts) == UPDATES * 2 * 2 + 4  # 8 calls (2 x (fwd-bwd + step) per update) + 4 re-sends
        for p in posts:
            assert p["headers"]["x-request-id"] and p["headers"]["x-arctic-step"].isdigit()
        ids = [p["headers"]["x-request-id"] for p in posts]
        assert len(set(ids)) == 8  # every re-send kept its call's id
        assert [int(p["headers"]["x-arctic-step"]) for p in posts if p["path"] == "/step"] == [0, 0, 1, 1, 2, 3]

    # 2) the server's replay cache is not used (vendor behaviour): its counters decide
    caplog.clear()
    with DropProxy(srv.port) as proxy:
        proxy.drop("POST", "/forward-backward", 2)  # applied -> pending_forward_backward says so
        proxy.drop("POST", "/step", 1)  # applied -> global_step says so
        proxy.drop("POST", "/forward-backward", 4, "drop_request")  # not applied -> re-sent
        proxy.drop("POST", "/step", 3, "drop_request")  # not applied -> re-sent
        got, client = run(setup, proxy.url, proxy, retry={"server_idempotency": "off"})
        assert len(proxy.fired) == 4
        assert torch.equal(got, reference), (got - reference).abs().max()
        assert job_info(srv, training)["global_step"] == 2 * UPDATES
        stats = client.reliability_stats()
        assert stats.get("replayed", 0) == 0
        assert stats["recovery/ambiguous_applied"] == 2 and stats["recovery/ambiguous_resent"] == 2
        assert client.step == 2 * UPDATES
        text = caplog.text
        assert "global_step is 1 (was 0 before the call) -> it was applied; not re-sending" in text
        assert "pending_forward_backward is 0 (was 0 before the call) -> it was not applied; re-sending" in text

    # 3) recovery off: an unanswered /forward-backward is an error, not a guess
    with DropProxy(srv.port) as proxy:
        proxy.drop("POST", "/forward-backward", 1)
        with pytest.raises(AmbiguousCallError, match="may or may not have been applied"):
            run(setup, proxy.url, proxy, retry={"server_idempotency": "off"}, recovery={"enable": False})
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200


def test_request_ids_replay_and_conflict_on_the_server(setup):
    """The server side of the contract: a replayed id is answered from the cache (nothing re-applied),
    the same id with another payload is a 409, a new id applies again."""
    srv, _model, owner, start = setup
    owner.load_checkpoint(path=start)
    training = owner.job_ids["training"]
    batch = make_batch([[5, 6, 7], [8, 9]], [[10, 11, 12], [13]])
    batch["advantages"] = torch.ones(batch["input_ids"].shape) * batch["response_mask"]
    batch["old_log_probs"] = torch.full(batch["input_ids"].shape, -4.0) * batch["response_mask"]
    body = {"batch": batch, "meta": {"temperature": 1.0}, "processing": {"loss_fn": "grpo"}}
    other = copy.deepcopy(body)
    other["batch"]["advantages"] = -other["batch"]["advantages"]
    url = f"{srv.url}/forward-backward?job_id={training}"

    def post(obj, rid):
        return requests.post(url, data=bytes(dssst1.dumps(obj)), timeout=120,
                             headers={"Content-Type": "application/octet-stream", "X-Request-Id": rid})

    first = post(body, "rid-1")
    replay = post(body, "rid-1")
    assert first.status_code == replay.status_code == 200
    assert replay.headers.get("X-Idempotent-Replay") == "true" and replay.content == first.content
    assert job_info(srv, training)["pending_forward_backward"] == 1  # applied once
    conflict = post(other, "rid-1")
    assert conflict.status_code == 409 and conflict.json()["detail"]["field"] == "X-Request-Id"
    again = post(body, "rid-2")  # a new id is a new call: one /forward-backward per /step refuses the double count
    assert again.status_code == 400 and again.json()["detail"]["field"] == "ds_config.gradient_accumulation_steps"
    assert job_info(srv, training)["pending_forward_backward"] == 1
    owner.load_checkpoint(path=start)  # discards the accumulated gradients
    assert job_info(srv, training)["pending_forward_backward"] == 0
