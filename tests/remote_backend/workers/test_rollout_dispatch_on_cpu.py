"""How the rollout server sends verl's one-sample calls: chosen from the backend's features.

* Against a server that batches continuously (``continuous_batching``) and takes ``n`` (``n_samples``), the
  samples of one prompt go as one request with ``n`` -- as soon as the group is complete, no window across
  prompts, many requests in flight (:class:`SampleGrouper`); without ``n_samples``, one request per call, sent
  at once.
* Against a server without the feature (the vendor's), today's coalescer: batches of rows, one per sample.
* (slow) The real adapter against our reference server: ``B`` prompts x ``n`` samples arrive as ``B`` ``/generate``
  calls, one prompt each with ``n``; the vendor's side of the same check is in
  ``tests/conformance/test_vendor_forward_generate_on_cpu.py`` (both use ``tests/support/rollout.py``).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.rollout import check_grpo_samples, dispatch_grpo_samples
from verl.remote_backend.workers.batching import RolloutBatching
from verl.remote_backend.workers.coalescer import RequestAborted, RequestCoalescer
from verl.remote_backend.workers.dispatch import backend_features, rollout_dispatcher
from verl.remote_backend.workers.sample_groups import SampleGrouper


class _Groups:
    """``run_group``: ``n`` results ``(prompt[0], j)``; records each request and how many ran at once."""

    def __init__(self, delay_s: float = 0.02) -> None:
        self.requests: list[tuple[list[int], dict]] = []
        self.delay_s = delay_s
        self.running = self.max_running = 0

    async def __call__(self, prompt, params):
        self.requests.append((prompt, params))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.delay_s)
            return [(prompt[0], j) for j in range(params.get("n", 1))]
        finally:
            self.running -= 1


def test_the_samples_of_a_prompt_go_as_one_request_with_n_and_prompts_do_not_wait_for_each_other():
    rec = _Groups()

    async def main():
        grouper = SampleGrouper(rec, group_size=4, max_wait_ms=10_000, max_in_flight=64)
        t0 = time.monotonic()
        calls = [grouper.submit([p, 9], {"temperature": 1.0}) for p in range(8) for _ in range(4)]
        out = await asyncio.gather(*calls)
        return out, time.monotonic() - t0

    out, seconds = asyncio.run(main())
    assert len(rec.requests) == 8 and all(params["n"] == 4 for _, params in rec.requests)
    assert sorted(prompt[0] for prompt, _ in rec.requests) == list(range(8))
    assert out == [(p, j) for p in range(8) for j in range(4)]  # each caller its own sample, in order
    assert rec.max_running == 8  # no one-request-in-flight limit
    assert seconds < 5  # full groups left at once: nobody waited for the 10 s window


def test_an_incomplete_group_leaves_after_max_wait_and_other_params_form_other_groups():
    rec = _Groups()

    async def main():
        grouper = SampleGrouper(rec, group_size=4, max_wait_ms=30, max_in_flight=2)
        out = await asyncio.gather(grouper.submit([1], {"t": 1}), grouper.submit([1], {"t": 1}),
                                   grouper.submit([1], {"t": 0}))
        return out

    assert asyncio.run(main()) == [(1, 0), (1, 1), (1, 0)]
    assert sorted(params["n"] for _, params in rec.requests) == [1, 2]


def test_without_n_every_call_is_its_own_request_sent_at_once():
    rec = _Groups()

    async def main():
        grouper = SampleGrouper(rec, group_size=4, max_wait_ms=10_000, max_in_flight=16, use_n=False)
        return await asyncio.gather(*[grouper.submit([7], {"t": 1}) for _ in range(3)])

    assert asyncio.run(main()) == [(7, 0)] * 3
    assert len(rec.requests) == 3 and all("n" not in params for _, params in rec.requests)


def test_errors_wrong_counts_and_aborts_reach_the_callers():
    async def failing(prompt, params):
        raise RuntimeError("server refused")

    async def short(prompt, params):
        return [1]

    async def main():
        g = SampleGrouper(failing, group_size=2, max_wait_ms=0, max_in_flight=1)
        with pytest.raises(RuntimeError, match="server refused"):
            await asyncio.gather(g.submit([1], {}), g.submit([1], {}))
        g = SampleGrouper(short, group_size=2, max_wait_ms=10_000, max_in_flight=1)
        with pytest.raises(RuntimeError, match="expected 2 samples"):
            await asyncio.gather(g.submit([1], {}), g.submit([1], {}))
        waiting = asyncio.ensure_future(g.submit([2], {}))
        await asyncio.sleep(0.01)
        assert g.pending() == 1 and g.abort_pending("abort_all_requests") == 1
        with pytest.raises(RequestAborted):
            await waiting
        await g.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="group_size"):
        SampleGrouper(short, group_size=0, max_wait_ms=1, max_in_flight=1)


class _Backend:
    def __init__(self, features):
        self.features = frozenset(features)


def test_the_dispatcher_is_chosen_from_the_backends_features():
    batching = RolloutBatching(max_batch_size=32, max_wait_ms=5, max_in_flight=1)

    async def noop(*_):
        return []

    def make(features):
        return rollout_dispatcher(_Backend(features), batching, samples_per_prompt=8, run_batch=noop, run_group=noop)

    ours = make({"continuous_batching", "n_samples", "token_prompts"})
    assert isinstance(ours, SampleGrouper) and ours.use_n and ours.group_size == 8 and ours.max_in_flight == 32
    deterministic = rollout_dispatcher(_Backend({"continuous_batching", "n_samples"}), batching, samples_per_prompt=8,
                                       run_batch=noop, run_group=noop, deterministic=True)
    assert isinstance(deterministic, SampleGrouper) and not deterministic.use_n  # seeds must not depend on timing
    no_n = make({"continuous_batching"})
    assert isinstance(no_n, SampleGrouper) and not no_n.use_n and no_n.group_size == 1
    vendor = make(set())  # the vendor's /health lists no features: today's coalescer, one batch in flight
    assert isinstance(vendor, RequestCoalescer) and vendor.max_in_flight == 1 and vendor.max_batch_size == 32
    assert backend_features(object()) == frozenset() and backend_features(_Backend({"a"})) == {"a"}


# ------------------------------------------------------------------ the real adapter


@pytest.mark.slow
def test_our_server_gets_one_request_per_prompt_with_n(tmp_path, tiny_model_dir, monkeypatch):
    from tests.support.arctic import verl_main_config
    from tests.support.server import running_server
    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

    n, prompts = 3, [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    with running_server(tmp_path / "srv") as srv:
        cfg = verl_main_config({
            "data": {"train_batch_size": 3, "max_prompt_length": 16, "max_response_length": 4},
            "trainer": {"default_local_dir": str(tmp_path / "run")},
            "actor_rollout_ref": {"rollout": {"n": n}, "actor": {"ppo_mini_batch_size": 3,
                                                                  "ppo_micro_batch_size_per_gpu": 3}},
            "remote_backend": {"server": {"url": srv.url}, "train": {"deepspeed": {"bf16": False}}},
        }, model_path=str(tiny_model_dir))
        client = ArcticRLClient.from_config(cfg)
        try:
            assert {"continuous_batching", "n_samples"} <= backend_features(client)
            sent, samples = dispatch_grpo_samples(client, prompts, n, monkeypatch)
        finally:
            client.destroy()
    assert len(sent) == len(prompts) and all(body["prompts"] == 1 and body["n"] == n for body in sent)
    check_grpo_samples(samples, prompts, n)
    for k in range(len(prompts)):  # the n samples of a prompt are n draws, not n copies of one
        assert len({tuple(s.token_ids) for s in samples[k * n:(k + 1) * n]}) > 1
