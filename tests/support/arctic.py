"""Helpers for the Arctic adapter tests: verl-shaped batches, a verl main config, a patient ``ray.init``.

Batches are built the way verl 0.9.1 builds them: a left/right-padded DataProto-style TensorDict
(``tu.get_tensordict``) turned nested by verl's own ``left_right_2_no_padding`` (legacy trainer), or
nested per-row fields (V1 trainer / TransferQueue).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

ARCTIC_YAML = Path(__file__).resolve().parents[2] / "verl/trainer/config/remote_backend/arctic.yaml"


@functools.lru_cache(maxsize=1)
def _verl_base():
    import verl

    return OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))


@functools.lru_cache(maxsize=1)
def _verl_base_with_arctic():
    """:func:`_verl_base` with ``remote_backend=arctic`` merged in, once: a merge copies its first argument, so
    each config then merges only its own overrides (half the time of merging the option group every call)."""
    return OmegaConf.merge(_verl_base(), {"remote_backend": OmegaConf.to_container(OmegaConf.load(ARCTIC_YAML))})


def verl_main_config(overrides: dict | None = None, *, model_path: str = "/models/tiny"):
    """verl 0.9.1's full PPO config (its generated reference yaml) + ``remote_backend=arctic`` + overrides."""
    model = OmegaConf.create({"actor_rollout_ref": {"model": {"path": model_path}}})
    return OmegaConf.merge(_verl_base_with_arctic(), model, OmegaConf.create(overrides or {}))


PAD = 0


def grpo_rows(seed: int, prompts: list[int], n: int, interleave: bool) -> tuple[list[list[int]], list[list[int]]]:
    """GRPO-like rows: each prompt (of the given lengths) sampled n times with random response lengths."""
    g = torch.Generator().manual_seed(seed)
    uniq = [torch.randint(3, 90, (L,), generator=g).tolist() for L in prompts]
    ps, rs = [], []
    order = [(i, s) for s in range(n) for i in range(len(uniq))] if interleave else [
        (i, s) for i in range(len(uniq)) for s in range(n)]
    for i, _ in order:
        ps.append(uniq[i])
        rs.append(torch.randint(3, 90, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist())
    return ps, rs


def legacy_batch(prompts: list[list[int]], responses: list[list[int]], p0: int = 9, r0: int = 8):
    """What the legacy RayPPOTrainer hands the worker (after left_right_2_no_padding)."""
    b = len(prompts)
    prompt_t = torch.full((b, p0), PAD, dtype=torch.int64)
    resp_t = torch.full((b, r0), PAD, dtype=torch.int64)
    pmask = torch.zeros((b, p0), dtype=torch.int64)
    rmask = torch.zeros((b, r0), dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_t[i, p0 - len(p):] = torch.tensor(p)
        pmask[i, p0 - len(p):] = 1
        resp_t[i, : len(r)] = torch.tensor(r)
        rmask[i, : len(r)] = 1
    attention_mask = torch.cat([pmask, rmask], 1)
    g = torch.Generator().manual_seed(1)
    td = tu.get_tensordict({
        "prompts": prompt_t,
        "responses": resp_t,
        "input_ids": torch.cat([prompt_t, resp_t], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp_min(0),
        "response_mask": rmask,
        "old_log_probs": -torch.rand((b, r0), generator=g) * rmask,
        "advantages": torch.randn((b, r0), generator=g) * rmask,
        "ref_log_prob": -torch.rand((b, r0), generator=g) * rmask,
    })
    return left_right_2_no_padding(td)


def grpo_batch(seed: int = 0, *, n: int = 2, interleave: bool = True, r0: int = 8):
    """The adapter tests' GRPO batch: 4 prompts (4, 7, 5 and 3 tokens) x ``n`` samples, groups interleaved as
    verl's ``_balance_batch`` may leave them (or adjacent), in the legacy layout (prompt width 9, response
    width ``r0``). Returns ``prompts, responses, data``."""
    prompts, responses = grpo_rows(seed, [4, 7, 5, 3], n=n, interleave=interleave)
    return prompts, responses, legacy_batch(prompts, responses, p0=9, r0=r0)


def update_batch(client, *, temperature: float, mini_rows: int, seed: int = 0, weights: float | None = None):
    """:func:`grpo_batch` as verl hands it to ``update_actor``: old log-probs from ``client``'s training job at
    the sampling ``temperature``, advantages of mixed signs, mini-batches of ``mini_rows`` rows, and
    ``rollout_is_weights`` of the value ``weights`` when given."""
    _, _, data = grpo_batch(seed)
    tu.assign_non_tensor(data, temperature=temperature)
    old = client.compute_log_prob(data)
    data["old_log_probs"] = no_padding_2_padding(old["log_probs"], data).float()
    gen = torch.Generator().manual_seed(seed)
    data["advantages"] = torch.randn(data["response_mask"].shape, generator=gen) * data["response_mask"]
    if weights is not None:
        data["rollout_is_weights"] = torch.full(data["response_mask"].shape, weights)
    tu.assign_non_tensor(data, global_batch_size=mini_rows, mini_batch_size=mini_rows, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=False)
    return data


def hf_response_logprobs(model_dir: str | Path, prompts: list[list[int]], responses: list[list[int]], *,
                         r0: int = 8, temperature: float = 1.0) -> torch.Tensor:
    """The reference: the same model run row by row with transformers in fp32, log softmax(logits / T) of
    each response token given its prefix, as ``[B, r0]`` (zeros past a row's response)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(len(prompts), r0)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            lp = torch.log_softmax(model(torch.tensor([p + r])).logits[0].float() / temperature, -1)
            for j, tok in enumerate(r):
                out[i, j] = lp[len(p) - 1 + j, tok]
    return out


def v1_batch(prompts: list[list[int]], responses: list[list[int]]):
    """What the V1 trainer (TransferQueue) hands the worker: every per-token field nested."""
    def nested(rows, dtype=torch.int64):
        return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)

    seqs = [p + r for p, r in zip(prompts, responses)]
    g = torch.Generator().manual_seed(2)
    return tu.get_tensordict({
        "prompts": nested(prompts),
        "responses": nested(responses),
        "input_ids": nested(seqs),
        "position_ids": nested([list(range(len(s))) for s in seqs]),
        "attention_mask": nested([[1] * len(s) for s in seqs]),
        "response_mask": nested([[1] * len(r) for r in responses]),
        "advantages": nested([torch.randn(len(r), generator=g).tolist() for r in responses], torch.float32),
        "old_log_probs": nested([(-torch.rand(len(r), generator=g)).tolist() for r in responses], torch.float32),
    })


def start_ray(**kwargs) -> None:
    """ray.init, retried: Ray gives a local node a fixed 30 s to start, too little on a loaded box."""
    import ray

    for attempt in range(3):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            ray.shutdown()
