"""Our Arctic adapter, ``remote_backend.server.protocol=v1``, against the vendor's own v1 server code.

The server is PyPI ``arctic-platform==0.1.2`` (the vendor's v1 release) served on CPU by
``vendor_v1_server.py``: the vendor's routes, ``torch.load`` body decoding, batch splitting, worker loop
and loss run on a real DeepSpeed engine; only the GPU-, Ray- and vLLM-bound parts are substituted
(its docstring lists them). What the vendor does is the contract: every assertion below states what
the vendor's code does with what the adapter sends, and compares with an independent reference (the
same model run with ``transformers``) or with the vendor's own account (its trace: the engine's
optimizer step count and the metrics it answered).

A test whose assertions the adapter does not meet yet is marked ``xfail(strict=True)`` for the exception it
raises, with the finding of issue 11 it covers; the mark must go when the fix lands (a strict xfail that
passes fails).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import requests
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from tests.support.arctic import grpo_batch, hf_response_logprobs, verl_main_config
from verl.remote_backend.errors import RemoteJobNotFoundError
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

pytestmark = [pytest.mark.slow]

N = 2  # rollout.n
MINI = 2  # ppo_mini_batch_size (prompts): 4 rows per mini-batch; a batch of 8 rows is 2 mini-batches
R0 = 8  # max_response_length


def v1_config(model_dir: Path, url: str, *, temperature: float = 1.0, defaults: bool = False, mini: int = MINI,
              **arctic):
    """verl's PPO config for mini-batches of ``mini`` prompts, pointed at the vendor v1 server.

    ``defaults=True`` leaves every ``remote_backend`` key at its default but the URL and protocol; otherwise
    the training engine is fp32 (the vendor's bf16 default needs ZeRO >= 1, which the tiny model does not need)
    and attention is ``flash_attention_2`` (the vendor's default; its packed rows and ZoRRO need it).
    """
    remote: dict = {"server": {"url": url, "protocol": "v1"}, "retry": {"backoff_initial_s": 0.05}}
    if not defaults:
        remote["train"] = {"deepspeed": {"bf16": False}, "attn_implementation": "flash_attention_2"}
    for section, values in arctic.items():
        remote.setdefault(section, {}).update(values)
    return verl_main_config({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": R0},
        "actor_rollout_ref": {
            "rollout": {"n": N, "temperature": temperature},
            "actor": {"ppo_mini_batch_size": mini, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1,
                      "optim": {"lr": 5e-3}, "use_kl_loss": False, "shuffle": False},
        },
        "remote_backend": remote,
    }, model_path=str(model_dir))



def server_jobs(url: str) -> dict:
    return requests.get(f"{url}/status", timeout=30).json()["jobs"]


def step_count(server) -> int | None:
    """The vendor training engine's optimizer step count after the last traced exchange."""
    rows = [r for r in server.trace_lines() if r.get("global_steps") is not None]
    return rows[-1]["global_steps"] if rows else None


def train_inputs(data, *, rows: int = 4):
    tu.assign_non_tensor(data, global_batch_size=rows, mini_batch_size=rows, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=False, temperature=1.0)
    return data


@pytest.fixture
def client_factory(vendor_v1_server):
    """Creates adapters against the vendor v1 server and destroys them (the vendor holds one job per type)."""
    made: list[ArcticRLClient] = []

    def make(cfg) -> ArcticRLClient:
        client = ArcticRLClient.from_config(cfg)
        made.append(client)
        return client

    yield make
    destroy_and_expect_no_jobs(vendor_v1_server, made)


def destroy_and_expect_no_jobs(server, clients: list[ArcticRLClient]) -> None:
    """Destroy ``clients`` (idempotent), then fail if the vendor still holds a job (after clearing them)."""
    for client in clients:
        client.destroy()
    leftover = server_jobs(server.url)
    if leftover:
        server.destroy_all_jobs()
    assert leftover == {}, f"jobs left on the vendor server: {leftover}"


# ------------------------------------------------------------------------------------------ jobs


def test_default_config_creates_jobs_that_compute_right_log_probs(vendor_v1_server, tiny_model_dir):
    """Every remote_backend key at its default: the vendor creates the three jobs, answers log-probs that agree
    with transformers (packed rows kept apart), and destroy removes the jobs."""
    client = ArcticRLClient.from_config(v1_config(tiny_model_dir, vendor_v1_server.url, defaults=True))
    try:
        assert client.protocol == 1
        jobs = server_jobs(vendor_v1_server.url)
        assert sorted(info["job_type"] for info in jobs.values()) == ["log_prob", "sampling", "training"]
        assert {str(v) for v in client.job_ids.values()} == set(jobs)
        assert jobs[str(client.job_ids["log_prob"])]["engine"] == "deepspeed"
        _logprobs_against_hf(client, tiny_model_dir)
    finally:
        client.destroy()
    assert server_jobs(vendor_v1_server.url) == {}


# ------------------------------------------------------------------------------------- log-probs


def _logprobs_against_hf(client, model_dir, *, temperature: float = 1.0, atol: float = 0.05):
    prompts, responses, data = grpo_batch(r0=R0)
    tu.assign_non_tensor(data, temperature=temperature)
    want = hf_response_logprobs(model_dir, prompts, responses, r0=R0, temperature=temperature)
    mask = data["response_mask"].bool()
    for compute in (client.compute_log_prob, client.compute_ref_log_prob):
        got = no_padding_2_padding(compute(data)["log_probs"], data).float()
        err = (got[mask] - want[mask]).abs().max().item()
        assert err < atol, f"{compute.__name__}: max error {err:.3f} nats against transformers (T={temperature})"


def test_log_probs_match_transformers(vendor_v1_server, tiny_model_dir, client_factory):
    client = client_factory(v1_config(tiny_model_dir, vendor_v1_server.url))
    assert client.protocol == 1
    _logprobs_against_hf(client, tiny_model_dir)


def test_log_probs_with_zorro_match_transformers(vendor_v1_server, tiny_model_dir, client_factory):
    client = client_factory(v1_config(tiny_model_dir, vendor_v1_server.url, train={"zorro_train": {"enable": True}}))
    before = len(vendor_v1_server.trace_lines("/fwd-no-grad"))
    _logprobs_against_hf(client, tiny_model_dir)
    calls = vendor_v1_server.trace_lines("/fwd-no-grad")[before:]
    training = f"job_id={client.job_ids['training']}"
    on_training = [c for c in calls if c["query"] == training]
    assert on_training and all(c["zorro_meta"] and c["zorro_patched"] for c in on_training), \
        "ZoRRO was not active at the vendor: the test would not exercise its layout"


def test_log_probs_use_the_sampling_temperature(vendor_v1_server, tiny_model_dir, client_factory):
    client = client_factory(v1_config(tiny_model_dir, vendor_v1_server.url, temperature=0.7))
    _logprobs_against_hf(client, tiny_model_dir, temperature=0.7)


# -------------------------------------------------------------------------------------- training


def _update_twice(vendor_v1_server, model_dir, client_factory, micro_batch_size: int):
    client = client_factory(v1_config(model_dir, vendor_v1_server.url, train={"micro_batch_size": micro_batch_size}))
    _, _, data = grpo_batch(r0=R0)
    data["old_log_probs"] = no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data).float()
    before = len(vendor_v1_server.trace_lines("/fwd-bwd"))
    metrics = tu.get(client.update_actor(train_inputs(data)), "metrics")
    calls = vendor_v1_server.trace_lines("/fwd-bwd")[before:]
    return client, metrics, calls


@pytest.mark.parametrize("micro_batch_size", [4, 2], ids=["gas1", "gas2"])
def test_update_actor_steps_once_per_mini_batch_with_the_vendors_metrics(vendor_v1_server, tiny_model_dir,
                                                                          client_factory, micro_batch_size):
    client, metrics, calls = _update_twice(vendor_v1_server, tiny_model_dir, client_factory, micro_batch_size)
    assert client.step == 2
    assert step_count(vendor_v1_server) == 2, "the vendor's optimizer step count differs from the adapter's"
    assert len(calls) == 2 and all(c["status"] == 200 for c in calls), "one /fwd-bwd per mini-batch"
    assert [c["rows"] for c in calls] == [4, 4]
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        vendor = [c["metrics"][name] for c in calls]
        assert len(metrics[name]) == 2 and all(math.isfinite(v) for v in metrics[name])
        assert metrics[name] == pytest.approx(vendor, rel=1e-5, abs=1e-7), name
    assert all(g > 0 for g in metrics["grad_norm"]) and metrics["lr"] == [5e-3, 5e-3]


def test_rollout_is_weights_reach_the_vendors_loss(vendor_v1_server, tiny_model_dir, client_factory):
    """One mini-batch of all 8 rows (one /fwd-bwd, ratio 1 on a fresh policy): the vendor's token-mean pg_loss
    must be -sum(A * w * mask) / sum(mask) with the importance weights w, not the unweighted value."""
    client = client_factory(v1_config(tiny_model_dir, vendor_v1_server.url, mini=4, train={"micro_batch_size": 8}))
    _, _, data = grpo_batch(r0=R0)
    data["old_log_probs"] = no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data).float()
    mask = data["response_mask"].float()
    weights = (0.2 + 1.6 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(5))) * mask
    data["rollout_is_weights"] = weights
    weighted = float(-(data["advantages"] * weights * mask).sum() / mask.sum())
    unweighted = float(-(data["advantages"] * mask).sum() / mask.sum())
    assert abs(weighted - unweighted) > 0.05, "the weights must make a difference the test can see"
    before = len(vendor_v1_server.trace_lines("/fwd-bwd"))
    tu.get(client.update_actor(train_inputs(data, rows=8)), "metrics")
    calls = vendor_v1_server.trace_lines("/fwd-bwd")[before:]
    assert len(calls) == 1 and calls[0]["rows"] == 8
    assert calls[0]["metrics"]["actor/pg_loss"] == pytest.approx(weighted, abs=5e-3)


# ----------------------------------------------------------------------------- control + destroy


class TestControlCalls:
    """One adapter for the class; its jobs are destroyed by the last test, or at the class's end."""

    @pytest.fixture(scope="class")
    def client(self, vendor_v1_server, tiny_model_dir):
        client = ArcticRLClient.from_config(v1_config(tiny_model_dir, vendor_v1_server.url,
                                                      train={"micro_batch_size": 4}))
        yield client
        destroy_and_expect_no_jobs(vendor_v1_server, [client])

    def test_save_checkpoint_writes_a_deepspeed_checkpoint_at_the_vendor(self, client, vendor_v1_server):
        saved = client.save_checkpoint()
        traced = vendor_v1_server.trace_lines("/save-checkpoint")
        assert traced and traced[-1]["status"] == 200
        answered = traced[-1]["answer"]["path"]
        assert saved.get("path") == answered
        # a relative checkpoint_path (verl's default_local_dir) is resolved by the vendor against its own cwd
        ckpt_dir = Path(answered) if Path(answered).is_absolute() else vendor_v1_server.log.parent / answered
        assert (ckpt_dir / "latest").is_file(), f"the vendor wrote no DeepSpeed checkpoint under {ckpt_dir}"

    def test_weight_sync_is_followed_by_a_prefix_cache_reset_of_the_sampler(self, client, vendor_v1_server):
        """As the vendor's own client does after a sync."""
        sync = client.update_weights()
        synced = vendor_v1_server.trace_lines("/sync-weights")
        assert synced and synced[-1]["status"] == 200 and sync.get("status") == "ok"
        reset = vendor_v1_server.trace_lines("/reset-prefix-cache")
        assert reset and reset[-1]["status"] == 200
        assert reset[-1]["query"] == f"job_id={client.job_ids['sampling']}"

    def test_generate_expands_n_itself(self, client, vendor_v1_server):
        """The vendor keeps one output per prompt (n is not honoured): the adapter expands n=2 itself."""
        results = client.generate([[5, 6, 7], [8, 9]], {"n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 3})
        assert vendor_v1_server.trace_lines("/generate")[-1]["status"] == 200
        assert [(r.prompt_index, r.sample_index) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(1 <= len(r.token_ids) <= 3 for r in results)

    def test_destroy_destroys_each_job_at_the_vendor(self, client, vendor_v1_server):
        """Last in the class: the vendor holds one job per type, and the next test creates its own."""
        ids = dict(client.job_ids)
        client.destroy()
        destroys = vendor_v1_server.trace_lines("/destroy")[-3:]
        assert sorted(int(d["query"].split("=")[1]) for d in destroys) == sorted(ids.values())
        assert all(d["status"] == 200 for d in destroys)
        assert server_jobs(vendor_v1_server.url) == {}


def test_unknown_job_on_fwd_no_grad_is_reported_as_gone(vendor_v1_server, tiny_model_dir, client_factory):
    cfg = v1_config(tiny_model_dir, vendor_v1_server.url, train={"micro_batch_size": 4})
    client = client_factory(cfg)
    attached = ArcticRLClient.from_config(cfg, handle=client.reconnect_handle())  # owns nothing
    client.destroy()
    _, _, data = grpo_batch(r0=R0)
    # the vendor indexes its job table before checking the id: an unknown job is a plain 500 there
    with pytest.raises(RemoteJobNotFoundError):
        try:
            attached.compute_log_prob(data)
        finally:
            assert vendor_v1_server.trace_lines("/fwd-no-grad")[-1]["status"] == 500
