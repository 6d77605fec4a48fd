"""Tiny models and ZoRRO-layout batches shared by the CPU and GPU ZoRRO tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from arctic_rl.tiny_models import tiny_config

VOCAB = 40
ARCHS = ("qwen3", "qwen2", "llama")
ATTNS = ("eager", "sdpa")
RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a-b| / max(max|b|, tiny): robust to tensors with zeros."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def make_model(arch: str, attn: str = "sdpa", seed: int = 0, **overrides) -> torch.nn.Module:
    config = tiny_config(arch, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def make_batch(
    num_prompts: int, n: int, prompt_len: int, resp_len: int, *, seed: int = 0, shuffle: bool = False,
    same_prompt: dict[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[left-padded prompt | right-padded response]`` rows, ``n`` adjacent rows per prompt.

    Prompt lengths vary in ``1..P`` (the first prompt is full width); response lengths vary in
    ``0..R`` and the first row of each group has an empty (fully padded) response. ``same_prompt``
    maps a group to an earlier one whose prompt it draws again (as GRPO groups of a batch may).
    """
    g = torch.Generator().manual_seed(seed)
    b, t = num_prompts * n, prompt_len + resp_len
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    drawn: list[torch.Tensor] = []
    for u in range(num_prompts):
        plen = prompt_len if u == 0 else int(torch.randint(1, prompt_len + 1, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (plen,), generator=g)
        if same_prompt and u in same_prompt:
            prompt = drawn[same_prompt[u]]
            plen = prompt.numel()
        drawn.append(prompt)
        for k in range(n):
            row = u * n + k
            ids[row, prompt_len - plen : prompt_len] = prompt
            mask[row, prompt_len - plen : prompt_len] = 1
            rlen = 0 if (k == 0 and n > 1) else int(torch.randint(1, resp_len + 1, (1,), generator=g))
            ids[row, prompt_len : prompt_len + rlen] = torch.randint(3, VOCAB, (rlen,), generator=g)
            mask[row, prompt_len : prompt_len + rlen] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    if shuffle:
        perm = torch.randperm(b, generator=g)
        ids, mask, position_ids = ids[perm], mask[perm], position_ids[perm]
    return ids, mask, position_ids


# batch shapes of the equivalence tests: rows per prompt, prompts, rows shuffled or grouped
LAYOUTS = {
    "groups_of_4": {"num_prompts": 3, "n": 4, "shuffle": False},
    "non_adjacent": {"num_prompts": 3, "n": 3, "shuffle": True},
    "all_unique": {"num_prompts": 5, "n": 1, "shuffle": False},
    "single_group": {"num_prompts": 1, "n": 5, "shuffle": False},
}
