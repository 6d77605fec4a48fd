"""A weight sync changes what the sampler serves -- and a skipped one is caught -- in seconds.

verl's path, without Ray: the driver's backend (:class:`~verl.remote_backend.lifecycle.BackendOwner`)
on the reference server, the forwarder worker (``ArcticRLActorRolloutRefWorker``) and the rollout
server (``ArcticRLRolloutServer``) re-attached in this process, as their Ray actors would. One GRPO
update of the worker moves the training job's weights; the rollout server's greedy sample (with its
log-probs) is compared with the training job's log-probs of the same tokens:

* before the update the two agree (both hold the initial weights);
* after the update, before ``update_weights``, the sampler still serves the old weights: its answer is
  unchanged and now far from the trainer's -- the check a skipped sync fails;
* after ``update_weights`` the sampler's log-probs equal the trainer's again and differ from before.

The end-to-end runs catch a skipped sync only as a flat reward curve after minutes; this catches it here.
The same holds for a backend whose ``update_weights`` is a coroutine function (the interface of verl's
PR #7102): the worker awaits it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from tests.support.arctic import grpo_rows, legacy_batch, verl_main_config
from verl.remote_backend.context import read_context
from verl.remote_backend.lifecycle import BackendOwner
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient
from verl.workers.remote_client.arctic.replica import ArcticRLRolloutServer
from verl.workers.remote_client.arctic.worker import ArcticRLActorRolloutRefWorker

pytestmark = pytest.mark.slow

PROMPT = [7, 21, 33, 40, 12]
RESPONSE_LEN = 6
GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": RESPONSE_LEN,
          "ignore_eos": True}
AGREE = 1e-4  # sampler vs trainer on the same weights (fp32 CPU, different kernels)
MOVED = 1e-2  # one update at lr 5e-2 moves a log-prob by far more than this


@pytest.fixture
def parts(reference_server, tiny_model_dir, tmp_path, monkeypatch):
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29998"}.items():
        monkeypatch.setenv(key, value)
    cfg = verl_main_config({
        "data": {"train_batch_size": 2, "max_prompt_length": 9, "max_response_length": 8},
        "trainer": {"default_local_dir": str(tmp_path / "run")},
        "actor_rollout_ref": {
            "rollout": {"n": 2, "name": "arctic", "prompt_length": 9, "response_length": 8},
            "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4, "ppo_epochs": 1,
                      "optim": {"lr": 5e-2}, "use_kl_loss": False, "shuffle": False},
        },
        "remote_backend": {"server": {"url": reference_server.url}, "train": {"deepspeed": {"bf16": False}}},
    }, model_path=str(tiny_model_dir))
    with BackendOwner.create(cfg):
        worker = ArcticRLActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
        worker.init_model()
        server = ArcticRLRolloutServer(context=read_context(cfg).to_dict(), replica_rank=0)
        yield worker, server, cfg


def trainer_logprobs(worker, tokens: list[int]) -> torch.Tensor:
    """The training job's log-probs of ``tokens`` after ``PROMPT`` (temperature 1: greedy log-probs are unscaled)."""
    data = legacy_batch([PROMPT], [tokens], p0=9, r0=8)
    tu.assign_non_tensor(data, calculate_entropy=False, temperature=1.0)
    out = worker.compute_log_prob(data)
    return no_padding_2_padding(out["log_probs"], data).float()[0, : len(tokens)]


def gap(sampled, worker) -> float:
    lp = torch.tensor(sampled.log_probs)
    return (lp - trainer_logprobs(worker, list(sampled.token_ids))).abs().max().item()


def grpo_update(worker) -> None:
    """One optimizer step of the forwarder worker on a GRPO batch (old log-probs from the training job)."""
    prompts, responses = grpo_rows(3, [4, 6], n=2, interleave=False)
    data = legacy_batch(prompts, responses, p0=9, r0=8)
    tu.assign_non_tensor(data, calculate_entropy=False, temperature=1.0)
    old = worker.compute_log_prob(data)
    data["old_log_probs"] = no_padding_2_padding(old["log_probs"], data).float()
    tu.assign_non_tensor(data, global_batch_size=4, mini_batch_size=4, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False})
    worker.update_actor(data)


class AsyncWeightSync(ArcticRLClient):
    """The Arctic adapter with ``update_weights`` as a coroutine function, as PR #7102's interface has it."""

    async def update_weights(self):
        return await asyncio.to_thread(ArcticRLClient.update_weights, self)


@pytest.mark.parametrize("interface", ["sync", "async"])
def test_a_weight_sync_changes_what_the_sampler_serves(parts, interface):
    worker, server, cfg = parts
    if interface == "async":  # the worker holds a re-attached adapter of the same jobs whose sync is awaitable
        worker._backend = AsyncWeightSync.from_config(cfg, handle=read_context(cfg).handle)

    async def scenario():
        before = await server.generate("before", PROMPT, GREEDY)
        assert len(before.token_ids) == RESPONSE_LEN and before.log_probs is not None
        assert gap(before, worker) < AGREE  # one set of weights on both sides

        grpo_update(worker)
        moved = (trainer_logprobs(worker, list(before.token_ids)) - torch.tensor(before.log_probs)).abs().max()
        assert moved > MOVED, f"the update moved the trainer's log-probs by {moved:.2e} only"

        unsynced = await server.generate("unsynced", PROMPT, GREEDY)
        assert list(unsynced.token_ids) == list(before.token_ids)
        assert torch.equal(torch.tensor(unsynced.log_probs), torch.tensor(before.log_probs))  # old weights served
        assert gap(unsynced, worker) > MOVED  # what a skipped sync looks like: sampler and trainer disagree

        await worker.update_weights(global_steps=1)
        after = await server.generate("after", PROMPT, GREEDY)
        assert gap(after, worker) < AGREE, "after update_weights the sampler must serve the trained weights"
        if list(after.token_ids) == list(before.token_ids):
            change = (torch.tensor(after.log_probs) - torch.tensor(before.log_probs)).abs().max().item()
            assert change > MOVED, change

    asyncio.run(scenario())
