"""Helpers for the end-to-end GRPO runs in ``tests/special_e2e/``: a tiny task and verl's console metrics.

:func:`build_task` writes what a stock verl GRPO command needs for the ``a+b=`` task: a char-level
Qwen3 built on the spot, train/val parquet files in verl's RL format and a reward-function file
(``reward.custom_reward_function``). :func:`parse_console_metrics` reads the per-step lines of
verl's console logger back.
"""

from __future__ import annotations

import re
from pathlib import Path

REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 for the right sum in the answer, plus a small bonus per distinct character (varied rewards)."""
    text = solution_str.strip()
    return (1.0 if ground_truth in text else 0.0) + 0.05 * len(set(text))
'''
_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
_NUMBER = re.compile(r"-?\d+(\.\d+)?(e-?\d+)?")


def build_task(root: Path, *, n_val: int = 4) -> dict[str, Path]:
    """8 ``a+b=`` training rows (the first ``n_val`` also as validation), the model and the reward file."""
    import pandas as pd

    from arctic_rl.tiny_models import build_tiny_model

    root.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(root / "model", "qwen3", seed=0)
    rows = []
    for i in range(8):
        a, b = i % 5, (3 * i) % 7
        rows.append({
            "data_source": "tiny/add",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": i},
        })
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:n_val]).to_parquet(root / "val.parquet")
    (root / "reward.py").write_text(REWARD_FN)
    return {"model": Path(model), "train": root / "train.parquet", "val": root / "val.parquet", "reward": root / "reward.py"}


def parse_console_metrics(text: str) -> dict[int, dict[str, float]]:
    """verl's console logger lines ``step:N - key:value - ...`` -> {N: {key: value}}."""
    steps: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        match = _STEP_LINE.search(line)
        if not match:
            continue
        metrics = {}
        for item in match.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            number = _NUMBER.search(value)
            if key and number:
                metrics[key.strip()] = float(number.group(0))
        steps[int(match.group(1))] = metrics
    return steps
