"""A weight load on the sampler while ``/generate`` calls run (``--in-flight-on-weight-load``).

Under ``restart`` a load waits for the engine step that is running and nothing else: the calls in flight leave the
engine, the weights load, and those calls run again from their prompts and seeds, so every token of an answer comes
from one weight version and the answer says which. Under ``wait`` (the default) the load waits for them.
Checked three ways:

* the loop itself, around a stand-in core whose tokens are the weight version and whose steps the test releases one
  by one (step counts, not wall time): the load runs right after the step that was running; a call that ends in
  that step answers with the old version, the long call restarts and answers with the new one in every token;
  under ``wait`` the load runs after the long call's last step;
* the ``transformers`` sampler on the tiny model: a load sent while a 64-token call decodes returns within a step or
  two, and that call's tokens and log-probs are those the new weights give (greedy, and seeded sampling);
* the vLLM sampler's engine code around the stand-in ``LLMEngine`` (it refuses a load while requests run): the
  requests are aborted, the engine settles (steps until its prefix cache can be reset, as vLLM's async scheduling
  needs) before the load, and they are re-added with their seeds under new ids; an engine that never settles fails
  the load and the calls go on with the old weights; a prefix-cache reset does not wait for the calls in flight;
* a bad policy is refused naming the option, the allowed values and what was given.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from arctic_rl.protocol import GenerateRequest, SamplingParams
from arctic_rl.server.engines.continuous import ContinuousLoop
from arctic_rl.server.settings import ServerSettings
from tests.support.sampling import submit

LONG = [5, 6, 7, 8, 9, 10, 11]


class VersionCore:
    """A stand-in core: each step gives every call in flight one token, the current weight version, and waits for
    the test's permit first; ``load`` refuses while any call's sequences are in the engine."""

    def __init__(self) -> None:
        self.version = 0
        self.tokens: dict = {}
        self.permits = threading.Semaphore(0)
        self.free = False

    def admit(self, call):
        call.weight_version = self.version
        self.tokens[call] = []

    def step(self):
        if not self.free:
            self.permits.acquire()
        done = []
        for call, toks in list(self.tokens.items()):
            toks.append(self.version)
            if len(toks) >= call.payload:
                done.append((call, list(toks)))
                del self.tokens[call]
        return done

    def abort(self, call):
        self.tokens.pop(call, None)

    def run_free(self) -> None:
        """Steps stop waiting for permits (one is released for a step that waits now)."""
        self.free = True
        self.permits.release()

    def has_room(self, call, admitting):
        return True

    def load(self, loop: ContinuousLoop, seen: dict) -> int:
        assert not self.tokens, "weights loaded while calls are in the engine"
        seen["steps"] = loop.steps
        self.version += 1
        return self.version


def run_steps(core: VersionCore, loop: ContinuousLoop, n: int) -> None:
    target = loop.steps + n
    for _ in range(n):
        core.permits.release()
    while loop.steps < target:
        time.sleep(0.0005)


def load_during_a_step(when: str):
    """A 64-step call and a 5-step call run; a load is sent while the step that ends the short call runs."""
    core = VersionCore()
    loop = ContinuousLoop(core, name="test sampler")
    long, short = loop.submit(64), loop.submit(5)
    while len(core.tokens) < 2:
        run_steps(core, loop, 1)
    run_steps(core, loop, 4 - len(core.tokens[short]))  # the short call has 4 tokens: its next step ends it
    seen: dict = {}
    result: dict = {}
    sync = threading.Thread(target=lambda: result.setdefault("v", loop.control(lambda: core.load(loop, seen),
                                                                                   when=when)))
    sync.start()
    while loop.controls_waiting() == 0 and not seen:
        time.sleep(0.0005)
    running_step = loop.steps  # the loop waits in step running_step + 1 for its permit
    assert not seen  # the load waits for the running step
    run_steps(core, loop, 1)
    return core, loop, long, short, sync, seen, result, running_step


def test_a_restart_load_waits_for_the_running_step_only_and_restarts_the_calls_in_flight():
    core, loop, long, short, sync, seen, result, running_step = load_during_a_step("restart")
    sync.join(timeout=10)
    assert result["v"] == 1 and seen["steps"] == running_step + 1  # ran right after the step that was running
    assert short.future.result(timeout=10) == [0] * 5 and short.weight_version == 0  # ended in that step: old
    assert not long.future.done() and long.restarts == 1 and loop.restarted == 1
    core.run_free()
    assert long.future.result(timeout=10) == [1] * 64  # all 64 tokens from the new weights, from the first
    assert long.weight_version == 1
    loop.close()


def test_a_wait_load_waits_for_every_call_in_flight():
    core, loop, long, short, sync, seen, _, _ = load_during_a_step("idle")
    assert short.future.result(timeout=10) == [0] * 5
    assert not seen and not long.future.done()  # still waiting for the long call
    late = loop.submit(3)  # queued behind the load
    core.run_free()
    sync.join(timeout=10)
    assert long.future.result(timeout=10) == [0] * 64 and long.weight_version == 0 and long.restarts == 0
    assert seen["steps"] >= 64 and loop.restarted == 0
    assert late.future.result(timeout=10) == [1] * 3 and late.weight_version == 1
    loop.close()


def test_a_restarted_call_waiting_to_re_enter_can_be_cancelled():
    core = VersionCore()
    loop = ContinuousLoop(core, name="test sampler")
    call = loop.submit(10)
    while not core.tokens:
        run_steps(core, loop, 1)
    gate = threading.Event()
    sync = threading.Thread(target=lambda: loop.control(gate.wait, when="restart"))
    sync.start()
    run_steps(core, loop, 1)  # the step that was running; then the load holds the loop with the call taken out
    while not call.restarts:
        time.sleep(0.0005)
    loop.cancel(call)  # out of the engine, its future running: it is failed, not left unanswered or re-admitted
    gate.set()
    sync.join(timeout=10)
    with pytest.raises(CancelledError):
        call.future.result(timeout=10)
    core.run_free()
    assert loop.submit(2).future.result(timeout=10) == [0, 0]
    loop.close()


# ---------------------------------------------------------------------------------------------- transformers sampler


@pytest.fixture(scope="module")
def engine(hf_sampler):
    return hf_sampler


def direct_logprobs(model, prompt, tokens, temperature=1.0):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"])
def test_the_transformers_sampler_restarts_a_call_in_flight_on_the_new_weights(engine, params, monkeypatch):
    assert engine.in_flight_on_weight_load == "wait"  # the default
    monkeypatch.setattr(engine, "in_flight_on_weight_load", "restart")
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = {k: v + 0.05 * torch.randn_like(v) if v.dtype.is_floating_point else v for k, v in original.items()}
    version, restarted = engine.weight_version, engine.info()["restarted_on_weight_load"]
    loop = engine._loop()
    asked = dict(max_tokens=64, ignore_eos=True, logprobs=0, logprobs_format="sampled", **params)
    running = submit(engine, [LONG], **asked)
    while not loop.core.rows or len(loop.core.rows[0].tokens) < 3:  # it decodes
        time.sleep(0.0005)
    seen: dict = {}
    load = engine._load_weights

    def recording(weights):
        seen.update(steps=loop.steps, done=running.future.done(), rows=len(loop.core.rows))
        return load(weights)

    monkeypatch.setattr(engine, "_load_weights", recording)
    sent_at = loop.steps
    try:
        assert engine.load_weights(other) == version + 1
        assert seen["steps"] - sent_at <= 2  # the step running (and at most one that began as the load was sent)
        assert not seen["done"] and seen["rows"] == 0  # the call was taken out, not finished, before the load
        (restarted_answer,) = running.result()
        (fresh,) = submit(engine, [LONG], **asked).result()  # the same call sent after the load
        assert restarted_answer["weight_version"] == fresh["weight_version"] == version + 1
        assert restarted_answer["generation_len"] == 64
        assert restarted_answer["token_ids"] == fresh["token_ids"]  # same prompt, same seed, new weights
        want = direct_logprobs(engine.model, LONG, restarted_answer["token_ids"], params["temperature"] or 1.0)
        assert torch.allclose(torch.tensor(restarted_answer["logprobs"]), want, atol=1e-4)  # every token: new weights
        assert engine.info()["restarted_on_weight_load"] == restarted + 1
    finally:
        monkeypatch.undo()
        engine.load_weights(original)


# ---------------------------------------------------------------------------------------------- vLLM sampler


@pytest.fixture
def vllm_engine(vllm_stand_in_sampler):
    eng = vllm_stand_in_sampler
    step = eng.llm.step

    def slowed():
        time.sleep(0.002)
        return step()

    eng.llm.step = slowed
    return eng


def vllm_submit(engine, prompts, **params):
    return engine.submit_generate(GenerateRequest(prompts=prompts), SamplingParams(ignore_eos=True, **params))


def vllm_decoding(engine, prompts, **params):
    """:func:`vllm_submit`, returned once the stand-in engine is decoding the call."""
    running = vllm_submit(engine, prompts, **params)
    while not engine.llm.running:
        time.sleep(0.001)
    return running


def test_the_vllm_sampler_aborts_and_re_adds_the_requests_in_flight(vllm_engine):
    eng = vllm_engine
    assert eng.in_flight_on_weight_load == "wait"  # the default
    eng.in_flight_on_weight_load = "restart"
    running = vllm_submit(eng, [[1, 2], [3]], max_tokens=200, n=2, seed=4)
    while eng.llm.steps < 3:
        time.sleep(0.001)
    load, seen, order = eng.llm.collective_rpc, {}, []

    def recording_load(fn, args=()):
        order.append("load")
        seen["steps"] = eng.llm.steps
        return load(fn, args)

    def reset_once_settled() -> bool:  # async scheduling: the aborted requests' blocks are freed (and the cache
        order.append("reset")  # can be reset) once the step still in flight for them is processed
        return order.count("reset") > 1

    eng.llm.collective_rpc, eng.llm.reset_prefix_cache = recording_load, reset_once_settled
    sent_at = eng.llm.steps
    assert eng.load_weights({}) == 8  # the stand-in refuses a load while requests run: they were aborted first
    assert seen["steps"] - sent_at <= 3 and not running.future.done()  # the running step and the settling one
    assert order == ["reset", "reset", "load", "reset"]  # refused, one engine step, reset, load, reset
    while not eng.llm.running:  # admitted again, under new request ids
        time.sleep(0.001)
    call_id = running.call.call_id
    assert sorted(eng.llm.running) == [f"c{call_id}-0r1", f"c{call_id}-1r1"]
    assert all(p.seed is not None for p, _ in eng.llm.running.values())  # re-added with the call's own seeds
    results = running.result()
    assert [r["generation_len"] for r in results] == [200] * 4
    assert all(set(r["token_ids"]) == {101} and r["weight_version"] == 8 for r in results)  # new weights only
    assert eng.info()["restarted_on_weight_load"] == 1 and eng.info()["in_flight_on_weight_load"] == "restart"


def test_a_vllm_load_whose_engine_does_not_settle_fails_and_the_calls_go_on_with_the_old_weights(vllm_engine):
    eng = vllm_engine
    running = vllm_decoding(eng, [[1, 2]], max_tokens=100)
    eng.llm.reset_prefix_cache = lambda: False  # blocks never freed
    with pytest.raises(RuntimeError, match="still holds KV blocks"):
        eng.load_weights({})
    (answer,) = running.result()  # admitted again, on the weights it had
    assert eng.weight_version == 7 and answer["weight_version"] == 7 and set(answer["token_ids"]) == {100}


def test_the_vllm_sampler_under_wait_keeps_the_old_behaviour(vllm_engine):
    eng = vllm_engine
    eng.in_flight_on_weight_load = "wait"
    running = vllm_decoding(eng, [[1, 2]], max_tokens=60)
    assert eng.reset_prefix_cache() == {"status": "ok", "reset": True}  # waited: nothing in flight any more
    assert running.future.done()
    running = vllm_decoding(eng, [[1, 2]], max_tokens=60)
    assert eng.load_weights({}) == 8 and running.future.done()  # the load waited for the call
    (old,) = running.result()
    assert old["weight_version"] == 7 and set(old["token_ids"]) == {100}
    assert eng.info()["restarted_on_weight_load"] == 0


def test_a_prefix_cache_reset_under_restart_does_not_wait_for_the_calls(vllm_engine):
    eng = vllm_engine
    eng.in_flight_on_weight_load = "restart"
    running = vllm_decoding(eng, [[1, 2]], max_tokens=300)
    # vLLM keeps the blocks running requests hold; none is stale (the last load reset the cache before admitting)
    assert eng.reset_prefix_cache() == {"status": "busy", "reset": False}
    assert not running.future.done()
    assert set(running.result()[0]["token_ids"]) == {100}


# ---------------------------------------------------------------------------------------------- the option


def test_a_bad_policy_is_refused_naming_the_option_the_choices_and_the_value(capsys):
    from arctic_rl.server.__main__ import parse_args

    assert ServerSettings().in_flight_on_weight_load == "wait"
    assert parse_args([]).in_flight_on_weight_load == "wait"
    assert parse_args(["--in-flight-on-weight-load", "restart"]).in_flight_on_weight_load == "restart"
    with pytest.raises(ValueError) as info:
        ServerSettings(in_flight_on_weight_load="abort")
    assert str(info.value) == "in_flight_on_weight_load: expected one of ['restart', 'wait'], got 'abort'"
    with pytest.raises(SystemExit):
        parse_args(["--in-flight-on-weight-load", "abort"])
    err = capsys.readouterr().err
    assert "--in-flight-on-weight-load" in err and "'abort'" in err and "'restart'" in err and "'wait'" in err
