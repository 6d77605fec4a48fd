"""The vLLM sampling engine on a GPU, next to the DeepSpeed training engine in the same process.

One small Qwen3 (head_dim 64, bf16) serves every test: the sampler is created first, as the
adapter creates its jobs (sampling, then training), and both share the one GPU. Checked here:
the ``/generate`` parameters (n, seed, greedy, max_tokens, stop tokens, stop strings, text
prompts, log-prob candidates, 400s), log-probs against the training model, a weight sync after an
optimizer step (the next generation uses the new weights), sleep / wake at levels 1 and 2 (and a sleep whose
vLLM device-memory check fails, :mod:`arctic_rl.server.engines.vllm_sleep`), and a
loop of sleep -> train -> wake -> sync -> generate with no OOM; continuous batching: calls from several threads
join the running batch and a short call returns while a long one still runs; a weight sync sent during a
generation restarts the call in flight on the new weights (it answers with the new version and the trainer's
log-probs; the sync does not wait for it), and under ``--in-flight-on-weight-load wait`` it waits for the call (the
running call answers with the old version, the call queued behind the sync with the new one). Skipped without a CUDA device or without ``vllm``. On a GPU box with
vLLM 0.26 installed::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m pytest -q -p no:randomly tests/arctic_rl/server/engines/test_vllm_sampler_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm") if torch.cuda.is_available() else None

from arctic_rl.server.errors import BadRequest, Conflict
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
    from arctic_rl.server.engines.vllm_sampler import VllmSamplingEngine

    train, sampler = sampler_and_trainer(tmp_path_factory.mktemp("vllm_gpu"))
    assert isinstance(sampler, VllmSamplingEngine)
    yield train, sampler
    sampler.close()
    train.close()


def test_sampling_params(engines):
    _, sampler = engines
    prompt = list(range(10, 40))
    a = gen(sampler, [prompt], temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)[0]
    b = gen(sampler, [prompt], temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)[0]
    assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == "length" and a["generation_len"] == 24
    assert set(a) == {"text", "token_ids", "finish_reason", "prompt_len", "generation_len", "prefix_cache_len",
                      "logprobs", "prompt_index", "sample_index", "weight_version"}
    assert a["prompt_len"] == 30 and b["prefix_cache_len"] > 0  # the second run's prompt came from the cache
    for tok, entry in zip(a["token_ids"], a["logprobs"], strict=True):
        assert str(tok) in entry and entry[str(tok)]["rank"] == 1 and 2 <= len(entry) <= 3

    seeded = [gen(sampler, [prompt, prompt[:5]], n=3, temperature=1.0, max_tokens=16, seed=11) for _ in range(2)]
    assert [r["token_ids"] for r in seeded[0]] == [r["token_ids"] for r in seeded[1]]
    assert [(r["prompt_index"], r["sample_index"]) for r in seeded[0]] == [(p, s) for p in range(2) for s in range(3)]
    assert len({tuple(r["token_ids"]) for r in seeded[0][:3]}) > 1  # n samples differ
    # copies of one prompt in one call (verl's n samples, batched by the rollout server) must differ, with a
    # seed and without: one seed for the whole call made every copy identical and GRPO's advantages zero
    for seed in (None, 11):
        copies = gen(sampler, [prompt] * 8, n=1, temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed)
        assert len({tuple(r["token_ids"]) for r in copies}) >= 6, seed

    stop_tok = a["token_ids"][5]
    first = a["token_ids"].index(stop_tok)
    stopped = gen(sampler, [prompt], temperature=0, max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True)[0]
    assert stopped["token_ids"] == a["token_ids"][: first + 1] and stopped["finish_reason"] == "stop"

    text = a["text"]
    stop_str = text[6:8]
    cut = text.find(stop_str)
    by_string = gen(sampler, [prompt], temperature=0, max_tokens=24, stop=[stop_str], ignore_eos=True)[0]
    assert by_string["finish_reason"] == "stop" and by_string["text"] == text[:cut]

    texts = gen(sampler, ["hello there"], temperature=0, max_tokens=4, ignore_eos=True)[0]
    assert texts["prompt_len"] == len(sampler.tokenizer("hello there")["input_ids"])

    for kwargs, field in (({"prompts": [[10**6]]}, "prompts.0"),
                          ({"prompts": [prompt], "max_tokens": 5000}, "sampling_params.max_tokens"),
                          ({"prompts": [prompt], "logprobs": 50}, "sampling_params.logprobs")):
        prompts = kwargs.pop("prompts")
        with pytest.raises(BadRequest) as info:
            gen(sampler, prompts, **kwargs)
        assert info.value.field == field


def test_logprobs_and_weight_sync(engines):
    train, sampler = engines
    prompt = list(range(20, 52))
    out = gen(sampler, [prompt], temperature=0, max_tokens=32, ignore_eos=True, logprobs=True)[0]
    response = out["token_ids"]
    assert_close_lps(torch.tensor(sampled_lps(out)), train_lps(train, prompt, response))
    before = vllm_seq_lps(sampler, prompt, response)
    version = sampler.weight_version
    train_step(train)
    trained = train_lps(train, prompt, response)
    assert (trained - before).abs().mean() > 5 * TOL_MEAN  # the step moved this sequence
    assert_close_lps(vllm_seq_lps(sampler, prompt, response), before)  # no sync yet: old weights
    torch.cuda.synchronize()
    assert sampler.load_weights(train.weights()) == version + 1
    assert_close_lps(vllm_seq_lps(sampler, prompt, response), trained)
    again = gen(sampler, [prompt], temperature=0, max_tokens=32, ignore_eos=True, logprobs=True)[0]
    assert again["weight_version"] == version + 1
    assert_close_lps(torch.tensor(sampled_lps(again)), train_lps(train, prompt, again["token_ids"]))


def test_sleep_and_wake(engines):
    train, sampler = engines
    prompt = list(range(30, 60))
    want = gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"]
    out = sampler.sleep(level=1)
    assert out["freed_bytes"] > 2**30, out  # the KV cache at least
    with pytest.raises(Conflict, match="wake-inference"):
        gen(sampler, [prompt], temperature=0, max_tokens=4)
    sampler.wake_up()
    assert gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"] == want

    sampler.sleep(level=2)
    sampler.wake_up()
    with pytest.raises(Conflict, match="weight-sync"):
        gen(sampler, [prompt], temperature=0, max_tokens=4)
    sampler.sleep(level=2)
    sampler.wake_up(tags=["weights"])
    sampler.load_weights(train.weights())
    sampler.wake_up(tags=["kv_cache"])
    assert gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"] == want
    with pytest.raises(BadRequest):
        sampler.wake_up(tags=["everything"])


def test_a_sleep_failing_vllms_device_check_is_tried_again_and_leaves_a_usable_sampler(engines, monkeypatch):
    """vLLM's worker compares the device's free memory before and after its release (``torch.accelerator``); another
    process allocating more than the release freed is played by an after-reading (calls 2, 4, ... of a sleep) 1 GiB
    below the before-reading (a fixed cut, 8 GiB, failed to trip the check where the release freed 23 GiB)."""
    from arctic_rl.server.engines import vllm_sleep

    _, sampler = engines
    prompt = list(range(30, 60))
    want = gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"]
    real, calls = torch.accelerator.get_memory_info, []

    def lowered(failing: set[int]):
        def reading(*args):
            free, total = real(*args)
            if len(calls) + 1 in failing:
                free = calls[-1] - 2**30  # below the reading before the release: vLLM sees memory grow
            calls.append(free)
            return free, total
        return reading

    monkeypatch.setattr(vllm_sleep, "PAUSE_S", 0.0)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lowered({2}))  # the first attempt's check fails
    assert sampler.sleep(level=1)["status"] == "sleeping" and len(calls) == 4
    sampler.wake_up()
    assert gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"] == want
    calls.clear()
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lowered({2, 4, 6}))  # every attempt's fails
    with pytest.raises(vllm_sleep.SleepRefused):
        sampler.sleep(level=1)
    assert not sampler.info()["sleeping"]
    assert gen(sampler, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]["token_ids"] == want


def test_training_and_generation_alternate_without_oom(engines):
    train, sampler = engines
    prompts = [[(i + j) % 90 + 5 for j in range(64)] for i in range(64)]
    for _ in range(3):
        sampler.sleep(level=1)
        train_step(train)
        sampler.wake_up(tags=["weights"])
        version = sampler.load_weights(train.weights())
        sampler.wake_up(tags=["kv_cache"])
        results = gen(sampler, prompts, n=2, temperature=1.0, max_tokens=64, logprobs=True)
        assert len(results) == 128 and {r["weight_version"] for r in results} == {version}
    assert not sampler.info()["sleeping"]


# ---------------------------------------------------------------------------- continuous batching


def test_concurrent_calls_join_the_running_batch_and_a_short_call_returns_first(engines):
    import time
    from concurrent.futures import ThreadPoolExecutor

    _, sampler = engines
    long_prompt, short_prompt = list(range(40, 72)), list(range(80, 90))
    finished_at: dict[str, float] = {}

    def run(name, prompts, **params):
        out = gen(sampler, prompts, **params)
        finished_at[name] = time.perf_counter()
        return out

    with ThreadPoolExecutor(8) as pool:
        long = pool.submit(run, "long", [long_prompt] * 4, temperature=1.0, max_tokens=600, ignore_eos=True)
        time.sleep(0.2)  # the long call is decoding
        shorts = [pool.submit(run, f"short{i}", [short_prompt], temperature=0, max_tokens=4, ignore_eos=True)
                  for i in range(4)]
        short_results = [f.result() for f in shorts]
        assert not long.done()  # each short call was answered while the long one still ran
        long_results = long.result()
    assert all(finished_at[f"short{i}"] < finished_at["long"] for i in range(4))
    assert len(long_results) == 4 and {r["generation_len"] for r in long_results} == {600}
    assert len({tuple(r[0]["token_ids"]) for r in short_results}) == 1  # greedy: the same 4 tokens every time
    assert sampler.info()["continuous_batching"] is True


def test_weight_sync_during_generation_restarts_the_calls_in_flight(engines):
    import time

    train, sampler = engines
    assert sampler.in_flight_on_weight_load == "wait"  # the default
    sampler.in_flight_on_weight_load = "restart"
    try:
        prompt = list(range(20, 52))
        version, restarted = sampler.weight_version, sampler.info()["restarted_on_weight_load"]
        train_step(train)  # the trainer moves ahead; the sampler still holds `version`
        torch.cuda.synchronize()
        loop = sampler._loop()
        started = loop.steps
        running = submit(sampler, [prompt] * 2, temperature=1.0, max_tokens=900, ignore_eos=True, logprobs=True,
                          seed=3)
        while loop.steps < started + 20:  # the call decodes
            time.sleep(0.002)
        assert sampler.load_weights(train.weights()) == version + 1
        assert not running.future.done()  # the sync waited for one engine step, not for the call
        results = running.result()
        assert sampler.info()["restarted_on_weight_load"] == restarted + 1
        assert {r["weight_version"] for r in results} == {version + 1}
        assert {r["generation_len"] for r in results} == {900}
        for r in results:  # restarted from its prompt: its tokens come from the new weights from the first one
            assert_close_lps(torch.tensor(sampled_lps(r)[:64]), train_lps(train, prompt, r["token_ids"][:64]))
    finally:
        sampler.in_flight_on_weight_load = "wait"


def test_weight_sync_during_generation_under_wait_waits_for_the_calls_in_flight(engines):
    import threading
    import time

    train, sampler = engines
    sampler.in_flight_on_weight_load = "wait"
    try:
        prompt = list(range(20, 52))
        version = sampler.weight_version
        train_step(train)  # the trainer moves ahead; the sampler still holds `version`
        torch.cuda.synchronize()
        running = submit(sampler, [prompt] * 2, temperature=1.0, max_tokens=900, ignore_eos=True, logprobs=True)
        synced = {}
        sync = threading.Thread(target=lambda: synced.setdefault("v", sampler.load_weights(train.weights())))
        sync.start()
        while sampler._loop().controls_waiting() == 0:  # the load is queued behind the call in flight
            assert sync.is_alive() and not running.future.done()
            time.sleep(0.005)
        after = submit(sampler, [prompt], temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
        before_results = running.result()
        sync.join(timeout=120)
        assert synced["v"] == version + 1
        # the call in flight ran on the old weights from first token to last, and says so
        assert {r["weight_version"] for r in before_results} == {version}
        after_results = after.result()  # queued behind the sync: runs on the new weights only
        assert {r["weight_version"] for r in after_results} == {version + 1}
        assert_close_lps(torch.tensor(sampled_lps(after_results[0])),
                         train_lps(train, prompt, after_results[0]["token_ids"]))
    finally:
        sampler.in_flight_on_weight_load = "wait"
