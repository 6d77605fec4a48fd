"""Build the reverse-text dataset as verl RL parquet files (``train.parquet``, ``val.parquet``).

Each row is one prompt in verl's schema (the same columns as verl's gsm8k preprocessing)::

    data_source   "reverse_text"
    prompt        [{"role": "user", "content": "Reverse: cabd"}]   (chat messages)
    ability       "reverse"
    reward_model  {"style": "rule", "ground_truth": "dbac"}
    extra_info    {"split": "train", "index": 0}

Strings are drawn uniformly from a small alphabet (default ``abcdef``, lengths 3-6), so a model with
a character tokenizer learns the task in seconds on a CPU. Validation strings never occur in the
training split. Deterministic for a given seed.

Usage: ``python examples/reverse_text/make_data.py --out DIR [--n-train 4096 --n-val 128 --seed 0]``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "reverse_text"
ABILITY = "reverse"
DEFAULT_ALPHABET = "abcdef"
DEFAULT_MIN_LEN = 3
DEFAULT_MAX_LEN = 6


def random_string(rng: random.Random, alphabet: str = DEFAULT_ALPHABET, min_len: int = DEFAULT_MIN_LEN,
                  max_len: int = DEFAULT_MAX_LEN) -> str:
    """A string of ``min_len..max_len`` characters drawn uniformly from ``alphabet``."""
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))


def prompt_messages(s: str) -> list[dict[str, str]]:
    """The chat prompt that asks for ``s`` reversed."""
    return [{"role": "user", "content": f"Reverse: {s}"}]


def make_row(s: str, split: str, index: int) -> dict[str, Any]:
    """One verl RL row for the string ``s``."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt_messages(s),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": s[::-1]},
        "extra_info": {"split": split, "index": index},
    }


def _validate(alphabet: str, min_len: int, max_len: int, n_train: int, n_val: int) -> None:
    if len(alphabet) < 2 or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet: expected >= 2 distinct characters, got {alphabet!r}")
    if any(c.isspace() for c in alphabet):
        raise ValueError(f"alphabet: whitespace is not allowed (the reward compares raw text), got {alphabet!r}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"min_len/max_len: expected 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if n_train < 1 or n_val < 1:
        raise ValueError(f"n_train/n_val: expected >= 1 each, got n_train={n_train}, n_val={n_val}")
    distinct = sum(len(alphabet) ** k for k in range(min_len, max_len + 1))
    if n_val > distinct // 2:
        raise ValueError(f"n_val: at most {distinct // 2} distinct strings fit this alphabet/length range, got {n_val}")


def build_rows(n_train: int, n_val: int, *, seed: int = 0, alphabet: str = DEFAULT_ALPHABET,
               min_len: int = DEFAULT_MIN_LEN, max_len: int = DEFAULT_MAX_LEN) -> tuple[list[dict], list[dict]]:
    """Train and validation rows; validation strings are distinct and absent from the training rows."""
    _validate(alphabet, min_len, max_len, n_train, n_val)
    rng = random.Random(seed)
    val_strings: list[str] = []
    seen: set[str] = set()
    while len(val_strings) < n_val:
        s = random_string(rng, alphabet, min_len, max_len)
        if s not in seen:
            seen.add(s)
            val_strings.append(s)
    train_strings: list[str] = []
    while len(train_strings) < n_train:
        s = random_string(rng, alphabet, min_len, max_len)
        if s not in seen:  # repeats inside train are fine, as in any sampled task
            train_strings.append(s)
    train = [make_row(s, "train", i) for i, s in enumerate(train_strings)]
    val = [make_row(s, "val", i) for i, s in enumerate(val_strings)]
    return train, val


def write_dataset(out_dir: str | Path, n_train: int = 4096, n_val: int = 128, *, seed: int = 0,
                  alphabet: str = DEFAULT_ALPHABET, min_len: int = DEFAULT_MIN_LEN,
                  max_len: int = DEFAULT_MAX_LEN) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir``; returns their paths."""
    import pandas as pd

    train, val = build_rows(n_train, n_val, seed=seed, alphabet=alphabet, min_len=min_len, max_len=max_len)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "val.parquet"
    for rows, path in zip((train, val), paths):
        pd.DataFrame(rows).to_parquet(path, index=False)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    p.add_argument("--n-train", type=int, default=4096)
    p.add_argument("--n-val", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alphabet", default=DEFAULT_ALPHABET)
    p.add_argument("--min-len", type=int, default=DEFAULT_MIN_LEN)
    p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN)
    a = p.parse_args(argv)
    train, val = write_dataset(a.out, a.n_train, a.n_val, seed=a.seed, alphabet=a.alphabet,
                               min_len=a.min_len, max_len=a.max_len)
    print(f"[make_data] wrote {a.n_train} rows to {train} and {a.n_val} rows to {val}")


if __name__ == "__main__":
    main()
