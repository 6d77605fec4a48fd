"""The stock-verl and the remote-backend arithmetic scripts do the same training work.

``examples/grpo/run_arithmetic_grpo_smollm2_stock.sh`` (stock ``verl.trainer.main_ppo``, FSDP + vLLM) and
``examples/grpo/run_arithmetic_grpo_smollm2.sh`` (``remote_backend=arctic``) are compared side by side on the
H200, which only means something while every setting that changes what is learned is the same in both.
Each script is run as a user runs it, with Hydra's ``--cfg job`` appended, and the composed job configs
are compared key by key: whole subtrees (data, algorithm, reward, the actor without its engine keys) and
the sampling, model and trainer keys listed below. For the remote side, the DeepSpeed optimizer, clipping
and schedule that the adapter sends to the reference server are built from its config and compared with
the ones built from stock verl's ``actor.optim``. A parametrised case gives one script a differing
setting and expects the comparison to name it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.support.model_shapes import SMOLLM2_ATTENTION

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GRPO_DIR = REPO_ROOT / "examples" / "grpo"
SCRIPTS = {"stock": "run_arithmetic_grpo_smollm2_stock.sh", "remote": "run_arithmetic_grpo_smollm2.sh"}
# Knobs both scripts read; the same values go to both (non-defaults, so that a knob one script ignores shows).
KNOBS = {"DEVICE": "cuda", "STEPS": "37", "SEED": "3", "PROMPT_STYLE": "short"}

# Subtrees compared whole, minus the keys of a backend (where and how the model runs, not what is learned).
SUBTREES = ("data", "algorithm", "reward", "custom_reward_function", "reward_model", "actor_rollout_ref.actor")
BACKEND_KEYS = (
    "actor_rollout_ref.actor.fsdp_config.",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.ppo_micro_batch_size",  # and _per_gpu: gradient accumulation, same update
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.actor.use_fused_kernels",
    "actor_rollout_ref.actor.use_remove_padding",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking",
    "actor_rollout_ref.actor.entropy_from_logits_chunk_size",
    "actor_rollout_ref.actor.checkpoint.",
    "actor_rollout_ref.actor.profiler.",
    "reward.num_workers",
)
# Single keys compared outside those subtrees.
ROLLOUT = "actor_rollout_ref.rollout."
KEYS = tuple(ROLLOUT + k for k in (
    "n", "temperature", "top_p", "top_k", "seed", "do_sample", "prompt_length", "response_length", "ignore_eos",
    "over_sample_rate", "calculate_log_probs", "val_kwargs.n", "val_kwargs.temperature", "val_kwargs.top_p",
    "val_kwargs.top_k", "val_kwargs.do_sample", "multi_turn.enable", "agent.default_agent_loop",
)) + tuple("actor_rollout_ref.model." + k for k in (
    "path", "tokenizer_path", "custom_chat_template", "lora_rank", "trust_remote_code",
)) + tuple("trainer." + k for k in (
    "total_training_steps", "total_epochs", "val_before_train", "test_freq", "critic_warmup", "balance_batch",
    "project_name", "logger",
))
# What the comparison must cover (the recipe's settings), whatever the subtrees hold.
REQUIRED = (
    "data.train_files", "data.val_files", "data.train_batch_size", "data.max_prompt_length",
    "data.max_response_length", "data.shuffle", "data.seed",
    "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.optim.betas", "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.clip_grad", "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.lr_scheduler_type", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.data_loader_seed", "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward", "reward.custom_reward_function.path", "reward.custom_reward_function.name",
    "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k", "actor_rollout_ref.rollout.seed", "trainer.total_training_steps",
)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def compared(flat: dict[str, Any]) -> dict[str, Any]:
    """The training-relevant keys of one flattened job config."""
    keep = {k: v for k, v in flat.items()
            if (k.startswith(tuple(s + "." for s in SUBTREES)) and not k.startswith(BACKEND_KEYS)) or k in KEYS}
    missing = [k for k in REQUIRED if k not in keep]
    assert not missing, f"the composed config lacks {missing}: did verl's config layout change?"
    return keep


def mismatches(stock: dict, remote: dict) -> list[str]:
    """``key: stock=... remote=...`` for every training-relevant key that differs between the two configs."""
    a, b = compared(flatten(stock)), compared(flatten(remote))
    absent = "<absent>"
    return [f"{k}: stock={a.get(k, absent)!r} remote={b.get(k, absent)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, absent) != b.get(k, absent)]


def compose(side: str, tmp: pathlib.Path, overrides: tuple[str, ...] = (), env_extra: dict | None = None) -> dict:
    """``bash <script> [overrides] --cfg job`` with the shared knobs; the job config it prints."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"ZORRO", "STEPS", "SEED", "MODEL_DIR", "DATA_DIR", "OUT_DIR", "ARCTIC_RL_URL", "RUN_NAME",
                        "RUN_DIR", "DEVICE", "PROMPT_STYLE", "BATCH", "N", "MINI_BATCH", "MICRO", "RESP_LEN",
                        "PROMPT_LEN", "LR", "TEMPERATURE", "VERL_FILE_LOGGER_PATH", "KV_CACHE_BYTES",
                        "GPU_MEMORY_UTILIZATION"}}
    env.update(KNOBS, PYTHON=sys.executable, OUT_DIR=str(tmp / "out"), MODEL_DIR=str(tmp / "model"),
               PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", **(env_extra or {}))
    proc = subprocess.run(["bash", str(GRPO_DIR / SCRIPTS[side]), *overrides, "--cfg", "job"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return yaml.safe_load(proc.stdout)  # Hydra prints only the config on stdout


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("arith")
    return {side: compose(side, tmp) for side in SCRIPTS}


@pytest.mark.slow  # each script composes verl's config in a Python process that imports verl (~15-30 s)
def test_the_two_recipes_agree(configs):
    stock, remote = configs["stock"], configs["remote"]
    assert mismatches(stock, remote) == []
    # each side is the backend it claims, with the shared knobs applied
    assert stock["actor_rollout_ref"]["rollout"]["name"] == "vllm"
    assert stock["trainer"]["v1"]["trainer_mode"] == "sync"  # verl's own trainer, no remote backend
    assert "remote_backend" not in stock or not stock["remote_backend"]
    assert remote["remote_backend"]["name"] == "arctic"
    for cfg in (stock, remote):
        assert cfg["trainer"]["total_training_steps"] == 37
        assert cfg["data"]["seed"] == 3 and cfg["actor_rollout_ref"]["rollout"]["seed"] == 3


@pytest.mark.slow
def test_the_reference_server_gets_stock_verls_optimizer(configs):
    """The DeepSpeed config the adapter sends (from the remote config) has the optimizer, clipping and
    schedule that stock verl's FSDP actor takes from ``actor.optim``."""
    from omegaconf import OmegaConf

    from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
    from verl.workers.remote_client.arctic.builders import build_ds_config
    from verl.workers.remote_client.common.verl_settings import VerlSettings

    stock_cfg, remote_cfg = OmegaConf.create(configs["stock"]), OmegaConf.create(configs["remote"])
    arctic = ArcticConfig.from_main_config(remote_cfg)
    sent = build_ds_config(VerlSettings.from_main_config(remote_cfg), arctic)
    from_stock = build_ds_config(VerlSettings.from_main_config(stock_cfg), arctic)
    for key in ("optimizer", "gradient_clipping", "scheduler", "train_batch_size", "gradient_accumulation_steps"):
        assert sent.get(key) == from_stock.get(key), key
    optim = configs["stock"]["actor_rollout_ref"]["actor"]["optim"]
    params = sent["optimizer"]["params"]
    assert sent["optimizer"]["type"].lower() == str(optim["optimizer"]).lower() == "adamw"
    assert params["lr"] == pytest.approx(optim["lr"])
    assert params["betas"] == pytest.approx(list(optim["betas"]))
    assert params["weight_decay"] == pytest.approx(optim["weight_decay"])
    assert sent["gradient_clipping"] == pytest.approx(optim["clip_grad"])
    assert optim["lr_scheduler_type"] == "constant" and optim["lr_warmup_steps"] == 0
    assert sent.get("scheduler") is None  # constant lr, no warm-up: no DeepSpeed scheduler either


@pytest.mark.slow
@pytest.mark.parametrize(("side", "overrides", "env_extra", "key"), [
    ("stock", ("actor_rollout_ref.actor.optim.lr=2e-5",), None, "actor_rollout_ref.actor.optim.lr"),
    ("remote", ("actor_rollout_ref.rollout.top_p=0.9",), None, "actor_rollout_ref.rollout.top_p"),
    ("remote", ("algorithm.norm_adv_by_std_in_grpo=False",), None, "algorithm.norm_adv_by_std_in_grpo"),
    ("stock", (), {"N": "4"}, "actor_rollout_ref.rollout.n"),
])
def test_a_drifting_script_is_caught(configs, tmp_path, side, overrides, env_extra, key):
    drifted = dict(configs)
    drifted[side] = compose(side, tmp_path, overrides, env_extra)
    found = mismatches(drifted["stock"], drifted["remote"])
    assert any(line.startswith(key + ":") for line in found), found


def _run_stock(tmp_path: pathlib.Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"DEVICE", "ATTN", "FUSED_KERNELS", "RUN_DIR", "RUN_NAME",
                                                          "PROMPT_STYLE"}}
    env.update(PYTHON=sys.executable, OUT_DIR=str(tmp_path / "out"), **env_extra)
    return subprocess.run(["bash", str(GRPO_DIR / SCRIPTS["stock"]), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_stock_script_refuses_to_run_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _run_stock(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "stock verl needs a CUDA GPU" in proc.stderr and "--cfg job" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing built, nothing started
    proc = _run_stock(tmp_path, DEVICE="cpu")
    assert proc.returncode == 2 and "DEVICE=cpu" in proc.stderr


def test_the_stock_script_names_a_bad_attention_setting(tmp_path):
    proc = _run_stock(tmp_path, "--cfg", "job", ATTN="flash")
    assert proc.returncode == 2
    assert "ATTN: expected auto, flash_attention_2, sdpa or eager, got 'flash'" in proc.stderr


def test_the_stock_script_takes_fused_log_prob_kernels_unless_flash_attn_is_there(tmp_path):
    """Without flash-attn, verl's own log-prob fallback loops over every token; the stock recipe takes verl's fused
    kernels instead (``FUSED_KERNELS=auto``), and a wrong value is named."""
    import importlib.util

    default = yaml.safe_load(_run_stock(tmp_path, "--cfg", "job", DEVICE="cuda").stdout)
    expected = importlib.util.find_spec("flash_attn") is None
    assert default["actor_rollout_ref"]["model"]["use_fused_kernels"] is expected
    assert default["actor_rollout_ref"]["model"]["fused_kernel_options"]["impl_backend"] == "torch"
    off = yaml.safe_load(_run_stock(tmp_path, "--cfg", "job", DEVICE="cuda", FUSED_KERNELS="false").stdout)
    assert off["actor_rollout_ref"]["model"]["use_fused_kernels"] is False
    proc = _run_stock(tmp_path, "--cfg", "job", DEVICE="cuda", FUSED_KERNELS="yes")
    assert proc.returncode == 2
    assert "FUSED_KERNELS: expected auto, true or false, got 'yes'" in proc.stderr


_FUSED_CHECK = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from verl.models.transformers.monkey_patch import apply_monkey_patch

torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, attn_implementation="sdpa")
model = LlamaForCausalLM(config)
ids = torch.randint(0, 300, (3, 20))
mask = torch.ones_like(ids)
mask[0, :5] = 0  # a left-padded prompt
positions = (mask.cumsum(-1) - 1).clamp(min=0)
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
plain = torch.log_softmax(logits, -1).gather(-1, torch.roll(ids, -1, -1).unsqueeze(-1)).squeeze(-1)
apply_monkey_patch(model, use_remove_padding=False, ulysses_sp_size=1, use_fused_kernels=True,
                   fused_kernels_backend="torch")
out = model(input_ids=ids, attention_mask=mask, position_ids=positions, temperature=1.0, return_dict=True)
torch.testing.assert_close(out.log_probs.detach(), plain, rtol=1e-5, atol=1e-5)
out.log_probs[mask.bool()].sum().backward()
assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
print("FUSED_OK")
"""


def test_verls_fused_log_prob_path_computes_the_plain_log_probs():
    """What the stock recipe switches on (``use_fused_kernels``, torch backend) is the same quantity as the plain
    log-softmax of the logits, so both backends learn from the same log-probs: a small Llama with verl's own patch,
    a padded row included, gradients flowing. In a subprocess: verl patches the model class's ``forward``."""
    proc = subprocess.run([sys.executable, "-c", _FUSED_CHECK], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "FUSED_OK" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
def test_kv_cache_sized_to_the_batch_is_the_same_on_both_sides(tmp_path):
    """KV_CACHE_BYTES=batch gives stock's vLLM and the remote sampler one cache that holds a step's 16 x 8
    sequences of 256 + 128 tokens: 128 x (24 + 1) blocks of 16 tokens, 30 layers x K and V x 3 heads x 64 x 2 bytes;
    KV_CACHE_BYTES=shared the same batch with each prompt's blocks once."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(SMOLLM2_ATTENTION))
    expected = 128 * 25 * 16 * (30 * 2 * 3 * 64 * 2)
    assert expected == 1_179_648_000
    # shared: 16 prompts x 16 blocks, each sample its 8 response blocks + 1, vLLM's null block
    expected_shared = (16 * 16 + 128 * 9 + 1) * 16 * (30 * 2 * 3 * 64 * 2)
    for knob, bytes_ in (("batch", expected), ("shared", expected_shared)):
        knobs = {"KV_CACHE_BYTES": knob, "BATCH": "16", "N": "8"}
        for side in SCRIPTS:
            cfg = compose(side, tmp_path, env_extra=knobs)
            rollout = cfg["actor_rollout_ref"]["rollout"]
            assert rollout["engine_kwargs"]["vllm"]["kv_cache_memory_bytes"] == bytes_, (knob, side)
            assert rollout["max_num_seqs"] == 128 and rollout["max_model_len"] == 384, side
