"""Recovery is re-entrant against the vendor's servers: a lost answer while recovering is recovered too.

The vendor's servers (v2: the Arctic-Platform snapshot of the shared kit; v1: PyPI ``arctic-platform``
0.1.2) neither replay ``X-Request-Id``s nor expose counters, and hold one job per type. A dropping
proxy (``tests.support.reliability.DropProxy``) in front of them forwards a chosen request, lets the server
apply it and drops its answer, so the adapter cannot know whether the call was applied and rebuilds
the training job from the journal (a fresh job replaying every acknowledged call). The faults hit each
position of an update -- its first and second ``/forward-backward``, its ``/step`` -- and the rebuild's
own replay (its first ``/forward-backward``, its first ``/step``): a lost answer there starts the
rebuild over.

Each run (2 updates of 2 mini-batches: 4 optimizer steps) must end where an undisturbed run on the
same server ends: the same ``/forward`` log-probs of a fixed batch and the vendor's own step count 4
(v2: its ``/save`` answer; v1: the engine's count in the server's trace). Along the way the adapter
never asks for a job it still holds (every ``/initialize`` answered 200, never the vendor's 409) and
never mistakes the training job it replaced itself for a server restart (no restore, no "the server ...
restarted (...)" in the log, although a 0.2 s watcher runs throughout). A rebuild whose every attempt
loses an answer gives up after ``MAX_ATTEMPTS`` with an error naming each attempt, leaving no half-built job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import pytest
import requests
import torch

from tests.support.reliability import DropProxy, client_config, final_logprobs, train_batch
from tests.support.vendor import (  # the vendor servers' launchers and where their code is found
    VendorServer,
    running_vendor_server,
    running_vendor_v1_server,
)
from verl.remote_backend.errors import RemoteBackendError
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient
from verl.workers.remote_client.arctic.restore import MAX_ATTEMPTS

pytestmark = pytest.mark.slow

UPDATES = 2  # update_actor calls per run; each is 2 mini-batches: /forward-backward, /step, /forward-backward, /step


@dataclass
class Vendor:
    """A running vendor server of one wire generation, and its undisturbed run (computed once)."""

    protocol: str
    server: VendorServer
    fb_path: str
    baseline: torch.Tensor | None = None
    untrained: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.server.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module", params=["v2", "v1"])
def vendor(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"vendor_{request.param}")
    kit = request.getfixturevalue("vendor_kit")
    if request.param == "v2":
        ctx, fb_path = running_vendor_server(kit, request.getfixturevalue("vendor_src"), workdir), "/forward-backward"
    else:
        ctx, fb_path = running_vendor_v1_server(kit, request.getfixturevalue("vendor_v1_src"), workdir), "/fwd-bwd"
    with ctx as server:
        yield Vendor(request.param, server, fb_path)


def config(vendor: Vendor, model_dir, url: str):
    return client_config(model_dir, url, server={"protocol": vendor.protocol},
                         train={"attn_implementation": "flash_attention_2"},
                         recovery={"watch_interval_s": 0.2, "wait_s": 120})


def vendor_step(vendor: Vendor, client: ArcticRLClient) -> int:
    """The vendor's own optimizer step count of the run's training job."""
    if vendor.protocol == "v2":
        return int(client.save_checkpoint()["global_step"])
    deadline = time.monotonic() + 10  # v1: the engine's count, traced with each exchange
    while True:
        rows = [r for r in vendor.server.trace_lines() if r.get("global_steps") is not None]
        if rows or time.monotonic() > deadline:
            return rows[-1]["global_steps"] if rows else -1
        time.sleep(0.05)


def run(vendor: Vendor, model_dir, proxy: DropProxy | None = None) -> tuple[torch.Tensor, int, dict]:
    """A fresh client (its own jobs), UPDATES updates, then the trained log-probs and the vendor's step."""
    client = ArcticRLClient.from_config(config(vendor, model_dir, proxy.url if proxy else vendor.server.url))
    try:
        if vendor.untrained is None:
            vendor.untrained = final_logprobs(client)
        for i in range(UPDATES):
            client.update_actor(train_batch(i))
        if proxy is not None:
            proxy.rules.clear()
        step = vendor_step(vendor, client)
        assert client.step == 2 * UPDATES
        return final_logprobs(client), step, client.reliability_stats()
    finally:
        client.destroy()


def baseline(vendor: Vendor, model_dir) -> torch.Tensor:
    if vendor.baseline is None:
        got, step, _ = run(vendor, model_dir)
        assert step == 2 * UPDATES
        assert (got - vendor.untrained).abs().max() > 1e-3  # the weights moved: a step applied twice would show
        vendor.baseline = got
    return vendor.baseline


#: fault -> the answers dropped, as (route, n-th call of that route through the proxy). The original calls
#: are /forward-backward 1-4 and /step 1-4; a rebuild after a fault at /forward-backward 3 replays the
#: journal (2 steps) as /forward-backward 4, 5 and /step 3, 4 before the lost call is sent again.
FAULTS = {
    "first_fb": [("fb", 3)],
    "second_fb": [("fb", 4)],
    "step": [("step", 3)],
    "replay_first_fb": [("fb", 3), ("fb", 4)],
    "replay_first_step": [("fb", 3), ("step", 3)],
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_lost_answer_while_recovering_ends_like_an_undisturbed_run(vendor, tiny_model_dir, fault, caplog):
    reference = baseline(vendor, tiny_model_dir)
    caplog.set_level(logging.INFO, logger="verl.workers.remote_client")
    initialized = len(vendor.server.trace_lines("/initialize"))
    with DropProxy(vendor.port) as proxy:
        for route, nth in FAULTS[fault]:
            proxy.drop("POST", vendor.fb_path if route == "fb" else "/step", nth)
        got, step, stats = run(vendor, tiny_model_dir, proxy)
        assert len(proxy.fired) == len(FAULTS[fault])
    assert step == 2 * UPDATES, "the vendor's step count differs from an undisturbed run's"
    assert torch.allclose(got, reference, rtol=0, atol=1e-6), (got - reference).abs().max()
    # one rebuild per original lost answer; a lost answer during its replay made it start over once
    during_replay = fault.startswith("replay_")
    assert stats["recovery/training_rebuilds"] == 1
    assert stats.get("recovery/rebuild_interrupted", 0) == int(during_replay)
    assert stats.get("recovery/restores", 0) == 0
    restart_lines = [r.getMessage() for r in caplog.records
                     if "restarted (" in r.getMessage() or "recovered from a server restart" in r.getMessage()]
    assert not restart_lines, restart_lines
    # never a job the client still holds: every /initialize at the vendor succeeded
    statuses = [r["status"] for r in vendor.server.trace_lines("/initialize")[initialized:]]
    assert statuses and all(s == 200 for s in statuses), statuses
    assert len(statuses) == 3 + 1 + int(during_replay)  # the run's 3 jobs, the rebuilt one, the restarted build


def test_a_rebuild_that_keeps_losing_answers_gives_up_with_a_clear_error(vendor, tiny_model_dir):
    """The lost /forward-backward 3, then the first replayed /forward-backward of every rebuild attempt."""
    with DropProxy(vendor.port) as proxy:
        for nth in range(3, 3 + 1 + MAX_ATTEMPTS):
            proxy.drop("POST", vendor.fb_path, nth)
        client = ArcticRLClient.from_config(config(vendor, tiny_model_dir, proxy.url))
        try:
            client.update_actor(train_batch(0))
            with pytest.raises(RemoteBackendError, match=f"in {MAX_ATTEMPTS} attempts") as err:
                client.update_actor(train_batch(1))
            assert str(err.value).count("attempt ") >= MAX_ATTEMPTS and "resume it from its last checkpoint" in \
                str(err.value)
            assert client.reliability_stats()["recovery/rebuild_interrupted"] == MAX_ATTEMPTS
        finally:
            client.destroy()
        assert len(proxy.fired) == 1 + MAX_ATTEMPTS
    jobs = requests.get(f"{vendor.server.url}/status", timeout=30).json()["jobs"]
    assert jobs == {}, f"jobs left on the vendor server: {jobs}"  # no half-built job, none of the run's
