"""Measure a model's mean reward on the arithmetic task before training (plain transformers sampling, no verl).

Samples ``--n`` answers for each of the first ``--prompts`` rows of a parquet file written by ``make_data.py``
(temperature 1 by default, as verl's rollout), scores them with ``reward.py`` and prints the mean reward
overall and per problem kind, plus the mean at shorter response limits (an answer cut at ``k`` tokens is
scored on its first ``k`` tokens, as a run with ``max_response_length=k`` would see it).

Usage: ``python examples/arithmetic/baseline.py --model DIR --data DIR/train.parquet [--prompts 32 --n 4]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).resolve().parent


def _reward_module() -> Any:
    spec = importlib.util.spec_from_file_location("arithmetic_reward", TASK_DIR / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(model_dir: str, data_path: str, *, prompts: int = 32, n: int = 4, max_new_tokens: int = 128,
            temperature: float = 1.0, seed: int = 0, batch: int = 32, cut_at: tuple[int, ...] = (48,)) -> dict:
    """Mean reward of ``n`` samples per prompt of the first ``prompts`` rows; see the module docstring."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reward = _reward_module()
    rows = pd.read_parquet(data_path).head(prompts).to_dict("records")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    jobs = [(r, [dict(m) for m in r["prompt"]]) for r in rows for _ in range(n)]
    scores: dict[str, list[float]] = defaultdict(list)
    cut_scores: dict[int, list[float]] = {k: [] for k in cut_at}
    examples: list[str] = []
    start = time.monotonic()
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        texts = [tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) for _, msgs in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                 top_p=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)
        for (row, _), ids in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
            ids = ids.tolist()
            if tokenizer.eos_token_id in ids:
                ids = ids[:ids.index(tokenizer.eos_token_id)]
            truth = row["reward_model"]["ground_truth"]
            answer = tokenizer.decode(ids, skip_special_tokens=True)
            s = reward.compute_score(row["data_source"], answer, truth)
            scores[row["extra_info"]["kind"]].append(s)
            for k in cut_at:
                cut_scores[k].append(reward.compute_score(row["data_source"],
                                                          tokenizer.decode(ids[:k], skip_special_tokens=True), truth))
            if len(examples) < 6:
                examples.append(f"{row['extra_info']['question']} -> {answer[:80]!r} (truth {truth}, score {s})")
    every = [s for v in scores.values() for s in v]
    return {
        "mean_reward": round(sum(every) / len(every), 4),
        "samples": len(every),
        "per_kind": {k: {"mean": round(sum(v) / len(v), 4), "samples": len(v)} for k, v in sorted(scores.items())},
        **{f"mean_reward_at_{k}_tokens": round(sum(v) / len(v), 4) for k, v in cut_scores.items()},
        "max_new_tokens": max_new_tokens, "temperature": temperature, "seconds": round(time.monotonic() - start, 1),
        "examples": examples,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a parquet file of make_data.py")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args(argv)
    for name in ("prompts", "n", "max_new_tokens", "batch"):
        if getattr(a, name) < 1:
            raise SystemExit(f"[baseline] --{name.replace('_', '-')}: expected >= 1, got {getattr(a, name)}")
    result = measure(a.model, a.data, prompts=a.prompts, n=a.n, max_new_tokens=a.max_new_tokens,
                     temperature=a.temperature, seed=a.seed, batch=a.batch)
    print(f"[baseline] {json.dumps(result)}")


if __name__ == "__main__":
    main()
