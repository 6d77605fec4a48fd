"""Helpers of the vLLM sampler's GPU tests: calls, log-probs read three ways, one training step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from arctic_rl.protocol import GenerateRequest, JobConfig, JobType, SamplingParams
from arctic_rl.server.settings import ServerSettings

TOL_MEAN, TOL_MAX = 0.02, 0.15  # bf16 log-probs, two engines' kernels


def sampler_and_trainer(root: Path, **settings: Any):
    """``(training engine, sampling engine)`` on one small Qwen3 (head_dim 64, bf16) under ``root``: the sampler
    (vLLM, 0.3 of the GPU) made first, as the adapter makes its jobs, then the DeepSpeed training engine, and the
    trainer's weights synced into the sampler. ``settings``: more :class:`ServerSettings` fields."""
    from arctic_rl.server.engines import create_engine
    from arctic_rl.server.engines.training import TrainingEngine
    from arctic_rl.tiny_models import build_tiny_model

    model_dir = build_tiny_model(root / "model", "qwen3", seed=0, hidden_size=256, num_layers=2, num_heads=4,
                                 num_kv_heads=2, max_position_embeddings=1024)
    config = ServerSettings(device="cuda", sampler="vllm", torch_compile="off", checkpoint_root=root / "ck", **settings)
    sampler = create_engine(JobConfig(model_name=str(model_dir), job_type=JobType.SAMPLING,
                                      vllm_config={"gpu_memory_utilization": 0.3, "max_model_len": 1024}),
                            config, None)
    train = TrainingEngine(JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING,
                                     ds_config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}},
                                     ds_worker_config={"attn_implementation": "sdpa"}),
                           config, root / "job")
    sampler.load_weights(train.weights())
    return train, sampler


def gen(sampler, prompts, **params):
    return sampler.generate(GenerateRequest(prompts=prompts), SamplingParams(**params))


def sampled_lps(result) -> list[float]:
    return [entry[str(t)]["logprob"] for t, entry in zip(result["token_ids"], result["logprobs"], strict=True)]


def train_lps(train, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response], device="cuda")
    with torch.no_grad():
        logp = train.model(input_ids=ids).logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(response, device="cuda")[:, None])[:, 0].cpu()


def vllm_seq_lps(sampler, prompt: list[int], response: list[int]) -> torch.Tensor:
    """vLLM's log-probs of a fixed sequence (prompt log-probs of prompt + response)."""
    from vllm import SamplingParams as VP
    from vllm.inputs import TokensPrompt

    out = sampler.llm.generate([TokensPrompt(prompt_token_ids=prompt + response)],
                               VP(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
    seq = prompt + response
    return torch.tensor([out.prompt_logprobs[i][seq[i]].logprob for i in range(len(prompt), len(seq))])


def assert_close_lps(a: torch.Tensor, b: torch.Tensor) -> None:
    diff = (a - b).abs()
    assert diff.mean() < TOL_MEAN and diff.max() < TOL_MAX, (diff.mean().item(), diff.max().item())


def train_step(train):
    from arctic_rl.server.http.validation import parse_batch_body

    g = torch.Generator().manual_seed(3)
    rows, p, r = 8, 32, 32
    ids = torch.randint(3, train.vocab_size, (rows, p + r), generator=g)
    mask = torch.ones_like(ids)
    body = {"batch": {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1),
                      "prompts": ids[:, :p], "responses": ids[:, p:], "response_mask": mask[:, p:],
                      "advantages": torch.randn(rows, r, generator=g), "old_log_probs": torch.full((rows, r), -4.6)},
            "meta": {}, "processing": {"loss_fn": "grpo", "config": {}}}
    batch = parse_batch_body(body, vocab_size=train.vocab_size, train=True)
    train.forward_backward(batch)
    train.step()


def submit(sampler, prompts, **params):
    return sampler.submit_generate(GenerateRequest(prompts=prompts), SamplingParams(**params))
