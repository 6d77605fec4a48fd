"""The training contract of the Arctic adapter (``ArcticRLClient``), checked on three servers.

One module, parametrised over the server the adapter talks to:

* ``ours``: the reference server (``python -m arctic_rl.server``), fp32, with the adapter's default
  ``remote_backend`` config; its ``GET /job`` shows the accumulation settings and counters;
* ``vendor-v2``: the vendor's own Arctic-Platform v2 server (pinned snapshot, served on CPU by the
  shared kit) with the adapter's default config (bf16, ZeRO-1); its trace shows every exchange;
* ``vendor-v1``: the vendor's v1 release (PyPI ``arctic-platform==0.1.2``), ``protocol=v1``, fp32;
  its trace shows every ``/fwd-bwd`` and the engine's optimizer step count.

The facts, on each server:

* the default config creates the jobs there as it is;
* ``update_actor`` with gradient accumulation 1, 2 and 4 sends one training call per mini-batch of 4
  rows (v2: ``/forward-backward`` + ``/step``; v1: ``/fwd-bwd``); the server's own step count equals
  the adapter's, nothing is left pending;
* the reported metrics are each mini-batch's token means as the server computed them (its trace),
  and equal for GAS 1, 2 and 4 (summing the micro-batches would double or quadruple them) -- the GAS 1
  values come from a fixture run of their own on the same server, so every case checks the equality
  when it runs alone;
* the update runs at the sampling temperature (0.7): with unchanged weights the PPO ratio is 1
  (``actor/ppo_kl`` ~ 0), as it would not be if old log-probs and the update disagreed;
* ``rollout_is_weights`` take effect (x2 doubles ``actor/pg_loss``, 0 zeroes it); negative weights
  are refused before any call;
* ``destroy`` releases the jobs.

Only against the vendor's v2 server: a clip ratio the vendor fixes at 0.2, or a policy loss other than
verl's vanilla one, is refused at start-up naming the key (no job is created), and a lost ``/forward-backward`` or ``/step`` answer (a dropping proxy in front of the vendor,
which has neither request-id replay nor counters) never applies an update twice: the adapter rebuilds
the training job from the journal and sends the call once more to the rebuilt job; the final weights
equal an undisturbed run's and the vendor's ``global_step`` equals the steps asked for.

The learning rate is 0 (except in the recovery test) so that every call of a test sees the same
weights (metrics can be compared across calls and clients); the steps still count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from tests.support.arctic import grpo_batch, update_batch, verl_main_config
from tests.support.reliability import DropProxy
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

pytestmark = pytest.mark.slow

N = 2  # rollout.n
MINI = 2  # ppo_mini_batch_size (prompts): 4 rows per mini-batch, 2 mini-batches per update
TEMPERATURE = 0.7
GAS = [(4, 1), (2, 2), (1, 4)]  # (ppo_micro_batch_size_per_gpu, gradient accumulation steps)
#: the vendor's v2 default computes in bf16; metrics of identical calls agree far better than this
BF16_ATOL = 0.02


@dataclass
class Target:
    """A server under test and how to read its own account of what happened."""

    kind: str  # "ours" | "vendor-v2" | "vendor-v1"
    url: str
    server: Any
    #: tolerance of a metric between two calls on identical weights
    atol: float

    def remote(self) -> dict:
        """The ``remote_backend`` node: defaults but the URL (v1: its protocol, fp32 and the vendor's attention)."""
        node: dict = {"server": {"url": self.url}, "retry": {"backoff_initial_s": 0.05}}
        if self.kind == "vendor-v1":
            node["server"]["protocol"] = "v1"
            node["train"] = {"deepspeed": {"bf16": False}, "attn_implementation": "flash_attention_2"}
        return node

    @property
    def training_paths(self) -> tuple[str, ...]:
        return ("/fwd-bwd",) if self.kind == "vendor-v1" else ("/forward-backward", "/step")

    def trace_len(self) -> int:
        return 0 if self.kind == "ours" else len(self.server.trace_lines())

    def calls(self, since: int, expect: int = 0) -> list[dict]:
        """The training exchanges traced after line ``since`` (a trace line is written just after its answer
        left: wait up to 10 s for ``expect`` of them)."""
        deadline = time.monotonic() + 10
        while True:
            calls = [r for r in self.server.trace_lines()[since:] if r["path"] in self.training_paths]
            if len(calls) >= expect or time.monotonic() > deadline:
                return calls
            time.sleep(0.05)

    def server_step(self, client: ArcticRLClient) -> int:
        """The training job's optimizer step count, as the server tells it."""
        if self.kind == "ours":
            return int(self.job_info(client)["global_step"])
        if self.kind == "vendor-v1":
            rows = [r for r in self.server.trace_lines() if r.get("global_steps") is not None]
            assert rows, "the vendor v1 trace holds no step count"
            return int(rows[-1]["global_steps"])
        return int(client.save_checkpoint()["global_step"])  # the vendor's v2 /save answers its global_step

    def job_info(self, client: ArcticRLClient) -> dict:
        return requests.get(f"{self.url}/job/{client.job_ids['training']}", timeout=30).json()

    def jobs(self) -> set[str]:
        status = requests.get(f"{self.url}/status", timeout=30).json()
        return set(map(str, status.get("jobs") or {}))


@pytest.fixture(scope="module", params=["ours", "vendor-v2", "vendor-v1"])
def target(request) -> Target:
    if request.param == "ours":
        server = request.getfixturevalue("reference_server")
        return Target("ours", server.url, server, atol=1e-5)
    server = request.getfixturevalue("vendor_server" if request.param == "vendor-v2" else "vendor_v1_server")
    return Target(request.param, server.url, server, atol=BF16_ATOL if request.param == "vendor-v2" else 1e-4)


def main_config(model_dir: Path, target: Target, workdir: Path, *, micro: int, **actor):
    return verl_main_config({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 8},
        "trainer": {"default_local_dir": str(workdir)},
        "actor_rollout_ref": {
            "rollout": {"n": N, "temperature": TEMPERATURE},
            "actor": {"ppo_mini_batch_size": MINI, "ppo_micro_batch_size_per_gpu": micro, "ppo_epochs": 1,
                      "optim": {"lr": 0.0}, "shuffle": False, **actor},
        },
        "remote_backend": target.remote(),
    }, model_path=str(model_dir))


def train_data(client: ArcticRLClient, seed: int = 0, weights: float | None = None):
    """8 rows (4 prompts x n=2) as verl hands them to update_actor (two mini-batches)."""
    return update_batch(client, temperature=TEMPERATURE, mini_rows=MINI * N, seed=seed, weights=weights)


@pytest.fixture(scope="module")
def gas1_metrics(target: Target, tiny_model_dir, tmp_path_factory) -> dict[str, list[float]]:
    """The metrics of one update with gradient accumulation 1 on ``target``, from a client of its own."""
    client = ArcticRLClient.from_config(main_config(tiny_model_dir, target, tmp_path_factory.mktemp("gas1"), micro=4))
    try:
        return {k: list(v) for k, v in tu.get(client.update_actor(train_data(client)), "metrics").items()}
    finally:
        client.destroy()


@pytest.mark.parametrize("micro, gas", GAS, ids=[f"gas{g}" for _, g in GAS])
def test_update_actor_follows_the_accumulation_contract(target, gas1_metrics, tiny_model_dir, tmp_path, micro, gas):
    client = ArcticRLClient.from_config(main_config(tiny_model_dir, target, tmp_path, micro=micro))
    try:
        if target.kind == "ours":
            assert target.job_info(client)["gradient_accumulation_steps"] == gas
        else:
            created = target.server.trace_lines("/initialize")[-3:]
            assert [r["status"] for r in created] == [200, 200, 200]  # defaults create every job at the vendor
        data = train_data(client)
        since = target.trace_len()
        metrics = tu.get(client.update_actor(data), "metrics")
        assert client.step == 2
        if target.kind == "ours":
            info = target.job_info(client)
            assert info["global_step"] == 2 and info["pending_forward_backward"] == 0
        else:
            calls = target.calls(since, expect=2 * len(target.training_paths))
            # one training call per mini-batch of 4 rows (the server splits it into GAS micro-batches)
            assert [c["path"] for c in calls] == list(target.training_paths) * 2, calls
            assert all(c["status"] == 200 for c in calls)
            per_batch = calls[::len(target.training_paths)]
            assert [c["rows"] for c in per_batch] == [4, 4]
            # the adapter reports each call's token means as the server computed them: never summed over calls
            for index, call in enumerate(per_batch):
                names = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl") + (("loss",) if
                                                                                   target.kind == "vendor-v2" else ())
                tolerance = {"abs": 1e-6} if target.kind == "vendor-v2" else {"rel": 1e-5, "abs": 1e-7}
                for name in names:
                    assert metrics[name][index] == pytest.approx(call["metrics"][name], **tolerance), name
                if target.kind == "vendor-v2":
                    assert "batch_num_tokens" in call["meta_keys"] and "rollout_is_weights" not in call["meta_keys"]
        assert target.server_step(client) == client.step == 2  # the server's step count is ours
        # the update ran at the sampling temperature: unchanged weights give a PPO ratio of 1
        assert all(abs(v) < target.atol for v in metrics["actor/ppo_kl"]), metrics["actor/ppo_kl"]
        assert all(v == 0.0 for v in metrics["actor/pg_clipfrac"])
        # token means of the mini-batch, whatever the accumulation: GAS 2 and 4 report what GAS 1 reports
        for name in ("actor/pg_loss", "loss", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert metrics[name] == pytest.approx(gas1_metrics[name], abs=target.atol), name

        # rollout importance weights reach the server's loss
        since = target.trace_len()
        doubled = tu.get(client.update_actor(train_data(client, weights=2.0)), "metrics")
        zeroed = tu.get(client.update_actor(train_data(client, weights=0.0)), "metrics")
        assert abs(metrics["actor/pg_loss"][0]) > max(1e-2, 5 * target.atol)  # so that doubling shows
        assert doubled["actor/pg_loss"] == pytest.approx([2 * v for v in metrics["actor/pg_loss"]], abs=target.atol)
        assert zeroed["actor/pg_loss"] == [0.0, 0.0]
        if target.kind != "ours":
            calls = target.calls(since, expect=4 * len(target.training_paths))
            assert [c["status"] for c in calls] == [200] * 4 * len(target.training_paths)
        negative = train_data(client)
        negative["rollout_is_weights"] = -torch.ones(data["response_mask"].shape)
        since = target.trace_len()
        with pytest.raises(RemoteBackendConfigError) as err:
            client.update_actor(negative)
        assert err.value.field == "data.rollout_is_weights"
        if target.kind == "ours":
            info = target.job_info(client)
            assert info["global_step"] == 6 and info["pending_forward_backward"] == 0  # refused before any call
        else:
            assert target.calls(since) == []  # refused before any call
        saved = client.save_checkpoint()
        if target.kind != "vendor-v1":  # the v1 /save-checkpoint answers the path only
            assert saved["global_step"] == client.step
        assert client.step == 6 and target.server_step(client) == 6
    finally:
        ids = dict(client.job_ids)
        client.destroy()
    assert not set(map(str, ids.values())) & target.jobs()


# ------------------------------------------------------------------------------- the vendor's v2 server only


def v2_config(model_dir: Path, url: str, workdir: Path, *, micro: int, **actor):
    return main_config(model_dir, Target("vendor-v2", url, None, BF16_ATOL), workdir, micro=micro, **actor)


@pytest.mark.parametrize(("actor", "key", "received"), [
    ({"clip_ratio_high": 0.28}, "actor_rollout_ref.actor.clip_ratio_high", 0.28),
    ({"clip_ratio_c": 10.0}, "actor_rollout_ref.actor.clip_ratio_c", 10.0),
    ({"policy_loss": {"loss_mode": "gspo"}}, "actor_rollout_ref.actor.policy_loss.loss_mode", "gspo"),
    ({"policy_loss": {"loss_mode": "bypass_mode"}}, "actor_rollout_ref.actor.policy_loss.loss_mode", "bypass_mode"),
])
def test_what_the_vendors_loss_cannot_do_is_refused_before_any_job(vendor_server, tiny_model_dir, tmp_path, actor, key,
                                                                   received):
    """The vendor's verl_grpo fixes the clip ratios at 0.2 and dual clip at 3.0 and is its only loss: a run asking
    for anything else fails at start-up naming the key, the reason and the value -- no job is created."""
    before = len(vendor_server.trace_lines())
    with pytest.raises(RemoteBackendConfigError) as err:
        ArcticRLClient.from_config(v2_config(tiny_model_dir, vendor_server.url, tmp_path, micro=4, **actor))
    assert err.value.field == key and err.value.received == received
    assert "policy_losses" in str(err.value) and "vendor" in str(err.value)
    paths = [r["path"] for r in vendor_server.trace_lines()[before:]]
    assert "/health" in paths and "/initialize" not in paths  # decided from its /health (no features), before any job


def probe_logprobs(client: ArcticRLClient) -> torch.Tensor:
    _, _, data = grpo_batch(99, interleave=False)
    tu.assign_non_tensor(data, temperature=TEMPERATURE)
    return no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data) * data["response_mask"]


def test_a_lost_answer_never_applies_an_update_twice(vendor_server, tiny_model_dir, tmp_path):
    def train(url: str) -> tuple[torch.Tensor, torch.Tensor, ArcticRLClient]:
        cfg = v2_config(tiny_model_dir, url, tmp_path, micro=2, optim={"lr": 1e-3})
        client = ArcticRLClient.from_config(cfg)
        try:
            before = probe_logprobs(client)
            for seed in range(2):  # 2 updates x 2 mini-batches: 4 steps
                client.update_actor(train_data(client, seed))
            assert client.save_checkpoint()["global_step"] == client.step == 4  # the vendor's count
            return before, probe_logprobs(client), client
        finally:
            client.destroy()

    before, reference, _ = train(vendor_server.url)
    assert (reference - before).abs().max() > 1e-2  # the weights moved: a step applied twice would show
    port = int(vendor_server.url.rsplit(":", 1)[1])
    with DropProxy(port) as proxy:
        # answers lost after the vendor applied the call: a /forward-backward, then (counting the
        # rebuilt job's replayed calls) the /step of that same mini-batch
        proxy.drop("POST", "/forward-backward", 2)
        proxy.drop("POST", "/step", 3)
        _, got, client = train(proxy.url)
    assert len(proxy.fired) == 2
    stats = client.reliability_stats()
    assert stats["recovery/training_rebuilds"] == 2 and stats["recovery/journal_replayed"] == 2 + 3
    assert torch.allclose(got, reference, atol=1e-6), (got - reference).abs().max()
