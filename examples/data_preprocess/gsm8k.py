"""Convert GSM8K into verl's RL parquet schema (``train.parquet``, ``test.parquet``).

The rows are what verl's built-in rule reward for ``data_source="openai/gsm8k"``
(``verl.utils.reward_score.gsm8k.compute_score``) expects: it takes the last ``#### <number>`` of the
response, drops commas and compares the string with ``reward_model.ground_truth`` -- so the ground
truth here is the number after ``####`` in the dataset's answer, commas removed, and the prompt asks
for that format. No custom reward function is needed.

Row schema::

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": <question> + instruction}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "72"}
    extra_info    {"split", "index", "answer", "question"}

The raw dataset is read with ``datasets.load_dataset(<path>, "main")``: a local copy of the
``openai/gsm8k`` dataset repository (this project's CI has no hub access), or the hub name itself
where the hub is reachable.

Usage: ``python examples/data_preprocess/gsm8k.py --local_dataset_path /data/gsm8k --local_save_dir ~/data/gsm8k``.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

DATA_SOURCE = "openai/gsm8k"
ABILITY = "math"
# The answer format verl's gsm8k reward parses ("#### 72").
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer, without thousands separators."""
    match = _FINAL_ANSWER.search(answer)
    if match is None:
        raise ValueError(f"answer: expected a final line '#### <number>', got {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def make_row(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """One verl RL row from a raw GSM8K example (``question``, ``answer``)."""
    for field in ("question", "answer"):
        if not isinstance(example.get(field), str):
            got = type(example.get(field)).__name__
            raise TypeError(f"{field}: expected a string in every GSM8K example, got {got}")
    question, answer = example["question"], example["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert(dataset_path: str, save_dir: str) -> dict[str, str]:
    """Load the raw dataset (config ``main``), write ``train.parquet``/``test.parquet``; returns their paths."""
    import datasets

    raw = datasets.load_dataset(dataset_path, "main")
    missing = {"train", "test"} - set(raw.keys())
    if missing:
        raise ValueError(f"{dataset_path}: expected splits ['test', 'train'], missing {sorted(missing)}")
    save_dir = os.path.expanduser(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        ds = raw[split]
        converted = ds.map(lambda ex, idx, s=split: make_row(ex, idx, s), with_indices=True,
                           remove_columns=ds.column_names)
        paths[split] = os.path.join(save_dir, f"{split}.parquet")
        converted.to_parquet(paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_dataset_path", default=None,
                   help="local copy of the openai/gsm8k dataset repository (default: the hub name)")
    p.add_argument("--local_save_dir", default="~/data/gsm8k", help="where train.parquet and test.parquet go")
    a = p.parse_args(argv)
    paths = convert(a.local_dataset_path or DATA_SOURCE, a.local_save_dir)
    print(f"[gsm8k] wrote {paths['train']} and {paths['test']}")


if __name__ == "__main__":
    main()
