"""The vLLM sampler's continuous batching on a CPU machine (no vLLM here): the server's own engine code -- the loop
thread, :class:`~arctic_rl.server.engines.vllm_steps.VllmStepCore`, the weight load and the answer -- around a
stand-in engine with vLLM's ``LLMEngine`` interface (``tests/support/vllm_stand_in.py``: one token per step, the token is
the engine's weight version). The GPU test (``test_vllm_sampler_gpu.py``) runs the same code on real vLLM.

* calls join the running requests: a 4-token call sent while a 60-token call runs is answered first, and the
  engine ran both at once;
* ``n`` completions come back grouped by prompt, the outputs found under the caller's ids though vLLM keeps
  suffixed ones;
* under ``--in-flight-on-weight-load wait``, a weight load waits for the calls in flight (the stand-in refuses loads
  while requests run): the running call answers with the old version in every token, the call queued behind the
  load with the new one only (the default, ``restart``: ``test_weight_load_in_flight_on_cpu.py``);
* a call to a sleeping engine is refused at admission with a 409, and the loop stops with the job.
"""

from __future__ import annotations

import threading
import time

import pytest

from arctic_rl.protocol import GenerateRequest, SamplingParams
from arctic_rl.server.engines.continuous import LoopClosed
from arctic_rl.server.errors import Conflict
from tests.support.vllm_stand_in import StepwiseLLM


@pytest.fixture
def engine(vllm_stand_in_sampler):
    return vllm_stand_in_sampler


def submit(engine, prompts, **params):
    return engine.submit_generate(GenerateRequest(prompts=prompts), SamplingParams(ignore_eos=True, **params))


def slow_steps(engine, seconds: float = 0.002) -> None:
    step = engine.llm.step

    def slowed():
        time.sleep(seconds)
        return step()

    engine.llm.step = slowed


def test_a_short_call_joins_the_running_batch_and_returns_first(engine):
    slow_steps(engine)
    long = submit(engine, [[1, 2, 3], [4, 5]], max_tokens=60, n=2)
    while not engine.llm.running:
        time.sleep(0.001)
    short = submit(engine, [[9]], max_tokens=4)
    short_results = short.result()
    assert not long.future.done() and engine.llm.max_running == 3  # both calls' requests ran at once
    long_results = long.result()
    assert [r["generation_len"] for r in short_results] == [4]
    assert [(r["prompt_index"], r["sample_index"]) for r in long_results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["generation_len"] for r in long_results} == {60} and {r["prompt_len"] for r in long_results} == {3, 2}
    assert engine.info()["continuous_batching"] is True and not engine.llm.running


def test_a_full_determinism_job_runs_every_call_alone(vllm_stand_in_sampler_around):
    eng = vllm_stand_in_sampler_around(StepwiseLLM(), full_determinism=True)
    slow_steps(eng)
    long = submit(eng, [[1, 2, 3]], max_tokens=40, seed=1)
    while not eng.llm.running:
        time.sleep(0.001)
    short = submit(eng, [[9]], max_tokens=4, seed=2)
    short.result()
    assert long.future.done() and eng.llm.max_running == 1  # the short call never joined the long one


def test_a_weight_load_under_wait_waits_for_the_calls_in_flight_and_no_answer_mixes_versions(engine):
    engine.in_flight_on_weight_load = "wait"
    slow_steps(engine)
    running = submit(engine, [[1, 2]], max_tokens=200)
    while not engine.llm.running:
        time.sleep(0.001)
    loaded: dict[str, int] = {}
    sync = threading.Thread(target=lambda: loaded.setdefault("v", engine.load_weights({})))
    sync.start()
    while engine._loop().controls_waiting() == 0 and "v" not in loaded:
        time.sleep(0.001)
    after = submit(engine, [[3]], max_tokens=5)  # queued behind the load
    (old,) = running.result()
    sync.join(timeout=30)
    (new,) = after.result()
    assert loaded["v"] == 8 and engine.weight_version == 8
    assert old["weight_version"] == 7 and set(old["token_ids"]) == {100}  # every token on the old weights
    assert new["weight_version"] == 8 and set(new["token_ids"]) == {101}  # every token on the new weights


def test_a_sleeping_engine_refuses_at_admission_and_a_closed_loop_refuses_calls(engine):
    engine.sleeping = {"weights": True, "kv_cache": True}
    engine.sleep_level = 1
    with pytest.raises(Conflict, match="wake-inference"):
        submit(engine, [[1]], max_tokens=2)
    engine.sleeping = {"weights": False, "kv_cache": False}
    assert submit(engine, [[1]], max_tokens=2).result()[0]["token_ids"] == [100, 100]
    engine._loop().close("destroyed")
    with pytest.raises(LoopClosed):
        submit(engine, [[1]], max_tokens=2)
