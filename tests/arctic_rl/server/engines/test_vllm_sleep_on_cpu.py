"""The vLLM sampler's sleep when vLLM's device-wide memory check fails (:mod:`arctic_rl.server.engines.vllm_sleep`).

On a GPU shared with other processes, vLLM's worker releases its memory and then fails its check that the device's
free memory rose (another process allocated meanwhile), before its executor records the sleep. Seen on an H100 with
six runs side by side: the next ``/weight-sync`` then copied into unmapped memory. The stand-in engine
(:class:`~tests.support.vllm_stand_in.SleepModeLLM`) keeps vLLM 0.26's bookkeeping of that sequence: here the sleep is
tried again from a state vLLM knows, and after repeated failures the sampler stays awake and usable and the answer
is a 503 naming the cause. The same on a real vLLM: ``tests/arctic_rl/server/engines/test_vllm_sampler_gpu.py``.
"""

from __future__ import annotations

import pytest

from arctic_rl.protocol import GenerateRequest, SamplingParams
from arctic_rl.server.engines import vllm_sleep
from arctic_rl.server.engines.vllm_sleep import SleepRefused, fall_asleep, is_device_check
from arctic_rl.server.errors import Conflict
from tests.support.vllm_stand_in import SleepModeLLM


@pytest.fixture
def sampler_of(monkeypatch, vllm_stand_in_sampler_around):
    """``sampler_of(check_fails)``: the vLLM sampler around a :class:`SleepModeLLM` failing vLLM's check at those
    attempts (no pause between attempts)."""
    monkeypatch.setattr(vllm_sleep, "PAUSE_S", 0.0)
    return lambda check_fails: vllm_stand_in_sampler_around(SleepModeLLM(check_fails))


def generate(eng, max_tokens: int = 3) -> list[dict]:
    return eng.generate(GenerateRequest(prompts=[[1, 2, 3]]), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_without_the_retry_the_stand_in_breaks_as_vllm_did():
    """The failure this guards against: after the check fails, vLLM's wake does nothing and a weight load touches
    unmapped memory (what the H100 run answered to its next ``/weight-sync``)."""
    llm = SleepModeLLM(check_fails=(1,))
    with pytest.raises(AssertionError, match="Memory usage increased"):
        llm.sleep(level=1)
    llm.wake_up()
    assert not llm.mapped
    with pytest.raises(RuntimeError, match="CUDA error"):
        llm.collective_rpc(lambda worker: None, args=([],))


@pytest.mark.parametrize("apart", [False, True], ids=["engine-core-in-process", "engine-core-apart"])
def test_a_failed_check_is_tried_again_and_the_engine_sleeps_for_real(apart):
    llm = SleepModeLLM(check_fails=(1,), apart=apart)
    assert fall_asleep(llm, 1, pause_s=0.0) == 2
    assert llm.executor_sleeping and not llm.mapped and llm.paused
    llm.wake_up()  # vLLM's own wake now works: the executor recorded the sleep
    assert llm.mapped and not llm.paused and not llm.executor_sleeping


def test_repeated_failures_leave_the_engine_awake_and_answer_503():
    llm = SleepModeLLM(check_fails=(1, 2, 3))
    with pytest.raises(SleepRefused) as refused:
        fall_asleep(llm, 1, attempts=3, pause_s=0.0)
    assert refused.value.status_code == 503 and refused.value.field == "level" and refused.value.received == 1
    assert "3 attempts" in refused.value.message and "another process" in refused.value.message
    assert llm.attempts == 3 and llm.mapped and not llm.paused and not llm.executor_sleeping


def test_other_failures_are_not_retried():
    class Broken(SleepModeLLM):
        def sleep(self, level: int = 1, mode: str = "abort") -> None:
            self.attempts += 1
            raise AssertionError("some other invariant")

    llm = Broken()
    with pytest.raises(AssertionError, match="some other invariant"):
        fall_asleep(llm, 1, pause_s=0.0)
    assert llm.attempts == 1
    assert is_device_check(AssertionError("Memory usage increased after sleeping."))
    assert is_device_check(Exception("Call to sleep method failed: Memory usage increased after sleeping."))
    assert not is_device_check(RuntimeError("Memory usage increased after sleeping."))
    assert not is_device_check(Exception("Call to sleep method failed: some other invariant"))


def test_the_sampler_sleeps_after_one_failed_check_and_generates_after_its_wake(sampler_of):
    eng = sampler_of((1,))
    before = generate(eng)
    answer = eng.sleep(level=1)
    assert answer["status"] == "sleeping" and eng.llm.attempts == 2 and not eng.awake
    with pytest.raises(Conflict, match="wake-inference"):
        generate(eng)
    eng.wake_up()
    assert eng.awake and eng.llm.mapped
    assert [r["token_ids"] for r in generate(eng)] == [r["token_ids"] for r in before]
    eng.load_weights({})  # the next weight sync reaches mapped memory
    assert eng.weight_version == 8


def test_the_sampler_stays_awake_and_usable_when_every_attempt_fails(sampler_of):
    eng = sampler_of((1, 2, 3))
    with pytest.raises(SleepRefused):
        eng.sleep(level=1)
    assert eng.awake and eng.sleep_level == 0 and not eng.weights_discarded
    assert len(generate(eng)) == 1
    eng.load_weights({})
    assert eng.weight_version == 8


def test_at_level_2_a_refused_sleep_says_the_weights_must_be_synced_again(sampler_of):
    eng = sampler_of((1, 2, 3))
    with pytest.raises(SleepRefused):
        eng.sleep(level=2)
    assert eng.awake and eng.weights_discarded  # level 2 dropped them before the check failed
    with pytest.raises(Conflict, match="weight-sync"):
        generate(eng)
    eng.load_weights({})
    assert not eng.weights_discarded and len(generate(eng)) == 1


def test_a_weight_load_failing_in_the_device_is_not_blamed_on_the_weights(sampler_of):
    eng = sampler_of(())
    eng.llm.mapped = False  # what the H100 run's sampler was left with
    with pytest.raises(RuntimeError, match="CUDA error"):  # an internal error (500), not a 400 naming target_sub_job_ids
        eng.load_weights({})


def test_a_refused_sleep_is_answered_503_with_a_json_detail():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from arctic_rl.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/sleep-inference")
    def refuse() -> None:
        fall_asleep(SleepModeLLM(check_fails=(1, 2)), 1, attempts=2, pause_s=0.0)

    answer = TestClient(app).post("/sleep-inference")
    detail = answer.json()["detail"]
    assert answer.status_code == 503  # retried by the adapter's transport (429/502/503/504)
    assert detail["field"] == "level" and detail["received"] == 1 and "stays awake" in detail["message"]
