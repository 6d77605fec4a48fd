"""Unit tests of the reverse-text example's pieces: data builder, reward, SFT batches and the metrics plotter.

The example scripts live under ``examples/reverse_text/`` (not a package); they are loaded by path,
the way a user runs them. verl's own loaders (``RLHFDataset``, ``get_custom_reward_fn``) are used
where the example promises compatibility with them.
"""

from __future__ import annotations

import csv
import json
import pathlib
import sys

import pytest

from tests.support.scripts import load_script

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK_DIR = REPO_ROOT / "examples" / "reverse_text"


def _load(name: str):
    """Import ``examples/reverse_text/<name>.py`` as module ``reverse_text_<name>``."""
    if str(TASK_DIR) not in sys.path:  # warm_start imports its siblings by name, as when run as a script
        sys.path.insert(0, str(TASK_DIR))
    return load_script(TASK_DIR / f"{name}.py")


make_data = _load("make_data")
reward = _load("reward")
plot = _load("plot")


# ----------------------------------------------------------------------------- data


def test_rows_have_verls_schema():
    train, val = make_data.build_rows(50, 10, seed=3)
    assert len(train) == 50 and len(val) == 10
    for split, rows in (("train", train), ("val", val)):
        for i, row in enumerate(rows):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert row["data_source"] == "reverse_text"
            assert row["ability"] == "reverse"
            (msg,) = row["prompt"]
            assert msg["role"] == "user" and msg["content"].startswith("Reverse: ")
            s = msg["content"][len("Reverse: "):]
            assert 3 <= len(s) <= 6 and set(s) <= set("abcdef")
            assert row["reward_model"] == {"style": "rule", "ground_truth": s[::-1]}
            assert row["extra_info"] == {"split": split, "index": i}


def test_rows_are_deterministic_and_val_is_held_out():
    a_train, a_val = make_data.build_rows(300, 40, seed=7)
    b_train, b_val = make_data.build_rows(300, 40, seed=7)
    c_train, _ = make_data.build_rows(300, 40, seed=8)
    assert a_train == b_train and a_val == b_val
    assert a_train != c_train
    val_strings = {r["reward_model"]["ground_truth"] for r in a_val}
    assert len(val_strings) == 40  # distinct
    assert not val_strings & {r["reward_model"]["ground_truth"] for r in a_train}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"alphabet": "a"}, "alphabet"),
        ({"alphabet": "aab"}, "alphabet"),
        ({"alphabet": "ab c"}, "alphabet"),
        ({"min_len": 4, "max_len": 3}, "min_len"),
        ({"min_len": 0, "max_len": 3}, "min_len"),
        ({"n_val": 0}, "n_train/n_val"),
        ({"alphabet": "ab", "min_len": 1, "max_len": 1, "n_val": 2}, "n_val"),
    ],
)
def test_bad_parameters_name_the_field(kwargs, field):
    args = {"n_train": 10, "n_val": 5}
    args.update({k: kwargs.pop(k) for k in ("n_train", "n_val") if k in kwargs})
    with pytest.raises(ValueError, match=field):
        make_data.build_rows(args["n_train"], args["n_val"], **kwargs)


def test_parquet_loads_in_verls_rl_dataset(tmp_path, tiny_model_dir):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    train_path, val_path = make_data.write_dataset(tmp_path / "data", n_train=64, n_val=8, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = OmegaConf.create({"max_prompt_length": 64, "truncation": "error", "filter_overlong_prompts": True,
                            "cache_dir": str(tmp_path / "cache"), "return_raw_chat": True})
    ds = RLHFDataset(str(train_path), tokenizer, cfg)
    assert len(ds) == 64  # nothing filtered as over-long at 64 prompt tokens
    item = ds[5]
    assert item["data_source"] == "reverse_text"
    s = item["raw_prompt"][0]["content"][len("Reverse: "):]
    assert item["reward_model"]["ground_truth"] == s[::-1]
    assert item["extra_info"]["index"] == 5
    prompt_ids = tokenizer.apply_chat_template(list(item["raw_prompt"]), add_generation_prompt=True, tokenize=True)
    if hasattr(prompt_ids, "keys"):
        prompt_ids = prompt_ids["input_ids"]
    assert tokenizer.decode(prompt_ids).endswith(f"Reverse: {s}<|im_end|>\n<|im_start|>assistant\n")
    assert len(RLHFDataset(str(val_path), tokenizer, cfg)) == 8


# ----------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    "output, target, expected",
    [
        ("cba", "cba", 1.0),  # exact
        ("", "cba", 0.0),  # empty output
        ("", "", 0.0),  # degenerate: nothing to match
        ("abc", "cba", 1 / 3),  # only the middle position matches
        ("cb", "cba", 2 / 3),  # too short: missing position counts against
        ("cbax", "cba", 3 / 4),  # too long: extra position counts against
        ("cbacbacbac", "cba", 3 / 10),  # running to the length cap is punished
        ("xyz", "cba", 0.0),
        ("bcba", "cba", 0.0),  # shifted by one: per-position credit, not subsequence credit
    ],
)
def test_positional_partial_credit(output, target, expected):
    assert reward.compute_score("reverse_text", output, target) == pytest.approx(expected)


def test_reward_accepts_verls_extra_arguments():
    got = reward.compute_score(data_source="reverse_text", solution_str="fed", ground_truth="fed",
                               extra_info={"split": "train", "index": 0, "num_turns": 2},
                               reward_router_address=None)
    assert got == 1.0


def test_reward_rejects_other_data_and_types():
    with pytest.raises(ValueError, match="data_source.*'openai/gsm8k'"):
        reward.compute_score("openai/gsm8k", "42", "42")
    with pytest.raises(TypeError, match="solution_str"):
        reward.compute_score("reverse_text", None, "abc")
    with pytest.raises(TypeError, match="ground_truth"):
        reward.compute_score("reverse_text", "abc", ["a", "b", "c"])


def test_verl_loads_the_reward_by_path():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(TASK_DIR / "reward.py"),
                                                                  "name": "compute_score"}}})
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source="reverse_text", solution_str="dcba", ground_truth="dcba", extra_info={}) == 1.0
    assert fn(data_source="reverse_text", solution_str="dcb", ground_truth="dcba", extra_info={}) == 0.75


# ----------------------------------------------------------------------------- warm start batches


def test_sft_batch_trains_on_answer_and_end_token_only(tiny_model_dir):
    from transformers import AutoTokenizer

    warm_start = _load("warm_start")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, mask, labels = warm_start.sft_batch(tokenizer, ["abc", "fedcba"])
    assert ids.shape == mask.shape == labels.shape and ids.shape[0] == 2
    for row, s in enumerate(["abc", "fedcba"]):
        trained = labels[row][labels[row] != -100].tolist()
        assert tokenizer.decode(trained[:-1]) == s[::-1]
        assert trained[-1] == tokenizer.eos_token_id
        n = int(mask[row].sum())
        assert tokenizer.decode(ids[row, :n].tolist()).endswith(f"Reverse: {s}<|im_end|>\n<|im_start|>assistant\n"
                                                                f"{s[::-1]}<|im_end|>")
        assert (ids[row, n:] == tokenizer.pad_token_id).all() and (labels[row, n:] == -100).all()


# ----------------------------------------------------------------------------- plot


def _write_jsonl(path: pathlib.Path, rewards: list[float]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"step": step, "data": {"critic/score/mean": r, "timing_s/gen": 0.5 + step,
                                                      "training/epoch": 0, "note": "text is skipped"}}) + "\n" for step, r in enumerate(rewards, start=1))
        # validation is a separate log call at the last step
        f.write(json.dumps({"step": len(rewards), "data": {"val-core/reverse_text/acc/mean@1": 0.9}}) + "\n")


def test_plot_writes_csv_png_and_summary(tmp_path):
    rewards = [0.40, 0.45, 0.50, 0.45, 0.50, 0.60, 0.70, 0.80, 0.85, 0.90, 0.80, 0.85]
    metrics_path = tmp_path / "metrics.jsonl"
    _write_jsonl(metrics_path, rewards)
    summary = plot.main([str(metrics_path), "--out-dir", str(tmp_path / "out")])

    assert summary["steps"] == 12
    assert summary["first5"] == pytest.approx((0.40 + 0.45 + 0.50 + 0.45 + 0.50) / 5, abs=1e-4)
    assert summary["last5"] == pytest.approx((0.80 + 0.85 + 0.90 + 0.80 + 0.85) / 5, abs=1e-4)
    assert summary["gain"] == pytest.approx(0.84 - 0.46, abs=1e-4)
    assert summary["peak"] == pytest.approx(0.90)
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary

    with open(tmp_path / "out" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    assert set(rows[0]) == {"step", "critic/score/mean", "timing_s/gen", "training/epoch",
                            "val-core/reverse_text/acc/mean@1"}
    assert [float(r["critic/score/mean"]) for r in rows] == rewards
    val_key = "val-core/reverse_text/acc/mean@1"
    assert rows[0][val_key] == "" and float(rows[-1][val_key]) == 0.9
    assert float(rows[-1]["critic/score/mean"]) == 0.85  # merged with the validation line of the same step

    png = (tmp_path / "out" / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000


def test_plot_rejects_a_file_without_the_metric(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "data": {"actor/pg_loss": 0.1}}) + "\n")
    with pytest.raises(SystemExit, match="critic/score/mean"):
        plot.main([str(path), "--out-dir", str(tmp_path / "out")])
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="m.jsonl:1"):
        plot.load_metrics(path)


def test_summarize_needs_enough_steps():
    with pytest.raises(ValueError, match="at least k=5"):
        plot.summarize([0.1, 0.2, 0.3])
    assert plot.summarize([0.0] * 5 + [1.0] * 5)["gain"] == 1.0


# ----------------------------------------------------------------------------- warm start on the server


@pytest.mark.slow
def test_warm_start_runs_on_the_reference_server(tmp_path, tiny_model_dir):
    """A few SFT steps through the server's cross_entropy loss lower the loss and export a loadable model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _load("warm_start")  # puts the example directory on sys.path for its sibling imports
    server_route = _load("warm_start_server")
    summary = server_route.warm_start_via_server(tiny_model_dir, tmp_path / "ws", target=1.0, max_steps=6,
                                                 eval_every=3, eval_prompts=16, batch_size=16, seed=0)
    assert summary["via"] == "server" and summary["steps"] == 6 and summary["reached"] is False
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert 0.0 <= summary["sampled_reward"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ws")
    assert AutoTokenizer.from_pretrained(tmp_path / "ws").eos_token == "<|im_end|>"
    assert model.config.model_type == "qwen3"
    assert json.loads((tmp_path / "ws" / "warm_start.json").read_text())["history"] == summary["history"]
