"""Warm-start the reverse-text model with a short SFT, stopping at a target *sampled* reward.

GRPO needs a policy that already succeeds sometimes: from random weights every sample of a group
scores about the same, the advantages are ~0 and nothing is learned. Too much SFT is as bad -- the
task is solved before RL starts (100 SFT steps already reach ~0.97). So this script trains only until
the reward of temperature-1 samples on 128 held-out prompts reaches ``--target`` (0.45 by default,
checked every 2 steps), which gives every seed a comparable starting point (shared/design/
REVERSE_TEXT_RECIPE.md: 34-74 steps, 9-31 s on one CPU thread).

Plain PyTorch + transformers (no verl, no server): AdamW (lr 3e-3, 20-step linear warm-up, no weight
decay, grad clip 1.0), batches of 64 fresh random strings, loss on the answer and end-of-turn token
only. Samples are scored with ``reward.compute_score`` on text decoded the way verl's reward manager
decodes it. The result is a Hugging Face directory (model + tokenizer) plus ``warm_start.json``.

With ``--via-server`` the same SFT runs on an Arctic RL server through its ``cross_entropy`` loss
(``warm_start_server.py``; the bundled reference server is started when no ``--server-url`` is given).

Usage: ``python examples/reverse_text/warm_start.py --model INIT_DIR --out DIR [--target 0.45] [--via-server]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules when imported from elsewhere
from make_data import DATA_SOURCE, prompt_messages, random_string
from reward import compute_score

EVAL_SEED = 4242  # held-out strings for the stop criterion (as in the measured recipe)


def _prompt_ids(tokenizer, s: str) -> list[int]:
    ids = tokenizer.apply_chat_template(prompt_messages(s), add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def sft_batch(tokenizer, strings: list[str]):
    """Right-padded ``(input_ids, attention_mask, labels)``; labels cover the answer + end token only."""
    import torch

    seqs, labels = [], []
    for s in strings:
        prompt = _prompt_ids(tokenizer, s)
        answer = tokenizer(s[::-1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (x, y) in enumerate(zip(seqs, labels)):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
        lab[i, : len(y)] = torch.tensor(y)
    return ids, mask, lab


def sampled_reward(model, tokenizer, strings: list[str], *, max_new_tokens: int = 10, temperature: float = 1.0,
                   seed: int = 0) -> dict[str, float]:
    """Mean reward and exact-match rate of one temperature-``temperature`` sample per string."""
    import torch

    prompts = [_prompt_ids(tokenizer, s) for s in strings]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as for generation
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    was_training = model.training
    model.eval()
    devices_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    finally:
        torch.random.set_rng_state(devices_rng)
        model.train(was_training)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    scores = [compute_score(DATA_SOURCE, t, s[::-1]) for t, s in zip(texts, strings)]
    return {"reward": sum(scores) / len(scores),
            "exact": sum(t == s[::-1] for t, s in zip(texts, strings)) / len(strings)}


def warm_start(model_dir: str | Path, out_dir: str | Path, *, target: float = 0.45, max_steps: int = 80,
               lr: float = 3e-3, warmup_steps: int = 20, batch_size: int = 64, eval_every: int = 2,
               eval_prompts: int = 128, max_new_tokens: int = 10, seed: int = 0) -> dict[str, Any]:
    """SFT ``model_dir`` until the sampled reward reaches ``target`` (or ``max_steps``); save to ``out_dir``.

    Returns (and writes to ``out_dir/warm_start.json``) a summary: steps, reward, seconds, reached.
    """
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not 0.0 < target <= 1.0:
        raise ValueError(f"target: expected a reward in (0, 1], got {target}")
    if max_steps < 1 or eval_every < 1:
        raise ValueError(f"max_steps/eval_every: expected >= 1, got max_steps={max_steps}, eval_every={eval_every}")
    t0 = time.time()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    rng = random.Random(seed)
    eval_rng = random.Random(EVAL_SEED)
    eval_strings = [random_string(eval_rng) for _ in range(eval_prompts)]
    history: list[dict[str, float]] = []
    reached, step, last = False, 0, {"reward": 0.0, "exact": 0.0}
    for step in range(1, max_steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / max(warmup_steps, 1))
        ids, mask, labels = sft_batch(tokenizer, [random_string(rng) for _ in range(batch_size)])
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0 or step == max_steps:
            last = sampled_reward(model, tokenizer, eval_strings, max_new_tokens=max_new_tokens, seed=seed + step)
            history.append({"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in last.items()}})
            print(f"[warm_start] step {step} loss {loss.item():.3f} sampled reward {last['reward']:.3f} "
                  f"exact {last['exact']:.3f}", flush=True)
            if last["reward"] >= target:
                reached = True
                break
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    summary = {"init": str(model_dir), "steps": step, "target": target, "reached": reached,
               "sampled_reward": round(last["reward"], 4), "sampled_exact": round(last["exact"], 4),
               "seconds": round(time.time() - t0, 1), "seed": seed, "lr": lr, "batch_size": batch_size,
               "history": history}
    (out / "warm_start.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="initial model directory (make_model.py)")
    p.add_argument("--out", required=True, help="directory for the warm-started model")
    p.add_argument("--target", type=float, default=0.45, help="stop once the sampled reward reaches this")
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--via-server", action="store_true",
                   help="compute the SFT on an Arctic RL server (its cross_entropy loss) instead of in this process")
    p.add_argument("--server-url", default=None,
                   help="with --via-server: a running server (token from ARCTIC_RL_TOKEN); default: start the "
                        "bundled reference server on 127.0.0.1")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    kwargs = {"target": a.target, "max_steps": a.max_steps, "lr": a.lr, "warmup_steps": a.warmup_steps, "batch_size": a.batch_size,
                  "eval_every": a.eval_every, "eval_prompts": a.eval_prompts, "max_new_tokens": a.max_new_tokens, "seed": a.seed}
    if a.via_server:
        from warm_start_server import warm_start_via_server

        s = warm_start_via_server(a.model, a.out, url=a.server_url, **kwargs)
    else:
        s = warm_start(a.model, a.out, **kwargs)
    verdict = "reached" if s["reached"] else "did NOT reach"
    print(f"[warm_start] {verdict} sampled reward {s['target']} after {s['steps']} steps "
          f"(reward {s['sampled_reward']}, exact {s['sampled_exact']}, {s['seconds']} s) -> {a.out}")


if __name__ == "__main__":
    main()
