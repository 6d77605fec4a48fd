"""The reverse-text warm start computed by an Arctic RL server (its ``cross_entropy`` loss).

Same procedure as :func:`warm_start.warm_start` -- SFT on fresh random strings until temperature-1
samples on 128 held-out prompts reach the target reward -- but every forward/backward, optimizer step,
weight sync and sample runs on the server, over the Arctic v2 protocol:

* a *training* job (DeepSpeed, fp32, AdamW with DeepSpeed's ``WarmupLR``) gets one
  ``/forward-backward`` per step with ``processing.loss_fn="cross_entropy"``: the prompt, left-padded,
  is ``prompts``; the reversed string + end token, right-padded, is ``responses``; the loss covers the
  response tokens where ``attention_mask`` is 1 -- then ``/step``;
* every ``eval_every`` steps ``/weight-sync`` copies the weights to a *sampling* job and one
  ``/generate`` samples the held-out prompts (token-id prompts);
* at the end ``/save`` with ``export_hf`` writes a Hugging Face directory, copied to ``out_dir``.

Without a URL the bundled reference server is started on 127.0.0.1 and stopped at the end. It shows
the server doing SFT as well as RL; the plain-PyTorch path in ``warm_start.py`` stays the default
(fewer moving parts, no server start-up).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from make_data import DATA_SOURCE, random_string
from reward import compute_score
from warm_start import EVAL_SEED, _prompt_ids

from arctic_rl import dssst1
from arctic_rl.protocol import OCTET_STREAM, Features, JobConfig, JobType, Paths, ProtocolVersion


def _sft_body(tokenizer, strings: list[str]) -> dict[str, Any]:
    """``{batch, meta, processing}`` of one cross-entropy ``/forward-backward`` call."""
    import torch

    prompts = [_prompt_ids(tokenizer, s) for s in strings]
    answers = [tokenizer(s[::-1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for s in strings]
    width_p, width_r, pad = max(map(len, prompts)), max(map(len, answers)), tokenizer.pad_token_id
    ids = torch.full((len(strings), width_p + width_r), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, width_p - len(p): width_p] = torch.tensor(p)  # prompt: left-padded
        ids[i, width_p: width_p + len(a)] = torch.tensor(a)  # answer: right-padded
        mask[i, width_p - len(p): width_p + len(a)] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
             "prompts": ids[:, :width_p].contiguous(), "responses": ids[:, width_p:].contiguous()}
    meta = {"rollout_n": 1, "max_prompt_len": width_p, "max_response_len": width_r, "temperature": 1.0,
            "pad_token_id": pad, "global_batch_size": len(strings)}
    processing = {"loss_fn": "cross_entropy", "config": {"loss_agg_mode": "token-mean"}}
    return {"batch": batch, "meta": meta, "processing": processing}


def _ds_config(lr: float, warmup_steps: int, batch_size: int) -> dict[str, Any]:
    return {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                     "warmup_num_steps": warmup_steps, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": 0},
    }


class _Server:
    """The few calls this script makes, on the adapter's HTTP session (auth, retries, timeouts)."""

    def __init__(self, url: str, token: str | None):
        from verl.workers.remote_client.arctic.arctic_config import RetryConfig, TimeoutsConfig
        from verl.workers.remote_client.arctic.http import ArcticHttp
        from verl.workers.remote_client.arctic.jobs import read_health
        from verl.workers.remote_client.arctic.wire import detect_protocol

        self.http = ArcticHttp(url, timeouts=TimeoutsConfig(), retry=RetryConfig(), token=token)
        if detect_protocol(self.http) is not ProtocolVersion.V2:
            raise RuntimeError(f"{url}: this script speaks the v2 protocol (DSSST1 bodies) only")
        self.token_prompts = Features.TOKEN_PROMPTS in read_health(self.http).features
        self.jobs: dict[JobType, int] = {}

    def create(self, job_type: JobType, config: JobConfig) -> int:
        from verl.workers.remote_client.arctic.jobs import create_job

        self.jobs[job_type] = create_job(self.http, job_type, config.model_dump(mode="json", exclude_none=True))
        return self.jobs[job_type]

    def tensors(self, path: str, job_type: JobType, body: dict, op: str) -> dict:
        resp = self.http.request("POST", path, op=op, params={"job_id": self.jobs[job_type]},
                                 data=dssst1.dumps(body), content_type=OCTET_STREAM)
        if resp.headers.get("Content-Type", "").startswith(OCTET_STREAM):
            return dssst1.loads(resp.content)
        return resp.json()

    def json(self, path: str, job_type: JobType, body: dict, op: str) -> dict:
        return self.http.post_json(path, body, params={"job_id": self.jobs[job_type]}, op=op).json()

    def close(self) -> None:
        from verl.workers.remote_client.arctic.jobs import destroy_jobs

        try:
            destroy_jobs(self.http, {job_type.value: job_id for job_type, job_id in self.jobs.items()})
        finally:
            self.http.close()


def _sampled_reward(server: _Server, tokenizer, strings: list[str], *, max_new_tokens: int,
                    seed: int) -> dict[str, float]:
    prompts: list = [_prompt_ids(tokenizer, s) for s in strings]
    if not server.token_prompts:
        prompts = [tokenizer.decode(p) for p in prompts]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": max_new_tokens, "n": 1, "seed": seed}
    out = server.tensors(Paths.GENERATE, JobType.SAMPLING, {"prompts": prompts, "sampling_params": params}, "generate")
    texts = [tokenizer.decode(r["token_ids"], skip_special_tokens=True) for r in out["results"]]
    scores = [compute_score(DATA_SOURCE, t, s[::-1]) for t, s in zip(texts, strings)]
    exact = sum(t == s[::-1] for t, s in zip(texts, strings)) / len(strings)
    return {"reward": sum(scores) / len(scores), "exact": exact}


def warm_start_via_server(model_dir: str | Path, out_dir: str | Path, *, url: str | None = None,
                          token: str | None = None, target: float = 0.45, max_steps: int = 80, lr: float = 3e-3,
                          warmup_steps: int = 20, batch_size: int = 64, eval_every: int = 2, eval_prompts: int = 128,
                          max_new_tokens: int = 10, seed: int = 0) -> dict[str, Any]:
    """:func:`warm_start.warm_start` on an Arctic RL server (``url``; ``None`` starts the reference server)."""
    from transformers import AutoTokenizer

    if not 0.0 < target <= 1.0:
        raise ValueError(f"target: expected a reward in (0, 1], got {target}")
    if max_steps < 1 or eval_every < 1:
        raise ValueError(f"max_steps/eval_every: expected >= 1, got max_steps={max_steps}, eval_every={eval_every}")
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    local = None
    if url is None:
        from verl.workers.remote_client.arctic.arctic_config import LocalServerConfig
        from verl.workers.remote_client.arctic.local_server import start_local_server

        local = start_local_server(LocalServerConfig(), token=token)  # checkpoints in a temporary directory
        url = local.url
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = None
    try:
        server = _Server(url, token)
        model = str(Path(model_dir).resolve())
        server.create(JobType.SAMPLING, JobConfig(model_name=model, job_type=JobType.SAMPLING, seed=seed))
        server.create(JobType.TRAINING, JobConfig(model_name=model, job_type=JobType.TRAINING, seed=seed,
                                                  ds_config=_ds_config(lr, warmup_steps, batch_size),
                                                  checkpoint_path="warm_start"))
        rng, eval_rng = random.Random(seed), random.Random(EVAL_SEED)
        eval_strings = [random_string(eval_rng) for _ in range(eval_prompts)]
        history, reached, step, last = [], False, 0, {"reward": 0.0, "exact": 0.0}
        for step in range(1, max_steps + 1):
            body = _sft_body(tokenizer, [random_string(rng) for _ in range(batch_size)])
            res = server.tensors(Paths.FORWARD_BACKWARD, JobType.TRAINING, body, "forward_backward")
            server.json(Paths.STEP, JobType.TRAINING, {}, "step")
            if step % eval_every == 0 or step == max_steps:
                training, sampling = server.jobs[JobType.TRAINING], server.jobs[JobType.SAMPLING]
                server.json(Paths.WEIGHT_SYNC, JobType.TRAINING,
                            {"source_sub_job_id": training, "target_sub_job_ids": [sampling]}, "weight_sync")
                last = _sampled_reward(server, tokenizer, eval_strings, max_new_tokens=max_new_tokens, seed=seed + step)
                loss = float(res.get("avg_loss") or res.get("metrics", {}).get("loss") or float("nan"))
                history.append({"step": step, "loss": round(loss, 4), **{k: round(v, 4) for k, v in last.items()}})
                print(f"[warm_start:server] step {step} loss {loss:.3f} sampled reward {last['reward']:.3f} "
                      f"exact {last['exact']:.3f}", flush=True)
                if last["reward"] >= target:
                    reached = True
                    break
        saved = server.json(Paths.SAVE, JobType.TRAINING, {"export_hf": True}, "save")
        if not saved.get("hf_path") or not Path(saved["hf_path"]).is_dir():
            raise RuntimeError(f"/save exported no Hugging Face directory this machine can read: {saved}")
        shutil.copytree(saved["hf_path"], out, dirs_exist_ok=True)
    finally:
        if server is not None:
            server.close()
        if local is not None:
            local.stop()
    summary = {"init": str(model_dir), "steps": step, "target": target, "reached": reached,
               "sampled_reward": round(last["reward"], 4), "sampled_exact": round(last["exact"], 4),
               "seconds": round(time.time() - t0, 1), "seed": seed, "lr": lr, "batch_size": batch_size,
               "via": "server", "history": history}
    (out / "warm_start.json").write_text(json.dumps(summary, indent=1))
    return summary
