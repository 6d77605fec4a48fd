"""verl's one-sample rollout calls sent through the rollout server's dispatcher to a real ``ArcticRLClient``, and
what verl's GRPO step reads from the samples; shared by the test against our server
(``tests/remote_backend/workers/test_rollout_dispatch_on_cpu.py``) and the one against the vendor's
(``tests/conformance/test_vendor_forward_generate_on_cpu.py``)."""

from __future__ import annotations

import asyncio

from verl.remote_backend.workers.batching import RolloutBatching
from verl.remote_backend.workers.dispatch import rollout_dispatcher

#: the sampling parameters verl's agent loop sends with every call
VERL_PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def dispatch_grpo_samples(client, prompts: list[list[int]], n: int, monkeypatch) -> tuple[list[dict], list]:
    """verl's ``len(prompts) x n`` one-sample calls through the rollout server's dispatcher for ``client`` (an
    ``ArcticRLClient``): the ``/generate`` bodies' parameters and prompt counts, and the samples in call order."""
    from verl.workers.remote_client.arctic.dialect import DialectV2
    from verl.workers.remote_client.arctic.replica import to_protocol_sampling_params

    sent: list[dict] = []
    original = DialectV2.generate_payload
    monkeypatch.setattr(DialectV2, "generate_payload", lambda self, wire_prompts, params: sent.append(
        {"prompts": len(wire_prompts), **params}) or original(self, wire_prompts, params))
    batching = RolloutBatching(max_batch_size=16, max_wait_ms=50, max_in_flight=1)

    async def run_batch(batch, params):
        return await asyncio.to_thread(client.generate, batch, params)

    async def run_group(prompt, params):
        return await asyncio.to_thread(client.generate, [prompt], params)

    async def main():
        dispatcher = rollout_dispatcher(client, batching, samples_per_prompt=n, run_batch=run_batch,
                                        run_group=run_group)
        calls = []
        for prompt in prompts:
            params = to_protocol_sampling_params({**VERL_PARAMS, "max_tokens": 4}, prompt_len=len(prompt),
                                                 response_length=4, prompt_length=16)
            calls += [dispatcher.submit(prompt, params) for _ in range(n)]
        return await asyncio.gather(*calls)

    return sent, asyncio.run(main())


def check_grpo_samples(samples: list, prompts: list[list[int]], n: int) -> None:
    """What verl's GRPO step reads: ``len(prompts) x n`` samples, each with tokens and one log-prob per token."""
    assert len(samples) == len(prompts) * n
    for s in samples:
        assert 1 <= len(s.token_ids) <= 4 and len(s.logprobs) == len(s.token_ids)
        assert all(isinstance(x, float) and x <= 0 for x in s.logprobs)
    for k, prompt in enumerate(prompts):
        assert all(s.prompt_len == len(prompt) for s in samples[k * n:(k + 1) * n])
