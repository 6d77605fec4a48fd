"""The ``arctic`` rollout replica: request coalescing (servers without ``continuous_batching``), sampling-parameter
mapping, and (slow) the real server actor in Ray talking to the reference Arctic RL server through ArcticRLClient
(which batches continuously: the samples of a prompt go as one request, ``tests/remote_backend/workers/
test_rollout_dispatch_on_cpu.py``)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from verl.remote_backend.workers.coalescer import RequestAborted, RequestCoalescer, params_key
from verl.workers.remote_client.arctic.replica import to_protocol_sampling_params


class _Recorder:
    """A batch function that echoes ``prompt[0] * 10`` per prompt and records what it saw."""

    def __init__(self, delay_s: float = 0.01, fail_on: int | None = None):
        self.batches: list[tuple[list[list[int]], dict]] = []
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.running = 0
        self.max_running = 0

    async def __call__(self, prompts, params):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            self.batches.append((prompts, params))
            await asyncio.sleep(self.delay_s)
            if self.fail_on is not None and any(p[0] == self.fail_on for p in prompts):
                raise RuntimeError(f"backend refused prompt {self.fail_on}")
            return [p[0] * 10 for p in prompts]
        finally:
            self.running -= 1


def _run(coro):
    return asyncio.run(coro)


def test_concurrent_calls_share_batches_and_get_their_own_results():
    rec = _Recorder()

    async def main():
        co = RequestCoalescer(rec, max_batch_size=64, max_wait_ms=20)
        results = await asyncio.gather(*[co.submit([i], {"temperature": 1.0}) for i in range(20)])
        await co.close()
        return results

    assert _run(main()) == [i * 10 for i in range(20)]
    assert len(rec.batches) < 20  # coalesced
    assert sum(len(p) for p, _ in rec.batches) == 20


def test_batches_never_exceed_max_batch_size():
    rec = _Recorder()

    async def main():
        co = RequestCoalescer(rec, max_batch_size=3, max_wait_ms=50)
        out = await asyncio.gather(*[co.submit([i], {}) for i in range(10)])
        await co.close()
        return out

    assert _run(main()) == [i * 10 for i in range(10)]
    sizes = [len(p) for p, _ in rec.batches]
    assert max(sizes) <= 3 and sum(sizes) == 10
    assert sizes.count(3) >= 3  # full batches leave without waiting for the timer


def test_calls_are_grouped_by_identical_sampling_params():
    rec = _Recorder()
    greedy = {"temperature": 0.0, "max_tokens": 8}
    sampled = {"max_tokens": 8, "temperature": 1.0}

    async def main():
        co = RequestCoalescer(rec, max_batch_size=64, max_wait_ms=20)
        calls = [co.submit([i], greedy if i % 2 else sampled) for i in range(12)]
        out = await asyncio.gather(*calls)
        await co.close()
        return out

    assert _run(main()) == [i * 10 for i in range(12)]
    for prompts, params in rec.batches:
        parity = {p[0] % 2 for p in prompts}
        assert len(parity) == 1, f"mixed parameters in one batch: {prompts}"
        assert params == (greedy if parity == {1} else sampled)
    assert params_key({"a": 1, "b": 2}) == params_key({"b": 2, "a": 1})


def test_an_error_reaches_every_caller_of_the_batch_and_the_next_batch_still_runs():
    rec = _Recorder(fail_on=3)

    async def main():
        co = RequestCoalescer(rec, max_batch_size=64, max_wait_ms=20)
        first = await asyncio.gather(*[co.submit([i], {}) for i in range(5)], return_exceptions=True)
        second = await asyncio.gather(*[co.submit([i], {}) for i in (5, 6)])
        await co.close()
        return first, second

    first, second = _run(main())
    assert all(isinstance(r, RuntimeError) and "refused prompt 3" in str(r) for r in first)
    assert second == [50, 60]


def test_in_flight_batches_are_bounded_and_waiting_groups_grow():
    rec = _Recorder(delay_s=0.05)

    async def main():
        co = RequestCoalescer(rec, max_batch_size=4, max_wait_ms=0, max_in_flight=1)
        tasks = []
        for i in range(12):
            tasks.append(asyncio.create_task(co.submit([i], {})))
            await asyncio.sleep(0.005)  # trickle in while a batch is running
        out = await asyncio.gather(*tasks)
        await co.close()
        return out

    assert _run(main()) == [i * 10 for i in range(12)]
    assert rec.max_running == 1
    assert len(rec.batches) < 12  # calls that arrived during a batch were sent together


def test_a_lone_call_leaves_after_max_wait():
    rec = _Recorder(delay_s=0.0)

    async def main():
        co = RequestCoalescer(rec, max_batch_size=64, max_wait_ms=30)
        start = time.monotonic()
        out = await co.submit([7], {})
        elapsed = time.monotonic() - start
        await co.close()
        return out, elapsed

    out, elapsed = _run(main())
    assert out == 70
    assert 0.025 <= elapsed < 1.0


def test_every_batch_logs_its_calls_their_arrival_span_the_wait_and_the_run(caplog):
    rec = _Recorder(delay_s=0.05)

    async def main():
        co = RequestCoalescer(rec, max_batch_size=3, max_wait_ms=1000)
        first = asyncio.ensure_future(co.submit([1], {}))
        await asyncio.sleep(0.04)  # the batch's calls arrive 40 ms apart
        rest = [asyncio.ensure_future(co.submit([i], {})) for i in (2, 3)]
        out = await asyncio.gather(first, *rest)
        await co.close()
        return out

    with caplog.at_level(logging.INFO, logger="verl.remote_backend.workers.coalescer"):
        assert _run(main()) == [10, 20, 30]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generate batch:")]
    assert len(lines) == 1, lines
    words = lines[0].split()
    calls, span_ms, waited_ms, ran_s = int(words[2]), float(words[6]), float(words[11]), float(words[14])
    assert calls == 3
    assert 30 <= span_ms <= waited_ms < 1000  # sent when full, not after max_wait_ms
    assert 0.04 <= ran_s < 1.0


def test_wrong_result_count_is_an_error_for_every_caller():
    async def short(prompts, params):
        return [0] * (len(prompts) - 1)

    async def main():
        co = RequestCoalescer(short, max_batch_size=8, max_wait_ms=10)
        out = await asyncio.gather(*[co.submit([i], {}) for i in range(3)], return_exceptions=True)
        await co.close()
        return out

    out = _run(main())
    assert all(isinstance(r, RuntimeError) and "expected 3 results" in str(r) for r in out)


def test_abort_pending_fails_unsent_calls_only():
    rec = _Recorder(delay_s=0.05)

    async def main():
        co = RequestCoalescer(rec, max_batch_size=1, max_wait_ms=0, max_in_flight=1)
        tasks = [asyncio.create_task(co.submit([i], {})) for i in range(4)]
        await asyncio.sleep(0.02)  # the first batch is running, the rest queue
        aborted = co.abort_pending("test")
        out = await asyncio.gather(*tasks, return_exceptions=True)
        await co.close()
        return aborted, out

    aborted, out = _run(main())
    assert out[0] == 0
    assert aborted == 3 and all(isinstance(r, RequestAborted) for r in out[1:])


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_batch_size": 0, "max_wait_ms": 1}, "max_batch_size"),
     ({"max_batch_size": 2, "max_wait_ms": -1}, "max_wait_ms"),
     ({"max_batch_size": 2, "max_wait_ms": 1, "max_in_flight": 0}, "max_in_flight")],
)
def test_bad_settings_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RequestCoalescer(_Recorder(), **kwargs)


def test_the_batching_options_are_read_once_for_every_backend():
    """``remote_backend.rollout``'s batching keys, as the rollout server reads them (the vendor's other keys
    of that node ignored); the vendors' config mirrors extend the same class."""
    from omegaconf import OmegaConf

    from verl.remote_backend.errors import RemoteBackendConfigError
    from verl.remote_backend.workers.batching import RolloutBatching
    from verl.workers.remote_client.tinker.config import TinkerRolloutConfig

    main = OmegaConf.create({"remote_backend": {"rollout": {"max_batch_size": 8, "max_wait_ms": 2,
                                                            "max_in_flight": 3, "num_devices": 1}}})
    assert RolloutBatching.from_main_config(main) == RolloutBatching(max_batch_size=8, max_wait_ms=2.0, max_in_flight=3)
    assert RolloutBatching.from_main_config(OmegaConf.create({"remote_backend": {"name": "x"}})) == RolloutBatching()
    assert issubclass(TinkerRolloutConfig, RolloutBatching)
    for key, bad in (("max_batch_size", 0), ("max_wait_ms", -1), ("max_in_flight", 0), ("max_batch_size", "many")):
        with pytest.raises(RemoteBackendConfigError) as err:
            RolloutBatching.from_main_config(OmegaConf.create({"remote_backend": {"rollout": {key: bad}}}))
        assert err.value.field == f"remote_backend.rollout.{key}" and err.value.received == bad


# ------------------------------------------------------------------ sampling parameters
def test_verl_agent_loop_params_map_to_the_protocol():
    verl_params = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    out = to_protocol_sampling_params(verl_params, prompt_len=10, response_length=16, prompt_length=64)
    assert out == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 16}


def test_logprobs_top_k_and_max_tokens_rules():
    out = to_protocol_sampling_params({"logprobs": True, "top_k": None}, prompt_len=70, response_length=16, prompt_length=64)
    assert out["logprobs"] is True and out["top_k"] == -1
    assert out["max_tokens"] == 10  # verl's vLLM rule: min(response_length, prompt_length + response_length - len)
    assert to_protocol_sampling_params({}, prompt_len=10, response_length=16, prompt_length=64)["max_tokens"] == 16
    assert to_protocol_sampling_params({"max_new_tokens": 5}, prompt_len=1, response_length=16, prompt_length=4)["max_tokens"] == 5
    assert to_protocol_sampling_params({}, prompt_len=200, response_length=16, prompt_length=64)["max_tokens"] == 1


def test_unsupported_params_are_dropped_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        out = to_protocol_sampling_params({"repetition_penalty": 1.3, "frobnicate": 1}, prompt_len=1, response_length=4, prompt_length=4)
        assert "repetition_penalty" not in out and "frobnicate" not in out
    messages = [r.getMessage() for r in caplog.records]
    assert sum("repetition_penalty" in m for m in messages) <= 1
    assert sum("frobnicate" in m for m in messages) <= 1


def test_invalid_values_raise_naming_the_field():
    with pytest.raises(ValueError, match="temperature"):
        to_protocol_sampling_params({"temperature": -1.0}, prompt_len=1, response_length=4, prompt_length=4)
    with pytest.raises(ValueError, match="sampling_params.n"):
        to_protocol_sampling_params({"n": 4}, prompt_len=1, response_length=4, prompt_length=4)


# ------------------------------------------------------------------ the real server actor
@pytest.mark.slow
def test_server_actor_generates_token_ids_one_request_per_prompts_samples(tmp_path, tiny_model_dir):
    import ray

    from tests.support.arctic import start_ray, verl_main_config
    from tests.support.server import running_server
    from verl.remote_backend.context import read_context
    from verl.remote_backend.lifecycle import BackendOwner
    from verl.workers.remote_client.arctic.replica import _RemoteServer

    tokenizer_prompt = [1, 60, 70, 80, 2]  # any in-vocab ids
    with running_server(tmp_path / "srv") as srv:
        cfg = verl_main_config({
            "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 6},
            "trainer": {"default_local_dir": str(tmp_path / "run")},
            "actor_rollout_ref": {"rollout": {"n": 2, "name": "arctic", "prompt_length": 16, "response_length": 6},
                                  "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2}},
            "remote_backend": {"server": {"url": srv.url}, "train": {"deepspeed": {"bf16": False}},
                               "rollout": {"max_batch_size": 4, "max_wait_ms": 200}},
        }, model_path=str(tiny_model_dir))
        with BackendOwner.create(cfg):
            context = read_context(cfg).to_dict()
            start_ray(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            try:
                server = _RemoteServer.options(max_concurrency=64).remote(context=context, replica_rank=0)
                assert ray.get(server.ready.remote())
                sampled = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
                greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
                calls = [server.generate.remote(f"r{i}", tokenizer_prompt, sampled) for i in range(6)]
                calls += [server.generate.remote(f"g{i}", tokenizer_prompt, greedy) for i in range(2)]
                outs = ray.get(calls)
                for out in outs:
                    assert 1 <= len(out.token_ids) <= 6 and out.stop_reason == "completed"
                    assert out.extra_fields["global_steps"] == 0
                for out in outs[:6]:
                    assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
                    assert all(lp <= 0 for lp in out.log_probs)
                assert outs[6].log_probs is None and outs[6].token_ids == outs[7].token_ids  # greedy is greedy
                stats = ray.get(server.stats.remote())
                # our server batches continuously and takes n: the rollout.n = 2 samples of a prompt went as one
                # request with n = 2 (3 for the sampled calls, 1 for the greedy pair), each sent once complete
                assert stats["samples"] == 8 and stats["batches"] == 4
                window = ray.get(server.drain_call_window.remote())  # verl's 8 calls: first arrival, last answer
                assert window["answered"] == 8 and window["first_call"] <= window["last_answer"], window
                assert ray.get(server.drain_call_window.remote()) == {}

                ray.get(server.set_global_steps.remote(3))
                assert ray.get(server.generate.remote("s", tokenizer_prompt, greedy)).extra_fields["global_steps"] == 3

                ray.get(server.abort_all_requests.remote(reject_request=True))
                assert ray.get(server.generate.remote("a", tokenizer_prompt, greedy)).stop_reason == "aborted"
                ray.get(server.resume_generation.remote())
                assert ray.get(server.generate.remote("b", tokenizer_prompt, greedy)).stop_reason == "completed"
                for verb in ("sleep", "wake_up", "clear_kv_cache", "release_kv_cache", "resume_kv_cache"):
                    ray.get(getattr(server, verb).remote())
                assert ray.get(server.get_address.remote()).endswith("#replica0")
            finally:
                ray.shutdown()
