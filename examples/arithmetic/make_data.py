"""Build the arithmetic dataset (a verifiable task, generated here) as verl RL parquet files.

Each row is one prompt in verl's schema (the columns of verl's gsm8k preprocessing)::

    data_source   "arithmetic"
    prompt        [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "42"}
    extra_info    {"split": "train", "index": 0, "kind": "add2", "style": "short", "question": "What is 17 + 25?"}

``prompt`` is a list of chat messages: verl renders it with the model's chat template. The reward
(``reward.py``) is 1 when the last number of the answer equals ``ground_truth``.

Problem kinds: ``add1`` (single-digit sums), ``add2`` (two-digit sums), ``mul1`` (single-digit products).
The default mix (``--mix add1=0.5,add2=0.4,mul1=0.1``) puts the untrained SmolLM2-135M-Instruct's mean reward
near 0.2 at temperature 1 (``baseline.py`` on CPU: 0.18 over 32 prompts x 4; single-digit sums 0.25, two-digit
0.06): room to learn, but not zero. Every distinct problem (``a + b`` and ``b + a`` are the same problem) belongs to exactly one split:
``--val-fraction`` of each kind's problems are held out for validation, so train and val never share a problem.

Prompt styles (``--style``):

* ``short``: the question alone, one user message;
* ``fewshot``: the same question after a fixed conversation of ``--fewshot-examples`` worked examples
  (user question, assistant answer, ...), drawn from the training problems. Every row of both splits
  has the SAME prefix (1-2K tokens with the SmolLM2 tokenizer at the default 30 examples; ``--model DIR``
  prints its exact token length): the n samples of a prompt, and all prompts, share it.

Deterministic for a given seed. Usage::

    python examples/arithmetic/make_data.py --out DIR [--style short|fewshot] [--n-train 4096 --n-val 256 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "arithmetic"
ABILITY = "math"
STYLES = ("short", "fewshot")
INSTRUCTION = "Answer with just the number."
# kind -> (operator, operand range); every pair of the range is a problem
KINDS: dict[str, tuple[str, range]] = {
    "add1": ("+", range(1, 10)),
    "add2": ("+", range(10, 100)),
    "mul1": ("*", range(2, 10)),
}
DEFAULT_MIX = {"add1": 0.5, "add2": 0.4, "mul1": 0.1}
DEFAULT_FEWSHOT_EXAMPLES = 30
FEWSHOT_INTRO = ("I will ask you arithmetic questions. Work out each one carefully and end your answer with "
                 "the result.")

Problem = tuple[str, int, int]  # (kind, a, b)


def question(problem: Problem) -> str:
    kind, a, b = problem
    return f"What is {a} {KINDS[kind][0]} {b}?"


def answer_value(problem: Problem) -> int:
    kind, a, b = problem
    return a + b if KINDS[kind][0] == "+" else a * b


def worked_answer(problem: Problem) -> str:
    """The assistant's answer in a few-shot example: two-digit sums column by column, the rest directly."""
    kind, a, b = problem
    op, result = KINDS[kind][0], answer_value(problem)
    if kind != "add2":
        return f"{a} {op} {b} = {result}"
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    carry_text = f", carry {carry}" if carry else ""
    return (f"Ones: {a % 10} + {b % 10} = {ones}, write {ones % 10}{carry_text}. "
            f"Tens: {a // 10} + {b // 10}{' + 1' if carry else ''} = {tens}. So {a} + {b} = {result}")


def parse_mix(text: str) -> dict[str, float]:
    """``"add1=0.5,add2=0.5"`` -> weights (kinds of :data:`KINDS`, non-negative, at least one positive)."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in KINDS:
            raise ValueError(f"mix: expected kind=weight pairs with kinds {', '.join(KINDS)}, got {part.strip()!r}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"mix: the weight of {name!r} must be a number, got {value!r}") from None
        if weight < 0:
            raise ValueError(f"mix: the weight of {name!r} must be >= 0, got {weight}")
        mix[name] = weight
    if not any(w > 0 for w in mix.values()):
        raise ValueError(f"mix: expected at least one positive weight, got {text!r}")
    return mix


def split_problems(seed: int, val_fraction: float) -> tuple[dict[str, list[Problem]], dict[str, list[Problem]]]:
    """Each kind's distinct problems (commutative pairs counted once), shuffled and cut into train and val pools.

    Both orders of a pair go to the same split; each split gets at least one problem of every kind.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a number in (0, 1), got {val_fraction}")
    rng = random.Random(f"arithmetic-split-{seed}")
    train: dict[str, list[Problem]] = {}
    val: dict[str, list[Problem]] = {}
    for kind, (_, operands) in KINDS.items():
        pairs = [(a, b) for a in operands for b in operands if a <= b]  # canonical: a <= b
        rng.shuffle(pairs)
        n_val = min(len(pairs) - 1, max(1, round(len(pairs) * val_fraction)))
        val[kind] = [(kind, a, b) for a, b in pairs[:n_val]]
        train[kind] = [(kind, a, b) for a, b in pairs[n_val:]]
    return train, val


def draw(rng: random.Random, pools: dict[str, list[Problem]], mix: dict[str, float]) -> Problem:
    """A problem: a kind by weight, a pair of its pool, its operands in random order."""
    kinds = [k for k, w in mix.items() if w > 0]
    kind = rng.choices(kinds, weights=[mix[k] for k in kinds])[0]
    _, a, b = rng.choice(pools[kind])
    if rng.random() < 0.5:
        a, b = b, a
    return kind, a, b


def fewshot_messages(rng: random.Random, pools: dict[str, list[Problem]], mix: dict[str, float],
                     n_examples: int) -> list[dict[str, str]]:
    """The shared few-shot conversation: an introduction, then ``n_examples`` question/answer turns."""
    messages: list[dict[str, str]] = []
    for i in range(n_examples):
        problem = draw(rng, pools, mix)
        content = f"{question(problem)} {INSTRUCTION}"
        if i == 0:
            content = f"{FEWSHOT_INTRO}\n\n{content}"
        messages.append({"role": "user", "content": content})
        messages.append({"role": "assistant", "content": worked_answer(problem)})
    return messages


def make_row(problem: Problem, split: str, index: int, style: str,
             prefix: list[dict[str, str]]) -> dict[str, Any]:
    """One verl RL row; ``prefix`` (the few-shot conversation, empty for ``short``) comes before the question."""
    q = question(problem)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [*prefix, {"role": "user", "content": f"{q} {INSTRUCTION}"}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(answer_value(problem))},
        "extra_info": {"split": split, "index": index, "kind": problem[0], "style": style, "question": q},
    }


def build_rows(n_train: int, n_val: int, *, style: str = "short", seed: int = 0,
               mix: dict[str, float] | None = None, val_fraction: float = 0.1,
               fewshot_examples: int = DEFAULT_FEWSHOT_EXAMPLES) -> tuple[list[dict], list[dict]]:
    """Train and validation rows (see the module docstring); no problem occurs in both."""
    if style not in STYLES:
        raise ValueError(f"style: expected one of {', '.join(STYLES)}, got {style!r}")
    if n_train < 1 or n_val < 1:
        raise ValueError(f"n_train/n_val: expected >= 1 each, got n_train={n_train}, n_val={n_val}")
    if style == "fewshot" and fewshot_examples < 1:
        raise ValueError(f"fewshot_examples: expected >= 1 for the fewshot style, got {fewshot_examples}")
    mix = dict(DEFAULT_MIX if mix is None else mix)
    train_pools, val_pools = split_problems(seed, val_fraction)
    rng = random.Random(f"arithmetic-rows-{seed}")
    prefix = fewshot_messages(random.Random(f"arithmetic-fewshot-{seed}"), train_pools, mix,
                              fewshot_examples) if style == "fewshot" else []
    train = [make_row(draw(rng, train_pools, mix), "train", i, style, prefix) for i in range(n_train)]
    val = [make_row(draw(rng, val_pools, mix), "val", i, style, prefix) for i in range(n_val)]
    return train, val


def prompt_token_ids(messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The prompt's tokens as verl renders them: the chat template with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5


def shared_prefix_length(rows: list[dict], tokenizer: Any) -> int:
    """How many leading prompt tokens all ``rows`` have in common (the few-shot prefix and more)."""
    ids = [prompt_token_ids(r["prompt"], tokenizer) for r in rows]
    shared = min(len(x) for x in ids)
    for x in ids[1:]:
        shared = next((i for i in range(shared) if x[i] != ids[0][i]), shared)
    return shared


def write_dataset(out_dir: str | Path, n_train: int = 4096, n_val: int = 256, **kwargs: Any) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir``; returns their paths."""
    import pandas as pd

    train, val = build_rows(n_train, n_val, **kwargs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "val.parquet"
    for rows, path in zip((train, val), paths):
        pd.DataFrame(rows).to_parquet(path, index=False)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    p.add_argument("--style", default="short", choices=STYLES)
    p.add_argument("--n-train", type=int, default=4096)
    p.add_argument("--n-val", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()),
                   help="kind=weight pairs; kinds: " + ", ".join(KINDS))
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of each kind's problems held out for val")
    p.add_argument("--fewshot-examples", type=int, default=DEFAULT_FEWSHOT_EXAMPLES)
    p.add_argument("--model", default=None, help="a model directory: report the prompts' token lengths")
    a = p.parse_args(argv)
    try:
        mix = parse_mix(a.mix)
        kwargs = {"style": a.style, "seed": a.seed, "mix": mix, "val_fraction": a.val_fraction,
                  "fewshot_examples": a.fewshot_examples}
        train_path, val_path = write_dataset(a.out, a.n_train, a.n_val, **kwargs)
    except ValueError as e:
        raise SystemExit(f"[make_data] {e}") from None
    info: dict[str, Any] = {"style": a.style, "seed": a.seed, "mix": mix, "n_train": a.n_train, "n_val": a.n_val}
    if a.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
        sample, _ = build_rows(64, 1, **kwargs)
        lengths = [len(prompt_token_ids(r["prompt"], tokenizer)) for r in sample]
        info.update(prompt_tokens_min=min(lengths), prompt_tokens_max=max(lengths),
                    shared_prefix_tokens=shared_prefix_length(sample, tokenizer))
    (Path(a.out) / "data_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"[make_data] wrote {a.n_train} rows to {train_path} and {a.n_val} rows to {val_path}: {json.dumps(info)}")


if __name__ == "__main__":
    main()
