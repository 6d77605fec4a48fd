"""The vLLM sampler with its engine core in a process of its own (``--vllm-engine-process own``), on a GPU.

The same small Qwen3 as ``test_vllm_sampler_gpu.py``, the sampler created before the DeepSpeed training engine of
the same process. Checked: generation answers as in one process; a weight sync through the shared CUDA buffer after an
optimizer step gives the engine core the trainer's weights (its log-probs match the trainer's, its weight norm
equals the trainer's), also when the sync takes several buckets; a sync during a generation restarts the call in
flight on the new weights; sleep and wake at level 1; the memory report reaches the worker. Skipped without a CUDA
device or without ``vllm``. Run alone (vLLM's switch between the two modes is process-wide)::

    python -m pytest -q -p no:randomly tests/arctic_rl/server/engines/test_vllm_engine_process_gpu.py
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm") if torch.cuda.is_available() else None

from arctic_rl.server.engines.vllm_process import ENV
from arctic_rl.server.engines.weights import weight_norm
from tests.support.vllm_gpu import (
    TOL_MEAN,
    assert_close_lps,
    gen,
    sampled_lps,
    sampler_and_trainer,
    submit,
    train_lps,
    train_step,
    vllm_seq_lps,
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV, raising=False)
        train, sampler = sampler_and_trainer(tmp_path_factory.mktemp("vllm_own"), vllm_engine_process="own")
        yield train, sampler
        sampler.close()
        train.close()


def _norm(report) -> float:
    return float(report["norm"])


def test_the_engine_core_runs_apart_and_generates(engines):
    _, sampler = engines
    info = sampler.info()
    assert info["engine_process"] == "own" and info["continuous_batching"] is True
    prompt = list(range(10, 40))
    a = gen(sampler, [prompt], temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)[0]
    b = gen(sampler, [prompt], temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)[0]
    assert a["token_ids"] == b["token_ids"] and a["generation_len"] == 24 and b["prefix_cache_len"] > 0
    seeded = [gen(sampler, [prompt, prompt[:5]], n=3, temperature=1.0, max_tokens=16, seed=11) for _ in range(2)]
    assert [r["token_ids"] for r in seeded[0]] == [r["token_ids"] for r in seeded[1]]
    parts = sampler.memory_report()
    assert parts["weights"] > 0 and parts["kv_cache"] > 0, parts


@pytest.mark.parametrize("cap", [None, 1 << 20], ids=["one-bucket", "1MiB-buckets"])
def test_weight_sync_through_the_shared_buffer_gives_the_trainers_weights(engines, cap):
    train, sampler = engines
    sender = sampler.process.sender
    default_cap = sender.cap
    sender.cap = cap or default_cap
    try:
        prompt = list(range(20, 52))
        response = gen(sampler, [prompt], temperature=0, max_tokens=32, ignore_eos=True)[0]["token_ids"]
        before = vllm_seq_lps(sampler, prompt, response)
        version = sampler.weight_version
        train_step(train)
        torch.cuda.synchronize()
        trained = train_lps(train, prompt, response)
        assert (trained - before).abs().mean() > 5 * TOL_MEAN  # the step moved this sequence
        assert sampler.load_weights(train.weights()) == version + 1
        assert_close_lps(vllm_seq_lps(sampler, prompt, response), trained)
        assert _norm(sampler.weight_norm()) == pytest.approx(_norm(weight_norm(train.model)), rel=2e-3)  # bf16 copy
        out = gen(sampler, [prompt], temperature=0, max_tokens=32, ignore_eos=True, logprobs=True)[0]
        assert out["weight_version"] == version + 1
        assert_close_lps(torch.tensor(sampled_lps(out)), train_lps(train, prompt, out["token_ids"]))
    finally:
        sender.cap = default_cap


def test_weight_sync_during_generation_restarts_the_call_in_flight(engines):
    train, sampler = engines
    sampler.in_flight_on_weight_load = "restart"
    try:
        prompt = list(range(20, 52))
        version, restarted = sampler.weight_version, sampler.info()["restarted_on_weight_load"]
        train_step(train)
        torch.cuda.synchronize()
        loop = sampler._loop()
        started = loop.steps
        running = submit(sampler, [prompt] * 2, temperature=1.0, max_tokens=900, ignore_eos=True, logprobs=True,
                         seed=3)
        while loop.steps < started + 20:
            time.sleep(0.002)
        assert sampler.load_weights(train.weights()) == version + 1
        results = running.result()
        assert sampler.info()["restarted_on_weight_load"] == restarted + 1
        assert {r["weight_version"] for r in results} == {version + 1}
        assert {r["generation_len"] for r in results} == {900}
        for r in results:
            assert_close_lps(torch.tensor(sampled_lps(r)[:64]), train_lps(train, prompt, r["token_ids"][:64]))
    finally:
        sampler.in_flight_on_weight_load = "wait"


def test_sleep_and_wake(engines):
    _, sampler = engines
    prompt = list(range(30, 60))
    want = gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"]
    sampler.sleep(level=1)
    sampler.wake_up()
    assert gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"] == want
