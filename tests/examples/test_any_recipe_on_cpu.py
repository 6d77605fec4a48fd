"""The README's "any verl recipe" command runs as written against a running Arctic RL server, and the trained
model comes back as a Hugging Face directory (``examples/common/export_hf.py``); docs/ANY_RECIPE.md's table of
what the entry point sets names every setting it forces.

The command is read from README.md (the fenced block after ``<!-- any-recipe-command -->``) and run by bash with
its variables pointing at a tiny task (``tests.support.e2e.build_task``: ``a+b=`` prompts, a custom reward file, a
tiny Qwen3 from ``arctic_rl/tiny_models.py``) and at the reference server. Overrides appended after it keep the CI run short (one
step of 4 prompts x 4 samples, 10 response tokens) -- Hydra takes the last value of a key.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
ANY_RECIPE = REPO_ROOT / "docs" / "ANY_RECIPE.md"
MARKER = "<!-- any-recipe-command -->"
# one GRPO step of 4 prompts x 4 samples (the README's sizes are a real recipe's)
SHRINK = [
    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "data.max_prompt_length=64", "data.max_response_length=10", "trainer.total_training_steps=1",
    "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=1",
    "remote_backend.train.deepspeed.bf16=false",
    "actor_rollout_ref.actor.optim.lr=1e-3",  # verl's 1e-6 moves a tiny model's weights below what the check can see
]


def readme_command() -> str:
    """The fenced command after the marker, continuation lines joined."""
    text = README.read_text()
    assert MARKER in text, f"{MARKER} not in README.md"
    block = text.split(MARKER, 1)[1].split("```", 2)[1]
    lines = block.split("\n", 1)[1]  # drop the fence's language tag
    return re.sub(r"\\\n\s*", " ", lines).strip()


def _table_keys(page: pathlib.Path, heading: str) -> set[str]:
    """The backticked keys of the first column of the table under ``heading``."""
    section = page.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            keys.update(re.findall(r"`([a-z_][\w.\-]*)`", line.split("|")[1]))
    return keys


def test_the_readme_command_is_a_complete_recipe():
    command = readme_command()
    assert command.startswith("python -m verl.remote_backend.main_ppo remote_backend=arctic ")
    for key in ("remote_backend.server.url", "data.train_files", "data.val_files", "actor_rollout_ref.model.path",
                "reward.custom_reward_function.path", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n",
                "data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"):
        assert key in command, key
    assert "\n" not in command and "&&" not in command and ";" not in command


def test_the_table_names_every_setting_the_entry_point_forces():
    from verl.remote_backend.main_ppo import CONFIG_DIR, CONFIG_NAME
    from verl.remote_backend.settings import forced_settings

    table = _table_keys(ANY_RECIPE, "## What the entry point sets for you")
    forced = set(forced_settings("arctic", has_accelerator=False))
    assert forced <= table, sorted(forced - table)
    assert "ray_kwargs.ray_init.num_cpus" in table

    def leaves(node: dict, prefix: str = ""):
        for key, value in node.items():
            if key == "defaults":
                continue
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                yield from leaves(value, dotted + ".")
            else:
                yield dotted

    defaults = set(leaves(yaml.safe_load((pathlib.Path(CONFIG_DIR) / f"{CONFIG_NAME}.yaml").read_text())))
    assert defaults <= table | forced, sorted(defaults - table - forced)


@pytest.mark.slow  # one verl run (Ray, the adapter, the reference server's DeepSpeed job), then the export: ~2-4 min
def test_the_readme_command_runs_against_the_reference_server_and_the_model_comes_back(reference_server, tmp_path):
    from tests.support.e2e import build_task, entry_point_env

    task = build_task(tmp_path / "task")  # a+b= prompts, a tiny Qwen3, a reward that varies between samples
    task["val"].rename(task["val"].with_name("test.parquet"))  # the README names GSM8K's files
    env = entry_point_env(ARCTIC_RL_URL=reference_server.url, DATA=str(task["train"].parent), MODEL=str(task["model"]),
                          REWARD=str(task["reward"]),
                          PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    command = " ".join([readme_command(), *SHRINK, f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                        f"hydra.run.dir={tmp_path / 'hydra'}"])
    start = time.monotonic()
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200, check=False)
    wall = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    step = re.search(r"step:1 - .*$", output, re.MULTILINE)
    assert step and "critic/score/mean:" in step.group(0), output[-3000:]
    grad_norm = float(re.search(r"actor/grad_norm:([-\d.e]+)", step.group(0)).group(1))
    assert grad_norm > 0, step.group(0)  # the samples' rewards differed: the step moved the weights
    assert (tmp_path / "ckpt" / "global_step_1").is_dir()  # verl's save, done on the server

    start_export = time.monotonic()
    export = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "common" / "export_hf.py"),
                             str(tmp_path / "hydra"), "--out", str(tmp_path / "hf")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    export_wall = time.monotonic() - start_export
    assert export.returncode == 0, (export.stdout + export.stderr)[-6000:]
    assert '"global_step": 1' in export.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size >= len(tokenizer) > 0
    base = AutoModelForCausalLM.from_pretrained(task["model"])
    trained, untrained = dict(model.named_parameters()), dict(base.named_parameters())
    assert any(not (trained[name] == untrained[name]).all() for name in untrained)  # a trained model, not the base
    print(f"recipe run {wall:.0f} s, export {export_wall:.0f} s")
    shutil.rmtree(tmp_path / "hf")
