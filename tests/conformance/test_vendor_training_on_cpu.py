"""Our adapter (``ArcticRLClient``) against the vendor's own v2 server: the training side of the contract.

The vendor's Arctic-Platform server (pinned snapshot, served on CPU by the shared kit) runs a tiny
Qwen3 with a real DeepSpeed engine. Checked against the vendor's code, not against our server:

* the adapter's default ``remote_backend`` config creates the jobs there as it is
  (``ds_worker_config.attn_implementation`` sent; ZeRO-1 for bf16 training, stage 0 for the
  optimizer-less log_prob engine);
* ``update_actor`` with gradient accumulation 1, 2 and 4 sends one ``/forward-backward`` per
  mini-batch and one ``/step``: the vendor's ``global_step`` (``/save``) equals the adapter's step
  count, and the adapter's metrics are the vendor's per-call values (its trace);
* the update runs at the sampling temperature (0.7): with unchanged weights the PPO ratio is 1
  (``actor/ppo_kl`` ~ 0 within bf16), as it would not be if old log-probs and the update disagreed;
* ``rollout_is_weights`` take effect (folded into the advantages: the vendor reads the weights only
  from ``meta``, unsplit); negative weights are refused before any call;
* a clip ratio the vendor fixes at 0.2 is a start-up warning naming the key;
* ``destroy`` releases the jobs;
* a lost ``/forward-backward`` or ``/step`` answer (a dropping proxy in front of the vendor, which has
  neither request-id replay nor counters) never applies an update twice: the adapter rebuilds the
  training job from the journal and sends the call once more to the rebuilt job; the final weights
  equal an undisturbed run's and the vendor's ``global_step`` equals the steps asked for.

The learning rate is 0 (except in the recovery test) so that every call of a test sees the same
weights (metrics can be compared across calls); the steps still count. The same facts against our reference server are checked in
``tests/remote_client/test_arctic_training_contract_on_cpu.py``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _helpers_arctic import grpo_batch, update_batch, verl_main_config
from _helpers_reliability import DropProxy
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from verl.remote_backend.errors import RemoteBackendConfigError
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

pytestmark = pytest.mark.slow

N = 2  # rollout.n
MINI = 2  # ppo_mini_batch_size (prompts): 4 rows per mini-batch, 2 mini-batches per update
TEMPERATURE = 0.7
#: the vendor computes in bf16; metrics of identical calls agree far better than this
ATOL = 0.02


def main_config(model_dir: Path, url: str, workdir: Path, *, micro: int, **actor):
    """Everything under ``remote_backend`` at its default except the server URL."""
    return verl_main_config({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 8},
        "trainer": {"default_local_dir": str(workdir)},
        "actor_rollout_ref": {
            "rollout": {"n": N, "temperature": TEMPERATURE},
            "actor": {"ppo_mini_batch_size": MINI, "ppo_micro_batch_size_per_gpu": micro, "ppo_epochs": 1,
                      "optim": {"lr": 0.0}, "shuffle": False, **actor},
        },
        "remote_backend": {"server": {"url": url}, "retry": {"backoff_initial_s": 0.05}},
    }, model_path=str(model_dir))


def train_data(client: ArcticRLClient, seed: int = 0):
    """8 rows (4 prompts x n=2) as verl hands them to update_actor (two mini-batches)."""
    return update_batch(client, temperature=TEMPERATURE, mini_rows=MINI * N, seed=seed)


def vendor_calls(vendor_server, since: int, expect: int = 0) -> list[dict]:
    """The ``/forward-backward`` and ``/step`` exchanges traced after line ``since`` (the trace line of an
    exchange is written just after its answer left: wait up to 10 s for ``expect`` of them)."""
    deadline = time.monotonic() + 10
    while True:
        calls = [r for r in vendor_server.trace_lines()[since:] if r["path"] in ("/forward-backward", "/step")]
        if len(calls) >= expect or time.monotonic() > deadline:
            return calls
        time.sleep(0.05)


@pytest.mark.parametrize("micro, gas", [(4, 1), (2, 2), (1, 4)])
def test_update_actor_follows_the_vendors_accumulation_contract(vendor_server, tiny_model_dir, tmp_path, micro, gas):
    client = ArcticRLClient.from_config(main_config(tiny_model_dir, vendor_server.url, tmp_path, micro=micro))
    try:
        data = train_data(client)
        created = vendor_server.trace_lines("/initialize")[-3:]
        assert [r["status"] for r in created] == [200, 200, 200]  # defaults create every job at the vendor
        since = len(vendor_server.trace_lines())
        metrics = tu.get(client.update_actor(data), "metrics")
        calls = vendor_calls(vendor_server, since, expect=4)
        # one /forward-backward per mini-batch of 4 rows (the vendor splits it into GAS micro-batches), one /step
        assert [c["path"] for c in calls] == ["/forward-backward", "/step"] * 2, calls
        assert all(c["status"] == 200 for c in calls) and [c["rows"] for c in calls[::2]] == [4, 4]
        assert client.step == 2
        # the adapter reports each call's token means as the vendor computed them: never summed over calls
        for index, call in enumerate(calls[::2]):
            vendor = call["metrics"]
            for ours, theirs in (("actor/pg_loss", "actor/pg_loss"), ("actor/pg_clipfrac", "actor/pg_clipfrac"),
                                 ("actor/ppo_kl", "actor/ppo_kl"), ("loss", "loss")):
                assert metrics[ours][index] == pytest.approx(vendor[theirs], abs=1e-6), (ours, index)
            assert "batch_num_tokens" in call["meta_keys"] and "rollout_is_weights" not in call["meta_keys"]
        # the update ran at the sampling temperature: unchanged weights give a PPO ratio of 1
        assert all(abs(v) < ATOL for v in metrics["actor/ppo_kl"]), metrics["actor/ppo_kl"]
        assert all(v == 0.0 for v in metrics["actor/pg_clipfrac"])
        # the vendor's step count is ours
        saved = client.save_checkpoint()
        assert saved["global_step"] == client.step == 2

        # rollout importance weights reach the vendor's loss (folded into the advantages)
        since = len(vendor_server.trace_lines())
        weighted = train_data(client)
        weighted["rollout_is_weights"] = torch.full(data["response_mask"].shape, 2.0)
        doubled = tu.get(client.update_actor(weighted), "metrics")
        zeros = train_data(client)
        zeros["rollout_is_weights"] = torch.zeros(data["response_mask"].shape)
        zeroed = tu.get(client.update_actor(zeros), "metrics")
        for index in range(2):
            assert doubled["actor/pg_loss"][index] == pytest.approx(2 * metrics["actor/pg_loss"][index], abs=ATOL)
            assert zeroed["actor/pg_loss"][index] == 0.0
        assert abs(metrics["actor/pg_loss"][0]) > 5 * ATOL  # so that doubling shows
        assert [c["status"] for c in vendor_calls(vendor_server, since, expect=8)] == [200] * 8
        negative = train_data(client)
        negative["rollout_is_weights"] = -torch.ones(data["response_mask"].shape)
        since = len(vendor_server.trace_lines())
        with pytest.raises(RemoteBackendConfigError) as err:
            client.update_actor(negative)
        assert err.value.field == "data.rollout_is_weights"
        assert vendor_calls(vendor_server, since) == []  # refused before any call
        assert client.save_checkpoint()["global_step"] == client.step == 6
    finally:
        ids = dict(client.job_ids)
        client.destroy()
    status = requests.get(f"{vendor_server.url}/status", timeout=30).json()
    assert not set(map(str, ids.values())) & set(map(str, status["jobs"])), status


def test_settings_the_vendor_ignores_are_named_at_start_up(vendor_server, tiny_model_dir, tmp_path, caplog):
    cfg = main_config(tiny_model_dir, vendor_server.url, tmp_path, micro=4, clip_ratio_high=0.28)
    with caplog.at_level(logging.WARNING, logger="verl.workers.remote_client.arctic.arctic_rl"):
        client = ArcticRLClient.from_config(cfg)
    client.destroy()
    text = caplog.text
    assert "actor_rollout_ref.actor.clip_ratio_high=0.28" in text and "always uses 0.2" in text
    assert "clip_ratio_low" not in text and "attn_implementation" not in text  # defaults: nothing to say


def probe_logprobs(client: ArcticRLClient) -> torch.Tensor:
    _, _, data = grpo_batch(99, interleave=False)
    tu.assign_non_tensor(data, temperature=TEMPERATURE)
    return no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data) * data["response_mask"]


def test_a_lost_answer_never_applies_an_update_twice(vendor_server, tiny_model_dir, tmp_path):
    def train(url: str) -> tuple[torch.Tensor, torch.Tensor, ArcticRLClient]:
        cfg = main_config(tiny_model_dir, url, tmp_path, micro=2, optim={"lr": 1e-3})
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
