"""Drive a running Arctic RL server with the vendor's own verl client (run as a separate process).

``python vendor_client_driver.py --url URL --model DIR --workdir DIR --vendor-src DIR`` imports the
vendor's ``arctic_platform`` (Arctic-Platform snapshot, unmodified) and runs its verl integration
(``integrations/verl/adapter.py``: ``ArcticRLClientWrapper``, the object verl's worker calls) through
the sequence of a GRPO run for two steps: create the jobs (sampling, log_prob, training) with the
vendor's client, re-attach the wrapper to them, then per step generate, compute old and reference
log-probs, update the actor (one ``/forward-backward`` per mini-batch, then ``/step``), sleep and wake
the sampler and sync the weights (wake weights -> ``/operation`` weight-sync -> wake kv_cache ->
``/operation`` reset-prefix-cache); then ``/log-probs``, training sleep/wake, save and destroy. It
prints one JSON line per phase on stdout (``{"phase": ..., ...}``) and exits 0 when all ran.

A separate process because the vendor's wrapper registers itself as the ``"arctic"`` backend in the
registry that our adapter registers in too. No code of ours is imported except the test helpers that
build verl-shaped batches with verl's own functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

ROWS_N = 2  # rollout.n
PROMPTS = ["hello world", "abc de", "reverse me", "xyz"]


def emit(phase: str, **values) -> None:
    print(json.dumps({"phase": phase, **values}, default=float), flush=True)


def verl_config(model_dir: str, workdir: str, vendor_src: Path):
    """verl 0.9.1's PPO config + the vendor's ``remote_backend`` yaml (HTTP transport) + a tiny run."""
    import os

    from omegaconf import OmegaConf

    import verl

    base = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    remote = OmegaConf.load(vendor_src / "arctic_platform/integrations/verl/config/remote_backend/arctic.yaml")
    run = OmegaConf.create({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 6},
        "trainer": {"default_local_dir": workdir, "total_training_steps": 2, "n_gpus_per_node": 1},
        "actor_rollout_ref": {
            "model": {"path": model_dir, "use_liger": False, "enable_gradient_checkpointing": False},
            "rollout": {"n": ROWS_N, "temperature": 1.0},
            "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1,
                      "use_kl_loss": True, "kl_loss_coef": 0.01, "optim": {"lr": 1e-3, "total_training_steps": 2}},
        },
        "remote_backend": {"comms": {"protocol": "http"}},
    })
    return OmegaConf.merge(base, OmegaConf.create({"remote_backend": remote}), run)


def client_config(cfg, url: str):
    """The vendor's ``ArcticRLClientConfig`` as its wrapper builds it, pointed at ``url`` (no server launch)."""
    from urllib.parse import urlparse

    from arctic_platform.client import ArcticRLClientConfig, OnPremConfig, SamplingConfig, TrainingConfig

    actor = cfg.actor_rollout_ref.actor
    mini_rows = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    micro = 1  # gradient_accumulation_steps = mini_rows / micro = 4: the server splits each call itself
    ds_config = {
        "train_micro_batch_size_per_gpu": micro, "train_batch_size": mini_rows,
        "gradient_accumulation_steps": mini_rows // micro, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": actor.optim.lr, "weight_decay": 0.01,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "gradient_clipping": 1.0,
    }
    parsed = urlparse(url)
    return ArcticRLClientConfig(
        model_name=cfg.actor_rollout_ref.model.path, seed=42,
        max_seq_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        training_gpus=1, sampling_gpus=1, log_prob_gpus=1,
        backend=OnPremConfig(protocol="http", host=parsed.hostname, port=parsed.port, launch_local_server=False),
        training=TrainingConfig(checkpoint_path=str(Path(cfg.trainer.default_local_dir) / "ckpt"), ds_config=ds_config,
                                ds_worker_config={"attn_implementation": "sdpa", "use_liger": False,
                                                  "enable_gradient_checkpointing": False}),
        sampling=SamplingConfig(vllm={"max_model_len": 22, "max_num_seqs": 8}, log_prob_engine="deepspeed",
                                log_prob_ds_config={"train_micro_batch_size_per_gpu": 1, "train_batch_size": mini_rows,
                                                    "zero_optimization": {"stage": 0}}),
    )


def verl_batch(tokenizer, prompt_ids, samples, cfg):
    """A verl 0.9.1 legacy batch (padded, then verl's own ``left_right_2_no_padding``) of the samples."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    p0, r0 = max(len(p) for p in prompt_ids), cfg.data.max_response_length
    b = len(samples)
    prompts = torch.full((b, p0), pad, dtype=torch.int64)
    responses = torch.full((b, r0), pad, dtype=torch.int64)
    pmask, rmask = torch.zeros((b, p0), dtype=torch.int64), torch.zeros((b, r0), dtype=torch.int64)
    for i, (pi, toks) in enumerate(samples):
        p = prompt_ids[pi]
        prompts[i, p0 - len(p):], pmask[i, p0 - len(p):] = torch.tensor(p), 1
        responses[i, :len(toks)], rmask[i, :len(toks)] = torch.tensor(toks), 1
    mask = torch.cat([pmask, rmask], 1)
    td = tu.get_tensordict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                            "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0),
                            "response_mask": rmask})
    data = left_right_2_no_padding(td)
    tu.assign_non_tensor(data, temperature=1.0)
    return data, pad


async def run(args) -> None:
    from arctic_platform.client import create_arctic_rl_client
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper
    from transformers import AutoTokenizer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.padding import no_padding_2_padding

    cfg = verl_config(args.model, args.workdir, Path(args.vendor_src))
    creator = create_arctic_rl_client(client_config(cfg, args.url))  # creates sampling, log_prob, training
    jobs = creator.jobs
    emit("initialize", jobs={"training": jobs.training, "sampling": jobs.sampling, "log_prob": jobs.log_prob})
    backend = ArcticRLClientWrapper.from_config(cfg, handle={"rl_client_reconnect_config": creator.reconnect_config(),
                                                             "rl_server_state": None})
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = {"temperature": 1.0, "max_tokens": cfg.data.max_response_length, "logprobs": 0, "seed": 1}

    for step in range(2):
        samples = []
        for pi, ids in enumerate(prompt_ids):
            for k in range(ROWS_N):
                out = await backend.generate(ids, {**params, "seed": 100 * step + 10 * pi + k})
                res = out[0]
                samples.append((pi, list(res["token_ids"])[: cfg.data.max_response_length] or [0]))
                lps = res.get("logprobs")
        emit("generate", step=step, rows=len(samples), logprobs_entry=lps[0] if lps else None)
        data, pad = verl_batch(tokenizer, prompt_ids, samples, cfg)
        old = await backend.compute_log_prob(data, ref=False, calculate_entropy=False, rollout_n=ROWS_N,
                                             temperature=1.0, pad_token_id=pad)
        ref = await backend.compute_log_prob(data, ref=True, calculate_entropy=False, rollout_n=ROWS_N,
                                             temperature=1.0, pad_token_id=pad)
        old_lp, ref_lp = old["model_output"]["log_probs"], ref["model_output"]["log_probs"]
        emit("forward", step=step, shape=list(old_lp.shape), ref_shape=list(ref_lp.shape),
             max_diff_ref=float((old_lp - ref_lp).abs().max()))
        # the vendor's worker shifts ZoRRO-off log-probs itself; its update sends them response-shaped
        resp_len = data["responses"].shape[1]
        p_width = old_lp.shape[1] - resp_len
        data["old_log_probs"] = old_lp[:, p_width - 1: -1].float()
        data["ref_log_prob"] = ref_lp[:, p_width - 1: -1].float()
        rewards = torch.tensor([sum(x % 2 == 0 for x in t) / len(t) for _, t in samples]).view(-1, ROWS_N)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        data["advantages"] = adv * data["response_mask"]
        _ = no_padding_2_padding  # verl's helpers built the nested batch; the update reads padded fields
        upd = await backend.update_actor(data, actor_config=actor_config, pad_token_id=pad, rollout_n=ROWS_N,
                                         temperature=1.0)
        emit("update_actor", step=step, loss=upd["loss"], metrics=upd["metrics"])
        emit("sleep_inference", step=step, out=await backend.sleep_inference(level=1))
        emit("update_weights", step=step, out=await backend.update_weights())

    client = backend._client
    emit("log_probs", out=_shape_of(await client.log_probs(prompts=["hello"], completions=[" world"])))
    emit("sleep_training", out=await client.sleep_training(mode="all"))
    emit("wake_training", out=await client.wake_training())
    emit("save", out=await backend.save_checkpoint())
    await backend.destroy()
    await creator.transport.aclose()
    emit("destroy", jobs=[jobs.training, jobs.sampling, jobs.log_prob])


def _shape_of(out: dict) -> dict:
    results = out.get("results")
    return {"job_id": out.get("job_id"), "results_shape": list(results.shape) if hasattr(results, "shape") else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--vendor-src", required=True)
    args = ap.parse_args()
    sys.path.insert(0, args.vendor_src)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
