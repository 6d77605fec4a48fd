"""Unit tests of the arithmetic example's task: the data generator (both prompt styles) and the reward.

The example files live under ``examples/arithmetic/`` (not a package); they are loaded by path, the way
verl and a user run them. verl's own loaders (``RLHFDataset``, ``get_custom_reward_fn``) are used where the
example promises compatibility with them. The few-shot prefix length is measured with the real SmolLM2
tokenizer (``smollm2_model_dir``, slow the first time on a machine: it downloads and builds the model).
"""

from __future__ import annotations

import pathlib

import pytest

from tests.support.scripts import load_script

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK_DIR = REPO_ROOT / "examples" / "arithmetic"


make_data = load_script("examples/arithmetic/make_data.py")
reward = load_script("examples/arithmetic/reward.py")


def _problem_key(row: dict) -> tuple[str, frozenset]:
    """The problem of a row, order-free (``a + b`` and ``b + a`` are one problem)."""
    q = row["extra_info"]["question"]
    a, op, b = q[len("What is "):-1].split(" ")
    return op, frozenset((int(a), int(b)))


# ----------------------------------------------------------------------------- data


@pytest.mark.parametrize("style", ["short", "fewshot"])
def test_rows_have_verls_schema_and_right_answers(style):
    train, val = make_data.build_rows(200, 40, style=style, seed=3, fewshot_examples=4)
    assert len(train) == 200 and len(val) == 40
    for split, rows in (("train", train), ("val", val)):
        for i, row in enumerate(rows):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert row["data_source"] == "arithmetic" and row["ability"] == "math"
            info = row["extra_info"]
            assert (info["split"], info["index"], info["style"]) == (split, i, style)
            last = row["prompt"][-1]
            assert last == {"role": "user", "content": f"{info['question']} Answer with just the number."}
            a, op, b = info["question"][len("What is "):-1].split(" ")
            expected = int(a) + int(b) if op == "+" else int(a) * int(b)
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(expected)}
            kind_range = {"add1": (1, 9, "+"), "add2": (10, 99, "+"), "mul1": (2, 9, "*")}[info["kind"]]
            assert kind_range[0] <= int(a) <= kind_range[1] and kind_range[0] <= int(b) <= kind_range[1]
            assert op == kind_range[2]
            if style == "short":
                assert len(row["prompt"]) == 1
            else:  # 4 worked examples (user, assistant) before the question
                assert [m["role"] for m in row["prompt"]] == ["user", "assistant"] * 4 + ["user"]


def test_rows_are_deterministic_per_seed():
    for style in ("short", "fewshot"):
        a = make_data.build_rows(300, 50, style=style, seed=7)
        assert a == make_data.build_rows(300, 50, style=style, seed=7)
        assert a[0] != make_data.build_rows(300, 50, style=style, seed=8)[0]


def test_train_and_val_share_no_problem_in_either_order():
    train, val = make_data.build_rows(4096, 512, seed=0)
    train_keys = {_problem_key(r) for r in train}
    val_keys = {_problem_key(r) for r in val}
    assert not train_keys & val_keys
    # every kind is in both splits, and both operand orders occur
    for rows in (train, val):
        assert {r["extra_info"]["kind"] for r in rows} == {"add1", "add2", "mul1"}
    operands = [r["extra_info"]["question"][len("What is "):-1].split(" ")[::2] for r in train]
    assert any(int(a) > int(b) for a, b in operands) and any(int(a) < int(b) for a, b in operands)


def test_the_mix_sets_the_share_of_each_kind():
    train, _ = make_data.build_rows(4000, 10, seed=1, mix={"add1": 0.5, "add2": 0.4, "mul1": 0.1})
    share = {k: sum(r["extra_info"]["kind"] == k for r in train) / len(train) for k in ("add1", "add2", "mul1")}
    assert abs(share["add1"] - 0.5) < 0.04 and abs(share["add2"] - 0.4) < 0.04 and abs(share["mul1"] - 0.1) < 0.03
    only_add2, _ = make_data.build_rows(100, 10, seed=1, mix={"add2": 1.0, "mul1": 0.0})
    assert {r["extra_info"]["kind"] for r in only_add2} == {"add2"}


def test_fewshot_prefix_is_the_same_for_every_prompt_of_both_splits():
    train, val = make_data.build_rows(100, 20, style="fewshot", seed=2)
    prefix = train[0]["prompt"][:-1]
    assert len(prefix) == 2 * make_data.DEFAULT_FEWSHOT_EXAMPLES
    assert all(r["prompt"][:-1] == prefix for r in train + val)
    assert len({r["prompt"][-1]["content"] for r in train}) > 50  # the questions differ
    # the worked examples are right, and none of them is a validation problem
    val_keys = {_problem_key(r) for r in val}
    for user, assistant in zip(prefix[::2], prefix[1::2]):
        question = user["content"].split("\n\n")[-1].removesuffix(" Answer with just the number.")
        row = {"extra_info": {"question": question}}
        a, op, b = question[len("What is "):-1].split(" ")
        expected = int(a) + int(b) if op == "+" else int(a) * int(b)
        assert reward.last_number(assistant["content"]) == expected
        assert _problem_key(row) not in val_keys


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"style": "long"}, "style"),
        ({"n_val": 0}, "n_train/n_val"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"style": "fewshot", "fewshot_examples": 0}, "fewshot_examples"),
    ],
)
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        make_data.build_rows(**{"n_train": 10, "n_val": 5, **kwargs})


@pytest.mark.parametrize(
    "text, fragment",
    [("add1=1,div=1", "kinds add1, add2, mul1"), ("add1", "kind=weight"), ("add1=x", "must be a number"),
     ("add1=-1", ">= 0"), ("add1=0,add2=0", "at least one positive")],
)
def test_bad_mix_is_refused_with_the_reason(text, fragment):
    with pytest.raises(ValueError, match=r"^mix: ") as e:
        make_data.parse_mix(text)
    assert fragment in str(e.value)


def test_script_writes_parquet_that_verls_dataset_loads(tmp_path, tiny_model_dir):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    make_data.main(["--out", str(tmp_path / "data"), "--n-train", "64", "--n-val", "8", "--seed", "1"])
    assert (tmp_path / "data" / "data_info.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = OmegaConf.create({"max_prompt_length": 128, "truncation": "error", "filter_overlong_prompts": True,
                            "cache_dir": str(tmp_path / "cache"), "return_raw_chat": True})
    ds = RLHFDataset(str(tmp_path / "data" / "train.parquet"), tokenizer, cfg)
    assert len(ds) == 64
    item = ds[5]
    assert item["data_source"] == "arithmetic"
    assert item["raw_prompt"][-1]["content"].startswith("What is ")
    assert item["extra_info"]["index"] == 5 and item["extra_info"]["split"] == "train"
    with pytest.raises(SystemExit, match=r"mix: "):
        make_data.main(["--out", str(tmp_path / "bad"), "--mix", "add3=1"])


@pytest.mark.slow  # the SmolLM2 tokenizer: the first run on a machine downloads and builds the model (~1 min)
def test_fewshot_prefix_is_one_to_two_thousand_smollm2_tokens(smollm2_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model_dir)
    train, val = make_data.build_rows(32, 8, style="fewshot", seed=0)
    rows = train + val
    shared = make_data.shared_prefix_length(rows, tokenizer)
    lengths = [len(make_data.prompt_token_ids(r["prompt"], tokenizer)) for r in rows]
    assert 1000 <= shared <= 2000, shared
    assert max(lengths) - shared <= 20  # only the question differs
    # the default sequence limits of the recipe (examples/common/arithmetic.sh) hold both styles
    assert max(lengths) <= 1600
    short, _ = make_data.build_rows(64, 1, style="short", seed=0)
    assert max(len(make_data.prompt_token_ids(r["prompt"], tokenizer)) for r in short) <= 256


# ----------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    "answer, truth, score",
    [
        ("42", "42", 1.0),
        ("17 + 25 = 42", "42", 1.0),
        ("The answer is 42.", "42", 1.0),
        ("42.0", "42", 1.0),
        ("42.", "42", 1.0),
        ("42 apples, I think", "42", 1.0),
        ("17 + 25 = 32", "42", 0.0),  # what the untrained model says
        ("42, no wait, 43", "42", 0.0),  # the LAST number counts
        ("43 - no, 42", "42", 1.0),
        ("42.5", "42", 0.0),
        ("", "42", 0.0),
        ("I don't know", "42", 0.0),
        ("   \n", "42", 0.0),
        ("1,234", "1234", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("12,34", "34", 1.0),  # not a thousands separator: two numbers
        ("-7", "-7", 1.0),
        ("\u22127", "-7", 1.0),  # unicode minus
        ("10-3", "3", 1.0),  # a subtraction, not -3
        ("10-3", "-3", 0.0),
        ("x = -3", "-3", 1.0),
        ("-7", "7", 0.0),
        ("42", "  42 ", 1.0),
        ("42", 42, 1.0),
    ],
)
def test_last_number_decides(answer, truth, score):
    assert reward.compute_score("arithmetic", answer, truth) == score


def test_reward_accepts_verls_extra_arguments():
    assert reward.compute_score("arithmetic", "7", "7", extra_info={"index": 1}, reward_router_address=None) == 1.0


def test_reward_rejects_other_data_and_bad_types():
    with pytest.raises(ValueError, match=r"^data_source: .*'gsm8k'"):
        reward.compute_score("gsm8k", "7", "7")
    with pytest.raises(TypeError, match=r"^solution_str: expected str, got NoneType"):
        reward.compute_score("arithmetic", None, "7")
    with pytest.raises(ValueError, match=r"^ground_truth: expected a number such as '42', got 'seven'"):
        reward.compute_score("arithmetic", "7", "seven")
    with pytest.raises(TypeError, match=r"^ground_truth: .*list"):
        reward.compute_score("arithmetic", "7", [7])


def test_verl_loads_the_reward_by_path():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(TASK_DIR / "reward.py"),
                                                                  "name": "compute_score"}}})
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source="arithmetic", solution_str="3 + 4 = 7", ground_truth="7", extra_info={}) == 1.0
