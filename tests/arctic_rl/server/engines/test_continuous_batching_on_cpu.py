"""Continuous batching in the reference server's ``transformers`` sampler, and the loop both samplers share.

Checked on the real sampler (tiny Qwen3, CPU):

* a call with ``max_tokens`` 4 sent while a call with ``max_tokens`` 64 runs is answered first, while the long
  one still runs -- in the engine and through the server's HTTP ``/generate`` (the route takes no job lock);
* a call that joined a running batch samples what it samples alone (greedy: the same tokens; its log-probs equal a
  direct ``transformers`` computation of the same sequence), so merging the batches mixes nothing between calls;
* a full batch (``max_rows``: the job's ``max_num_seqs``, else ``--generate-batch-size``) makes new calls wait;
* under ``--in-flight-on-weight-load wait``, a weight sync sent during a generation waits for it: the call in flight
  is answered with the old version and old-weight tokens, the call queued behind the sync with the new version and
  new-weight tokens only (the default, ``restart``: ``test_weight_load_in_flight_on_cpu.py``);
* the loop itself: control operations wait for the calls in flight, calls after a control wait for it, a failed
  step fails its calls, a closed loop refuses new calls.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.engines.continuous import ContinuousLoop, LoopClosed
from arctic_rl.server.settings import ServerSettings
from tests.support.sampling import submit

LONG, SHORT = [5, 6, 7, 8, 9, 10, 11], [12, 13, 14]


@pytest.fixture(scope="module")
def engine(hf_sampler):
    return hf_sampler


def direct_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_short_call_sent_during_a_long_one_returns_first(engine):
    alone = submit(engine, [SHORT], temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, logprobs_format="sampled").result()
    long = submit(engine, [LONG] * 2, n=2, temperature=1.0, max_tokens=64, ignore_eos=True, seed=3)
    while engine._loop().core.rows == []:  # the long call is in the batch
        time.sleep(0.001)
    short = submit(engine, [SHORT], temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, logprobs_format="sampled")
    joined = short.result()
    assert not long.future.done()  # answered while the long call still runs
    long_results = long.result()
    assert [r["generation_len"] for r in long_results] == [64] * 4
    assert [(r["prompt_index"], r["sample_index"]) for r in long_results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the short call joined a running batch (padded, merged caches) and sampled exactly what it samples alone
    assert joined[0]["token_ids"] == alone[0]["token_ids"] and joined[0]["generation_len"] == 4
    assert torch.allclose(torch.tensor(joined[0]["logprobs"]), torch.tensor(alone[0]["logprobs"]), atol=1e-5)
    assert all(r["logprobs"] is None for r in long_results)  # it asked for none
    direct = direct_logprobs(engine.model, SHORT, joined[0]["token_ids"])
    assert torch.allclose(torch.tensor(joined[0]["logprobs"]), direct, atol=1e-4)


def test_joined_calls_keep_their_own_parameters_and_log_probs(engine):
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(lambda k=k: submit(engine, [LONG[: 3 + k]], temperature=0.7 + 0.1 * k,
                                                  max_tokens=8 + 4 * k, ignore_eos=True, seed=k,
                                                  logprobs=0, logprobs_format="sampled").result())
                   for k in range(4)]
        answers = [f.result() for f in futures]
    for k, (res,) in enumerate(answers):
        assert res["generation_len"] == 8 + 4 * k
        temperature = 0.7 + 0.1 * k  # the reported log-prob is log_softmax(logits / temperature)
        ids = torch.tensor([LONG[: 3 + k] + res["token_ids"]])
        with torch.no_grad():
            z = engine.model(input_ids=ids).logits[0, 2 + k : -1].float() / temperature
        want = torch.log_softmax(z, -1).gather(-1, torch.tensor(res["token_ids"])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(res["logprobs"]), want, atol=1e-4), k


def test_a_full_batch_makes_new_calls_wait_in_order(engine):
    core = engine._loop().core
    assert core.max_rows == engine.batch_size == 64  # --generate-batch-size (or the job's max_num_seqs)
    core.max_rows = 4
    try:
        order: list[str] = []
        full = submit(engine, [LONG] * 2, n=2, temperature=0, max_tokens=200, ignore_eos=True)
        full.future.add_done_callback(lambda _: order.append("full"))
        while not core.rows:
            time.sleep(0.001)
        waiting = submit(engine, [SHORT], temperature=0, max_tokens=2, ignore_eos=True)
        waiting.future.add_done_callback(lambda _: order.append("waiting"))
        assert [r["generation_len"] for r in waiting.result()] == [2]
        full.result()
        assert order == ["full", "waiting"]  # no room beside the 4 rows: the 2-token call waited for them
        big = submit(engine, [SHORT] * 6, temperature=0, max_tokens=2, ignore_eos=True)  # larger than the batch
        assert len(big.result()) == 6  # an idle core takes any call
    finally:
        core.max_rows = engine.batch_size


def test_a_full_determinism_job_runs_every_call_alone(tiny_model_dir):
    """verl's rollout.full_determinism: a seeded call samples the same whatever else runs, so nothing joins it."""
    from arctic_rl.server.engines.sampling import SamplingEngine

    eng = SamplingEngine(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.SAMPLING, full_determinism=True),
                         ServerSettings(device="cpu"))
    try:
        long = submit(eng, [LONG], temperature=1.0, max_tokens=48, ignore_eos=True, seed=3)
        while eng._loop().core.rows == []:
            time.sleep(0.001)
        short = submit(eng, [SHORT], temperature=1.0, max_tokens=2, ignore_eos=True, seed=4)
        short.result()
        assert long.future.done()  # the short call waited for the long one: it never joined its batch
        assert len(long.result()[0]["token_ids"]) == 48
    finally:
        eng.close()


def test_a_weight_sync_under_wait_lets_the_generation_end_and_never_mixes_weights(engine, monkeypatch):
    monkeypatch.setattr(engine, "in_flight_on_weight_load", "wait")
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = {k: v + 0.05 * torch.randn_like(v) if v.dtype.is_floating_point else v for k, v in original.items()}
    version = engine.weight_version
    old_alone = submit(engine, [LONG], temperature=0, max_tokens=48, ignore_eos=True, logprobs=0, logprobs_format="sampled").result()
    running = submit(engine, [LONG], temperature=0, max_tokens=48, ignore_eos=True, logprobs=0, logprobs_format="sampled")
    synced: dict[str, int] = {}
    sync = threading.Thread(target=lambda: synced.setdefault("v", engine.load_weights(other)))
    sync.start()
    while engine._loop().controls_waiting() == 0 and "v" not in synced:
        time.sleep(0.001)
    after = submit(engine, [LONG], temperature=0, max_tokens=48, ignore_eos=True, logprobs=0, logprobs_format="sampled")
    before = running.result()
    sync.join(timeout=60)
    try:
        assert synced["v"] == version + 1
        assert before[0]["weight_version"] == version and before[0]["token_ids"] == old_alone[0]["token_ids"]
        new = after.result()[0]
        assert new["weight_version"] == version + 1
        assert torch.allclose(torch.tensor(new["logprobs"]),
                              direct_logprobs(engine.model, LONG, new["token_ids"]), atol=1e-4)
        assert not torch.allclose(torch.tensor(new["logprobs"]), torch.tensor(before[0]["logprobs"]), atol=1e-3)
    finally:
        engine.load_weights(original)


class _Counter:
    """A stand-in core: a call of ``k`` steps ends after ``k`` steps; records what ran in which order."""

    def __init__(self) -> None:
        self.left: dict = {}
        self.log: list[str] = []
        self.fail_next = False

    def admit(self, call):
        call.weight_version = len(self.log)
        self.left[call] = call.payload

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("step failed")
        self.log.append("step")
        done = []
        for call in list(self.left):
            self.left[call] -= 1
            if self.left[call] == 0:
                done.append((call, call.call_id))
                del self.left[call]
        time.sleep(0.002)
        return done

    def abort(self, call):
        self.left.pop(call, None)

    def has_room(self, call, admitting):
        return True


def test_the_loop_runs_controls_between_calls_and_fails_calls_cleanly():
    core = _Counter()
    loop = ContinuousLoop(core, name="test sampler")
    long = loop.submit(50)
    while not core.left:
        time.sleep(0.001)
    result: dict = {}
    ctl = threading.Thread(target=lambda: result.setdefault("c", loop.control(lambda: core.log.append("ctl") or 7)))
    ctl.start()
    while loop.controls_waiting() == 0:
        time.sleep(0.001)
    late = loop.submit(1)  # queued behind the control: runs after it
    ctl.join(timeout=10)
    assert result["c"] == 7 and long.future.done()
    assert late.future.result(timeout=10) == late.call_id
    assert core.log.index("ctl") == 50 and core.log[-1] == "step"  # the control ran once the long call ended
    core.fail_next = True
    failing = loop.submit(3)
    with pytest.raises(RuntimeError, match="step failed"):
        failing.future.result(timeout=10)
    again = loop.submit(2)
    assert again.future.result(timeout=10) == again.call_id  # the loop survives a failed step
    pending = loop.submit(10_000)
    loop.close("destroyed")
    with pytest.raises(LoopClosed):
        pending.future.result(timeout=10)
    with pytest.raises(LoopClosed):
        loop.submit(1)


@pytest.mark.slow
def test_through_http_a_short_generate_returns_during_a_long_one(reference_server, tiny_model_dir):
    import requests

    from tests.support.server import decode, post_frame

    url = reference_server.url
    assert "continuous_batching" in requests.get(url + "/health", timeout=5).json()["features"]
    job = decode(requests.post(url + "/initialize", json={"model_name": str(tiny_model_dir),
                                                         "job_type": "sampling"}))["job_id"]
    done_at: dict[str, float] = {}

    def call(name, prompts, **params):
        body = {"prompts": prompts, "sampling_params": {"temperature": 0, "ignore_eos": True, **params}}
        answer = decode(post_frame(reference_server, f"/generate?job_id={job}", body))
        done_at[name] = time.perf_counter()
        return answer

    try:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(call, "long", [LONG] * 4, max_tokens=64)
            while not requests.get(f"{url}/job/{job}", timeout=5).json()["busy"]:
                time.sleep(0.002)
            short = call("short", [SHORT], max_tokens=4)
            assert not long.done()
            long_answer = long.result()
        assert done_at["short"] < done_at["long"]
        assert [r["generation_len"] for r in short["results"]] == [4]
        assert [r["generation_len"] for r in long_answer["results"]] == [64] * 4
        assert short["weight_version"] == long_answer["weight_version"] == 0  # the answer says its version
        with ThreadPoolExecutor(1) as pool:  # destroyed while a call runs: that call is a 409, not a 500
            body = {"prompts": [LONG], "sampling_params": {"max_tokens": 400, "ignore_eos": True}}
            running = pool.submit(post_frame, reference_server, f"/generate?job_id={job}", body)
            while not requests.get(f"{url}/job/{job}", timeout=5).json()["busy"]:
                time.sleep(0.002)
            requests.post(f"{url}/destroy?job_id={job}", json={"job_type": "sampling"}, timeout=60).raise_for_status()
            answer = running.result()
        assert answer.status_code == 409 and answer.json()["detail"]["field"] == "job_id"
    finally:
        requests.post(f"{url}/destroy?job_id={job}", json={"job_type": "sampling"}, timeout=60)
