"""Our adapter (``ArcticRLClient``) against the vendor's own v2 server: the forward, generate and
weight-sync side of the contract.

The vendor's Arctic-Platform server (pinned snapshot, served on CPU by the shared kit) runs a tiny
Qwen3; verl-shaped batches (verl's own ``left_right_2_no_padding``) go through the adapter exactly as
in a run. Checked against the vendor's code, not against our server:

* ``/forward`` log-probs with ZoRRO off (shifted ``[B, P+R]``) and on (response-aligned ``[B, P+R]``,
  no alignment key), at a sampling temperature of 0.5, equal a ``transformers`` fp32 computation of
  the same model within the vendor's bf16 tolerance (and not the T=1 values) -- old log-probs use the temperature as the
  update's ``/forward-backward`` does (``apply_temperature``), and the ZoRRO layout is read from the
  job config;
* ``/generate`` with log-probs (the vendor's ``{token_id: {logprob, rank}}`` per token) gives the
  sampled tokens' log-probs;
* an unknown job on ``/forward`` (a plain 500 at the vendor) is ``RemoteJobNotFoundError``;
* save / load, weight sync followed by ``/reset-prefix-cache`` on the sampling job (the vendor's
  trace), destroy.

ZoRRO at the vendor needs a flash-attention backend (served on CPU by the kit), and without it rows
of a ``/forward`` call attend across each other, so both clients ask for ``flash_attention_2``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from tests.support.arctic import grpo_batch, hf_response_logprobs, verl_main_config
from verl.remote_backend.errors import RemoteJobNotFoundError
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

pytestmark = pytest.mark.slow

N = 2  # rollout.n
TEMPERATURE = 0.5
#: the vendor computes in bf16 (its ModelSpec dtype); observed within 0.03 of fp32 transformers
ATOL = 0.1


def main_config(model_dir: Path, url: str, workdir: Path, *, zorro: bool, recovery: bool = True):
    return verl_main_config({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 8},
        "trainer": {"default_local_dir": str(workdir)},
        "actor_rollout_ref": {
            "rollout": {"n": N, "temperature": TEMPERATURE},
            "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1,
                      "optim": {"lr": 1e-3}, "shuffle": False},
        },
        "remote_backend": {
            "server": {"url": url, "protocol": "v2"},
            "train": {"attn_implementation": "flash_attention_2", "checkpoint_path": str(workdir / "ckpt"),
                      "zorro_train": {"enable": zorro}},
            "retry": {"backoff_initial_s": 0.05},
            "recovery": {"enable": recovery},
        },
    }, model_path=str(model_dir))



def check_logprobs(client: ArcticRLClient, model_dir: Path, *, ref: bool = False) -> float:
    prompts, responses, data = grpo_batch()
    tu.assign_non_tensor(data, temperature=TEMPERATURE)
    out = client.compute_ref_log_prob(data) if ref else client.compute_log_prob(data)
    assert torch.equal(out["log_probs"].offsets(), data["input_ids"].offsets())
    got = no_padding_2_padding(out["log_probs"], data)
    mask = data["response_mask"].bool()
    want = hf_response_logprobs(model_dir, prompts, responses, temperature=TEMPERATURE)
    err = float((got[mask] - want[mask]).abs().max())
    # the T=1 values are much further away: the temperature really was applied (finding 8)
    plain = hf_response_logprobs(model_dir, prompts, responses, temperature=1.0)
    err_plain = float((got[mask] - plain[mask]).abs().max())
    assert err < ATOL and err_plain > 3 * err, (err, err_plain)
    return err


def wait_for_trace(server, done, timeout_s: float = 10.0) -> list[dict]:
    """The server's trace once ``done(rows)`` holds (the kit writes a line after the answer is sent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = server.trace_lines()
        if done(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


class TestZorroOff:
    """One adapter (ZoRRO off) for the class; its jobs are destroyed by the last test, or at the class's end."""

    @pytest.fixture(scope="class")
    def client(self, vendor_server, tiny_model_dir, tmp_path_factory):
        client = ArcticRLClient.from_config(main_config(tiny_model_dir, vendor_server.url,
                                                        tmp_path_factory.mktemp("zorro_off"), zorro=False))
        yield client
        client.destroy()  # idempotent

    def test_the_three_jobs_are_created(self, client):
        assert set(client.job_ids) == {"sampling", "log_prob", "training"}

    def test_log_probs_of_the_training_job_match_transformers(self, client, tiny_model_dir):
        check_logprobs(client, tiny_model_dir)

    def test_log_probs_of_the_log_prob_job_match_transformers(self, client, tiny_model_dir):
        check_logprobs(client, tiny_model_dir, ref=True)

    def test_generate_answers_the_sampled_tokens_log_probs(self, client, tiny_model_dir, monkeypatch):
        """The sampled tokens' values, as transformers gives them (T=1, fp32 sampler); the vendor's server lists
        no ``compact_results``, so the body carries none of its keys (our extension, not the vendor's protocol)."""
        from transformers import AutoModelForCausalLM

        from verl.workers.remote_client.arctic.dialect import DialectV2

        sent, original = [], DialectV2.generate_payload
        monkeypatch.setattr(DialectV2, "generate_payload",
                            lambda self, prompts, params: sent.append(dict(params)) or original(self, prompts, params))
        tok = client.tokenizer
        prompt_ids = [tok(text, add_special_tokens=False)["input_ids"] for text in ("hello world", "abc")]
        results = client.generate(prompt_ids, {"temperature": 1.0, "max_tokens": 4, "logprobs": True,
                                               "ignore_eos": True, "seed": 3})
        assert sent and not any({"logprobs_format", "detokenize"} & set(p) for p in sent)
        assert len(results) == 2
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        for ids, res in zip(prompt_ids, results):
            assert res.prompt_len == len(ids) and len(res.token_ids) == 4
            assert len(res.logprobs) == 4 and all(isinstance(x, float) for x in res.logprobs)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids + res.token_ids])).logits[0].float(), -1)
            want = [float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(res.token_ids)]
            assert max(abs(a - b) for a, b in zip(res.logprobs, want)) < 1e-3

    def test_the_samples_of_a_prompt_go_one_row_per_sample(self, client, monkeypatch):
        """The vendor keeps one output per prompt and lists no features: verl's ``B x n`` one-sample calls reach it
        as rows of coalesced ``/generate`` calls, one row per sample with ``n`` = 1 (our server gets one request
        per prompt with ``n``: ``tests/remote_backend/workers/test_rollout_dispatch_on_cpu.py``), and the samples have the
        shape verl's GRPO step reads -- the same check as on our server."""
        from tests.support.rollout import check_grpo_samples, dispatch_grpo_samples
        from verl.remote_backend.workers.dispatch import backend_features

        assert not {"continuous_batching", "n_samples"} & backend_features(client)
        tok = client.tokenizer
        prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in ("hello world", "abc", "xyz")]
        sent, samples = dispatch_grpo_samples(client, prompts, N, monkeypatch)
        assert sum(body["prompts"] for body in sent) == len(prompts) * N and all(body["n"] == 1 for body in sent)
        check_grpo_samples(samples, prompts, N)

    def test_weight_sync_is_followed_by_a_prefix_cache_reset_of_the_sampler(self, client, vendor_server):
        """As the vendor's own client does after a sync."""
        before = len(vendor_server.trace_lines())
        client.update_weights()
        traced = wait_for_trace(vendor_server,
                                lambda rows: any(r["path"] == "/reset-prefix-cache" for r in rows[before:]))
        routes = [(r["path"], r.get("query", "")) for r in traced[before:]]
        paths = [p for p, _ in routes]
        assert paths.index("/weight-sync") < paths.index("/reset-prefix-cache"), routes
        reset_query = routes[paths.index("/reset-prefix-cache")][1]
        assert f"job_id={client.job_ids['sampling']}" in str(reset_query), routes

    def test_save_and_load_a_checkpoint(self, client):
        saved = client.save_checkpoint()
        assert saved["path"] and saved["global_step"] == 0
        loaded = client.load_checkpoint(path=saved["path"])
        assert loaded["global_step"] == 0 and client.step == 0

    def test_an_unknown_job_on_forward_is_job_not_found(self, client, vendor_server, tiny_model_dir, tmp_path):
        """The vendor answers a plain 500 (it indexes its job table first); the adapter asks ``/job/<id>``."""
        handle = client.reconnect_handle()
        handle["job_ids"] = {**handle["job_ids"], "training": 987}
        stray = ArcticRLClient.from_config(main_config(tiny_model_dir, vendor_server.url, tmp_path, zorro=False,
                                                       recovery=False), handle=handle)
        try:
            with pytest.raises(RemoteJobNotFoundError) as err:
                stray.compute_log_prob(grpo_batch()[2])
            assert "987" in str(err.value)
        finally:
            stray.destroy()  # owns nothing
        traced = wait_for_trace(vendor_server, lambda rows: any(r["path"] == "/job/987" for r in rows))
        assert [r["status"] for r in traced if r["path"] == "/forward"][-1] == 500
        assert [r["status"] for r in traced if r["path"] == "/job/987"][-1] == 404

    def test_destroy_removes_the_jobs_at_the_vendor(self, client, vendor_server):
        """Last in the class: the vendor holds one job per type, and the next test creates its own."""
        ids = dict(client.job_ids)
        client.destroy()
        status = requests.get(f"{vendor_server.url}/status", timeout=30).json()
        assert not set(map(str, ids.values())) & set(map(str, status["jobs"])), status
        assert len([r for r in vendor_server.trace_lines("/destroy") if r["status"] == 200]) >= 3


def test_forward_zorro_on_reads_the_vendor_layout(vendor_server, tiny_model_dir, tmp_path):
    client = ArcticRLClient.from_config(main_config(tiny_model_dir, vendor_server.url, tmp_path, zorro=True))
    try:
        check_logprobs(client, tiny_model_dir)
        check_logprobs(client, tiny_model_dir, ref=True)
    finally:
        client.destroy()
