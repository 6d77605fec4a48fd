"""verl's policy losses on the reference server's real training pass equal stock verl's on the same tiny model.

A training job of the reference server process (fp32, the tiny Qwen3) gets one ``/forward-backward`` per case,
then ``/step`` answers the gradient norm (before clipping). The reference: the same model loaded with
transformers, its response log-probs put through verl 0.9.1's registered policy loss (``get_policy_loss_fn``,
with the actor config and global batch info verl's ``ppo_loss`` gives it) and ``backward``. The server's loss
and the gradient norm over the model's parameters equal verl's. The learning rate is 0: every case sees the
same weights.
"""

from __future__ import annotations

import pytest
import requests
import torch

from tests.support.server import decode, make_batch, post_frame

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [9, 10]]
RESPONSES = [[20, 21, 22], [23, 24, 25, 26], [27], [28, 29]]

CASES = {
    "vanilla": ("verl_grpo", "vanilla", None),
    "gspo": ("verl_gspo", "gspo", None),
    "bypass_mode-ppo_clip": ("verl_bypass_mode", "bypass_mode", {"loss_type": "ppo_clip", "rollout_is": "sequence"}),
    "bypass_mode-reinforce-token-is-rs": ("verl_bypass_mode", "bypass_mode", {
        "loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5,
        "rollout_rs": "token_k2", "rollout_rs_threshold": 0.3}),
}


@pytest.fixture(scope="module")
def training_job(reference_server, tiny_model_dir):
    config = {"model_name": str(tiny_model_dir), "job_type": "training", "checkpoint_path": "train",
              "ds_config": {"gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                            "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}}}}
    info = decode(requests.post(reference_server.url + "/initialize", json=config, timeout=300))
    yield info["job_id"]
    requests.post(f"{reference_server.url}/destroy?job_id={info['job_id']}", json={"job_type": "training"}, timeout=60)


def batch_and_reference(model_dir):
    """The body's batch (old log-probs = the model's own, moved; advantages of mixed signs) and the model."""
    from transformers import AutoModelForCausalLM

    batch = make_batch(PROMPTS, RESPONSES)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    p = batch["prompts"].shape[1]
    with torch.no_grad():
        lp = response_logprobs(model, batch, p)
    g = torch.Generator().manual_seed(5)
    mask = batch["response_mask"][:, p:].bool()
    old = torch.where(mask, lp + 0.4 * torch.randn(lp.shape, generator=g), torch.zeros(()))
    adv = torch.randn(len(PROMPTS), 1, generator=g).expand_as(lp) * mask
    full = torch.zeros(batch["input_ids"].shape)
    batch["old_log_probs"] = torch.cat([full[:, :p], old], 1)
    batch["advantages"] = torch.cat([full[:, :p], adv], 1)
    return batch, model


def response_logprobs(model, batch, p: int) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, :-1].float()
    shifted = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return shifted[:, p - 1:]


def verl_loss_and_grad_norm(model, batch, loss_mode: str, rollout_correction: dict | None) -> tuple[float, float]:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy = PolicyLossConfig(loss_mode=loss_mode, **({"rollout_correction": rollout_correction}
                                                      if rollout_correction else {}))
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                        policy_loss=policy)
    p = batch["prompts"].shape[1]
    mask = batch["response_mask"][:, p:].bool()
    actor.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(PROMPTS))
    model.zero_grad()
    lp = response_logprobs(model, batch, p)
    loss, _ = get_policy_loss_fn(loss_mode)(batch["old_log_probs"][:, p:], lp, batch["advantages"][:, p:], mask,
                                            loss_agg_mode="token-mean", config=actor)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in model.parameters() if q.grad is not None]))
    return float(loss), float(norm)


@pytest.mark.parametrize("case", list(CASES))
def test_the_servers_loss_and_gradient_equal_verls_on_the_model(reference_server, tiny_model_dir, training_job, case):
    loss_fn, loss_mode, correction = CASES[case]
    batch, model = batch_and_reference(tiny_model_dir)
    expected_loss, expected_norm = verl_loss_and_grad_norm(model, batch, loss_mode, correction)
    body = {"batch": batch, "meta": {},
            "processing": {"loss_fn": loss_fn, "config": {"rollout_correction": correction} if correction else {}}}
    url = reference_server.url
    answer = decode(post_frame(reference_server, f"/forward-backward?job_id={training_job}", body))
    stepped = decode(requests.post(f"{url}/step?job_id={training_job}", json={}, timeout=120))
    assert answer["metrics"]["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert stepped["metrics"]["grad_norm"] == pytest.approx(expected_norm, rel=1e-4)
    assert expected_norm > 0
