"""Config, builders and metrics of the Arctic adapter (pure functions: golden dicts).

Covers ``verl/trainer/config/remote_backend/arctic.yaml`` <-> ``arctic_config.ArcticConfig`` (1:1,
comments, validation errors), ``builders`` (ds_config, ds_worker_config, JobConfig, loss config, meta) and
``metrics`` (verl metric names, MFU). ``VerlSettings`` (shared by both vendors) has its own tests in
``tests/remote_client/common/test_verl_settings_on_cpu.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest
import yaml

import verl.remote_backend.builtin  # noqa: F401  (registers the built-in backends)
from arctic_rl.protocol import DsWorkerConfig, Features, JobConfig, LossConfig
from tests.support.arctic import ARCTIC_YAML, verl_main_config
from verl.remote_backend import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
from verl.workers.remote_client.arctic.builders import (
    build_ds_config,
    build_ds_worker_config,
    build_job_config,
    build_log_prob_ds_config,
    build_meta,
    plan_batches,
)
from verl.workers.remote_client.arctic.loss_config import build_loss_config
from verl.workers.remote_client.arctic.metrics import FlopsEstimator, mini_batch_metrics
from verl.workers.remote_client.common.verl_settings import VerlSettings


def settings(overrides: dict | None = None, arctic: dict | None = None) -> tuple[VerlSettings, ArcticConfig]:
    cfg = verl_main_config(overrides)
    if arctic:
        from omegaconf import OmegaConf

        cfg.remote_backend = OmegaConf.merge(cfg.remote_backend, OmegaConf.create(arctic))
    return VerlSettings.from_main_config(cfg), ArcticConfig.from_main_config(cfg)


def deep(a: dict, b: dict) -> dict:
    """``a`` updated recursively with ``b`` (a copy)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = deep(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


GRPO = {
    "data": {"train_batch_size": 8, "max_prompt_length": 64, "max_response_length": 32},
    "trainer": {"default_local_dir": "checkpoints/proj/exp"},
    "actor_rollout_ref": {
        "rollout": {"n": 2, "temperature": 0.7},
        "actor": {
            "ppo_mini_batch_size": 4,
            "ppo_micro_batch_size_per_gpu": 2,
            "ppo_epochs": 2,
            "ppo_max_token_len_per_gpu": 4096,
            "optim": {"lr": 3e-6, "betas": [0.9, 0.95], "weight_decay": 0.1},
            "use_kl_loss": True,
            "kl_loss_coef": 0.001,
            "kl_loss_type": "k3",
        },
    },
}
ARCTIC = {"train": {"num_devices": 2, "deepspeed": {"zero_stage": 2, "offload_optimizer": True, "bf16": True}}}


# ------------------------------------------------------------------------------ yaml <-> dataclasses


def _keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        out.add(prefix + key)
        if isinstance(value, dict) and value and key not in ("extra", "vllm_config"):
            out |= _keys(value, f"{prefix}{key}.")
    return out


def test_shipped_yaml_mirrors_the_dataclasses_one_to_one():
    raw = yaml.safe_load(ARCTIC_YAML.read_text())
    cfg = ArcticConfig.from_dict(raw)
    assert cfg == ArcticConfig()  # the yaml's values are the dataclass defaults
    assert _keys(raw) == _keys(dataclasses.asdict(ArcticConfig()))


def test_every_yaml_key_has_a_comment_line_above_it():
    lines = ARCTIC_YAML.read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z_][A-Za-z0-9_]*:", line):
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            if not above.startswith("#"):
                missing.append(line.strip())
    assert missing == []
    checked = [ln for ln in lines if re.match(r"^\s*[A-Za-z_]\w*:", ln)]
    assert len(checked) == len(_keys(yaml.safe_load(ARCTIC_YAML.read_text())))  # every key was looked at


@pytest.mark.parametrize(
    "override, key, allowed, received",
    [
        ({"train": {"zoro_train": {}}}, "remote_backend.train.zoro_train", None, "zoro_train"),
        ({"server": {"protocol": "v3"}}, "remote_backend.server.protocol", ["auto", "v1", "v2"], "v3"),
        ({"server": {"url": "localhost:7000"}}, "remote_backend.server.url", None, "localhost:7000"),
        ({"train": {"num_devices": "2"}}, "remote_backend.train.num_devices", "an integer", "2"),
        ({"train": {"logits": {"optimization": "memory"}}}, "remote_backend.train.logits.optimization", None, "memory"),
        ({"train": {"logits": {"optimization": "fast"}}}, "remote_backend.train.logits.optimization",
         ["none", "memory", "compute"], "fast"),
        ({"train": {"deepspeed": {"offload_param": True}}}, "remote_backend.train.deepspeed.offload_param", None, True),
        ({"train": {"deepspeed": {"zero_stage": 4}}}, "remote_backend.train.deepspeed.zero_stage", [0, 1, 2, 3], 4),
        ({"retry": {"max_attempts": 0}}, "remote_backend.retry.max_attempts", ">= 1", 0),
        ({"timeouts": {"step_s": -1}}, "remote_backend.timeouts.step_s", "> 0 seconds", -1.0),
        ({"server": {"reclaim_idle_jobs_s": 0}}, "remote_backend.server.reclaim_idle_jobs_s", "> 0 seconds or null",
         0.0),
        ({"rollout": {"max_in_flight": 0}}, "remote_backend.rollout.max_in_flight", ">= 1", 0),
        ({"server": {"concurrent_jobs": "auto"}}, "remote_backend.server.concurrent_jobs", None, "auto"),
        ({"weight_sync": {"low_memory": True}}, "remote_backend.weight_sync.low_memory", None, True),
        ({"train": {"zorro_train": {"enable": "yes"}}}, "remote_backend.train.zorro_train.enable", "true or false",
         "yes"),
    ],
)
def test_validation_names_the_dotted_key_allowed_and_received(override, key, allowed, received):
    raw = yaml.safe_load(ARCTIC_YAML.read_text())

    def merge(a, b):
        for k, v in b.items():
            a[k] = merge(dict(a.get(k) or {}), v) if isinstance(v, dict) and v else v
        return a

    with pytest.raises(RemoteBackendConfigError) as err:
        ArcticConfig.from_dict(merge(raw, override))
    e = err.value
    assert e.field == key and e.received == received and key in str(e)
    if allowed is not None:
        assert e.allowed == allowed
    if key.endswith("zoro_train"):
        assert "zorro_train" in e.allowed


def test_missing_section_and_token_never_printed():
    with pytest.raises(RemoteBackendConfigError, match="remote_backend=arctic"):
        ArcticConfig.from_main_config({"data": {}})
    cfg = ArcticConfig.from_dict({"server": {"token": "s3cret", "url": "http://h:1"}})
    assert "s3cret" not in repr(cfg) and "s3cret" not in str(cfg.server)


# ------------------------------------------------------------------------------ verl settings


@pytest.mark.parametrize(
    "actor, expected",
    [({}, 1.0), ({"grad_clip": 0.5}, 0.5), ({"optim": {"clip_grad": 0.3}}, 0.3),
     ({"grad_clip": 0.5, "optim": {"clip_grad": 0.5}}, 0.5)],
)
def test_gradient_clipping_from_either_verl_field(actor, expected):
    v, a = settings({"actor_rollout_ref": {"actor": actor}})
    assert v.optim.clip_grad == expected
    assert build_ds_config(v, a)["gradient_clipping"] == expected


# ------------------------------------------------------------------------------ builders


def test_ds_config_golden():
    v, a = settings(GRPO, ARCTIC)
    assert build_ds_config(v, a) == {
        "train_batch_size": 8,  # ppo_mini_batch_size 4 x rollout.n 2: rows per /step
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,  # 8 rows / (2 per device x 2 devices) = /forward-backward calls per /step
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-6, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    plan = plan_batches(v, a)
    assert (plan.micro_batch_rows, plan.gradient_accumulation_steps, plan.steps_per_global_step) == (4, 2, 4)


def test_ds_config_extra_is_merged_recursively_and_wins():
    v, a = settings(GRPO, {"train": {"deepspeed": {"zero_stage": 3, "offload_param": True, "extra": {
        "zero_optimization": {"stage3_max_live_parameters": 1000}, "steps_per_print": 100}}}})
    ds = build_ds_config(v, a)
    assert ds["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_max_live_parameters": 1000}
    assert ds["steps_per_print"] == 100
    assert build_log_prob_ds_config(a) == {
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_max_live_parameters": 1000},
        "steps_per_print": 100,
    }


def test_micro_batch_defaults_to_one_call_per_step():
    v, a = settings(deep(GRPO, {"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": None}}}))
    ds = build_ds_config(v, a)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 1)
    v, a = settings(GRPO, {"train": {"micro_batch_size": 4}})  # the arctic key wins over verl's
    assert build_ds_config(v, a)["gradient_accumulation_steps"] == 2


def test_micro_batch_that_does_not_divide_the_mini_batch_is_an_error():
    v, a = settings(GRPO, {"train": {"micro_batch_size": 3}})
    with pytest.raises(RemoteBackendConfigError) as err:
        build_ds_config(v, a)
    assert err.value.field == "remote_backend.train.micro_batch_size" and err.value.received == 3
    v, a = settings(deep(GRPO, {"data": {"train_batch_size": 6}}))
    with pytest.raises(RemoteBackendConfigError, match="data.train_batch_size"):
        build_ds_config(v, a)


@pytest.mark.parametrize(
    "optim, total, scheduler",
    [
        ({}, None, None),
        ({"lr_warmup_steps": 3}, None, {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 3e-6, "warmup_num_steps": 12, "warmup_type": "linear"}}),
        ({"lr_warmup_steps_ratio": 0.1, "total_training_steps": 50}, None, {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 3e-6, "warmup_num_steps": 20, "warmup_type": "linear"}}),
        ({"lr_scheduler_type": "cosine", "lr_warmup_steps_ratio": 0.1, "min_lr_ratio": 0.1}, 50, {
            "type": "WarmupCosineLR", "params": {"total_num_steps": 200, "warmup_num_steps": 20,
                                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1,
                                                 "warmup_type": "linear"}}),
        ({"lr_scheduler_type": "cosine", "total_training_steps": 10}, None, {
            "type": "WarmupCosineLR", "params": {"total_num_steps": 40, "warmup_num_steps": 1,
                                                 "warmup_min_ratio": 1.0, "cos_min_ratio": 0.0,
                                                 "warmup_type": "linear"}}),
    ],
)
def test_lr_schedule_in_optimizer_steps(optim, total, scheduler):
    """verl steps its scheduler once per training step; DeepSpeed once per /step: x (epochs 2 x 2 mini-batches)."""
    overrides = deep(GRPO, {"actor_rollout_ref": {"actor": {"optim": optim}}})
    if total is not None:
        overrides = deep(overrides, {"trainer": {"total_training_steps": total}})
    v, a = settings(overrides)
    assert build_ds_config(v, a).get("scheduler") == scheduler


@pytest.mark.parametrize(
    "optim, field",
    [({"lr_scheduler_type": "cosine"}, "actor_rollout_ref.actor.optim.total_training_steps"),
     ({"lr_warmup_steps_ratio": 0.1}, "actor_rollout_ref.actor.optim.total_training_steps"),
     ({"lr_scheduler_type": "cosine", "total_training_steps": 5, "num_cycles": 1.0}, "actor_rollout_ref.actor.optim.num_cycles")],
)
def test_lr_schedule_errors(optim, field):
    v, a = settings({"actor_rollout_ref": {"actor": {"optim": optim}}})
    with pytest.raises(RemoteBackendConfigError) as err:
        build_ds_config(v, a)
    assert err.value.field == field


def test_ds_worker_config_golden_zorro_on_and_off():
    v, a = settings(GRPO, {"train": {"zorro_train": {"enable": True, "load_balancer": "greedy"},
                                     "logits": {"optimization": "memory", "peak_mem_size_in_gib": 2,
                                                "compute_in_fp32": True}}})
    assert build_ds_worker_config(v, a) == {
        "attn_implementation": "flash_attention_2",  # auto: the vendor packs rows; flash attention keeps them apart
        "zorro_train_enable": True,
        "response_len": 32,
        "max_token_len": 4096,
        "rollout_n": 2,
        "temperature": 0.7,
        "logits_optimization": "memory",
        "logits_optimization_peak_mem_size_in_gib": 2,
        "logits_compute_in_fp32": True,
        "use_liger": False,
        "enable_gradient_checkpointing": True,
        "use_unpad": True,
        "zorro_train_load_balancer": "greedy",
    }
    v, a = settings(GRPO, {"train": {"attn_implementation": "sdpa"}})
    off = build_ds_worker_config(v, a)
    assert off["zorro_train_enable"] is False and "zorro_train_load_balancer" not in off
    assert off["attn_implementation"] == "sdpa" and off["logits_optimization"] == "none"
    assert "logits_compute_from_fp32_inputs" not in off  # deliberately not exposed
    v, a = settings(GRPO)
    assert build_ds_worker_config(v, a)["attn_implementation"] == "flash_attention_2"  # auto: always sent
    assert DsWorkerConfig.model_validate(build_job_config("log_prob", v, a)["ds_worker_config"]).attn_implementation


def test_default_deepspeed_stages_are_accepted_by_the_vendors_engines():
    """bf16 + fp32 gradient accumulation (the vendor's training default) needs ZeRO >= 1; the optimizer-less
    log_prob engine refuses stages 1-2."""
    v, a = settings(GRPO)
    assert build_ds_config(v, a)["zero_optimization"]["stage"] == 1
    assert build_log_prob_ds_config(a)["zero_optimization"] == {"stage": 0}
    v, a = settings(GRPO, {"train": {"deepspeed": {"zero_stage": 3}}})
    assert build_log_prob_ds_config(a)["zero_optimization"] == {"stage": 3}
    with pytest.raises(RemoteBackendConfigError) as err:
        settings(GRPO, {"train": {"deepspeed": {"zero_stage": 0}}})
    assert err.value.field == "remote_backend.train.deepspeed.zero_stage" and err.value.received == 0
    v, a = settings(GRPO, {"train": {"deepspeed": {"zero_stage": 0, "bf16": False}}})
    assert build_ds_config(v, a)["zero_optimization"]["stage"] == 0
    with pytest.raises(RemoteBackendConfigError) as err:
        settings(GRPO, {"train": {"attn_implementation": "flash"}})
    assert err.value.field == "remote_backend.train.attn_implementation" and "sdpa" in str(err.value.allowed)


def test_logits_knobs_reach_ds_worker_config_and_meta():
    """The server reads them only from ds_worker_config: meta copies alone would silently do nothing."""
    v, a = settings(GRPO, {"train": {"logits": {"optimization": "compute", "compute_in_fp32": True}}})
    worker = build_ds_worker_config(v, a)
    meta = build_meta(v, a, max_prompt_len=5, max_response_len=32, temperature=0.7, calculate_entropy=False,
                      pad_token_id=0)
    for cfg in (worker, meta):
        assert cfg["logits_optimization"] == "compute" and cfg["logits_compute_in_fp32"] is True
        assert cfg["logits_optimization_peak_mem_size_in_gib"] == 4
    assert build_job_config("training", v, a)["ds_worker_config"]["logits_optimization"] == "compute"
    assert build_job_config("log_prob", v, a)["ds_worker_config"]["logits_compute_in_fp32"] is True


def test_job_configs_golden():
    v, a = settings(GRPO, ARCTIC)
    training = build_job_config("training", v, a)
    assert JobConfig.model_validate(training).model_dump(mode="json") == training
    assert {k: training[k] for k in ("model_name", "job_type", "num_devices", "checkpoint_path", "seed",
                                     "full_determinism", "cuda_ipc", "low_memory")} == {
        "model_name": "/models/tiny", "job_type": "training", "num_devices": 2,
        "checkpoint_path": "checkpoints/proj/exp", "seed": 42, "full_determinism": False,
        "cuda_ipc": False, "low_memory": False}
    assert training["ds_config"] == build_ds_config(v, a)
    assert training["ds_worker_config"] == build_ds_worker_config(v, a)
    log_prob = build_job_config("log_prob", v, a)
    assert log_prob["job_type"] == "log_prob" and log_prob["num_devices"] == 1
    assert log_prob["ds_config"] == log_prob["log_prob_config"] == build_log_prob_ds_config(a)
    assert "optimizer" not in log_prob["ds_config"]
    v, a = settings(GRPO, {"rollout": {"num_devices": 4, "vllm_config": {"gpu_memory_utilization": 0.5}},
                           "train": {"seed": 7, "checkpoint_path": "/ckpt/run"}})
    sampling = build_job_config("sampling", v, a)
    # verl's own rollout engine defaults, remote_backend.rollout.vllm_config on top
    assert sampling["vllm_config"] == {"max_model_len": 96, "gpu_memory_utilization": 0.5, "max_num_seqs": 256,
                                       "max_num_batched_tokens": 8192, "enforce_eager": False,
                                       "enable_chunked_prefill": True, "enable_prefix_caching": True}
    assert (sampling["num_devices"], sampling["seed"], sampling["ds_config"]) == (4, 7, None)
    assert build_job_config("training", v, a)["checkpoint_path"] == "/ckpt/run"


def test_batch_shape_goes_to_a_server_listing_the_feature_only():
    """The sizes verl sends (warm-up hint): prompts <= 64 tokens, responses <= 32, a /forward of 8 x 2 rows, a
    /forward-backward per mini-batch of 4 x 2 rows; the vendor's server (no features) never sees the key."""
    v, a = settings(GRPO, ARCTIC)
    expected = {"prompt_len": 64, "response_len": 32, "forward_rows": 16, "forward_backward_rows": 8}
    for job in ("training", "log_prob"):
        body = build_job_config(job, v, a, features=frozenset({Features.BATCH_SHAPE}))
        assert body["ds_worker_config"]["batch_shape"] == expected
        assert JobConfig.model_validate(body).ds_worker_config.batch_shape.forward_rows == 16
        without = build_job_config(job, v, a, features=frozenset({Features.N_SAMPLES}))
        assert "batch_shape" not in without["ds_worker_config"] and without == build_job_config(job, v, a)
    sampling = build_job_config("sampling", v, a, features=frozenset({Features.BATCH_SHAPE}))
    assert sampling == build_job_config("sampling", v, a)


def test_the_sampling_job_gets_verls_rollout_engine_options():
    """Stock verl sizes its vLLM from ``rollout.*`` (then ``rollout.engine_kwargs.vllm``), and so does the
    vendor's own verl integration its sampler: those keys reach the sampling job's ``vllm_config`` instead of
    being dropped; ``remote_backend.rollout.vllm_config`` wins key by key; a null is left to the engine."""
    rollout = {"gpu_memory_utilization": 0.3, "max_num_seqs": 512, "max_num_batched_tokens": 4096,
               "enforce_eager": True, "enable_chunked_prefill": False, "enable_prefix_caching": False,
               "max_model_len": 200, "quantization": "fp8",
               "engine_kwargs": {"vllm": {"kv_cache_memory_bytes": 1 << 30, "max_num_seqs": 384, "swap_space": None}}}
    v, a = settings(deep(GRPO, {"actor_rollout_ref": {"rollout": rollout}}),
                    {"rollout": {"vllm_config": {"enforce_eager": False}}})
    assert build_job_config("sampling", v, a)["vllm_config"] == {
        "max_model_len": 200, "gpu_memory_utilization": 0.3, "max_num_seqs": 384, "max_num_batched_tokens": 4096,
        "enforce_eager": False, "enable_chunked_prefill": False, "enable_prefix_caching": False,
        "quantization": "fp8", "kv_cache_memory_bytes": 1 << 30}
    # the reference server takes every one of them (a key it cannot use would be a 400 naming it)
    from arctic_rl.server.engines.vllm_options import engine_options

    assert engine_options(build_job_config("sampling", v, a)["vllm_config"])["max_num_seqs"] == 384


def test_a_rollout_engine_kwargs_that_is_not_a_mapping_names_the_key():
    with pytest.raises(RemoteBackendConfigError, match=r"rollout\.engine_kwargs\.vllm.*received: 3"):
        settings(deep(GRPO, {"actor_rollout_ref": {"rollout": {"engine_kwargs": {"vllm": 3}}}}))


def test_loss_config_from_the_actor_config():
    v, _ = settings(GRPO)
    loss = build_loss_config(v, loss_scale_tokens=123.0)
    assert loss == LossConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                              loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.001,
                              kl_loss_type="low_var_kl", entropy_coeff=0.0, loss_scale_tokens=123.0)


@pytest.mark.parametrize(
    "actor, field",
    [({"policy_loss": {"loss_mode": "sapo"}}, "actor_rollout_ref.actor.policy_loss.loss_mode"),
     ({"kl_loss_type": "k4"}, "actor_rollout_ref.actor.kl_loss_type"),
     ({"clip_ratio_c": 0.5}, "actor_rollout_ref.actor.clip_ratio_c")],
)
def test_loss_config_errors_name_the_verl_field(actor, field):
    v, _ = settings({"actor_rollout_ref": {"actor": actor}})
    with pytest.raises(RemoteBackendConfigError) as err:
        build_loss_config(v, loss_scale_tokens=None)
    assert err.value.field == field


def test_meta_golden():
    v, a = settings(GRPO, {"train": {"zorro_train": {"enable": True}}})
    loss = build_loss_config(v, loss_scale_tokens=40.0)
    meta = build_meta(v, a, max_prompt_len=11, max_response_len=32, temperature=0.7, calculate_entropy=True,
                      pad_token_id=3, global_batch_size=8, batch_num_tokens=40.0, loss=loss)
    assert meta == {
        "zorro_train_enable": True, "rollout_n": 2, "max_prompt_len": 11, "max_response_len": 32,
        "max_token_len_per_gpu": 4096, "temperature": 0.7, "calculate_entropy": True, "pad_token_id": 3,
        "load_balancer": None, "logits_optimization": "none", "logits_optimization_peak_mem_size_in_gib": 4,
        "logits_compute_in_fp32": False, "global_batch_size": 8, "batch_num_tokens": 40.0,
        # the loss's values travel in processing.config and, for the vendor's verl_grpo, in actor_config;
        # policy_loss_config carries the one key the vendor's loss reads there
        "policy_loss_config": {"loss_mode": "vanilla"},
        "actor_config": {"ppo_mini_batch_size": 4, "ppo_epochs": 2, "rollout_n": 2, "clip_ratio": 0.2,
                         "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                         "loss_agg_mode": "token-mean", "use_kl_loss": True, "kl_loss_coef": 0.001,
                         "kl_loss_type": "low_var_kl", "entropy_coeff": 0.0},
    }


# ------------------------------------------------------------------------------ metrics and registry


def test_mini_batch_metrics_are_the_calls_token_means_under_verls_names():
    """One /forward-backward per mini-batch: its token means are the mini-batch's, never added up."""
    ours = {"actor/pg_loss": 0.25, "actor/pg_clipfrac": 0.1, "actor/ppo_kl": [0.03, 0.05], "actor/entropy_loss": 2.0,
            "kl_loss": 0.5, "kl_coef": 0.001, "loss": 0.3, "tokens_computed": 40.0, "seconds": 1.0,
            "actor/pg_clipfrac_lower": 0.0, "micro_batches": 2.0, "passes": 1.0, "zorro_applied": 0.0,
            "zorro_token_saving": 0.25}
    step = {"last_lr": 1e-6, "grad_norm": 0.9, "global_step": 3}
    assert mini_batch_metrics(ours, step, kl_coef=0.001) == pytest.approx({
        "actor/pg_loss": 0.25, "actor/pg_clipfrac": 0.1, "actor/pg_clipfrac_lower": 0.0, "actor/ppo_kl": 0.04,
        "actor/entropy_loss": 2.0, "kl_loss": 0.5, "kl_coef": 0.001, "loss": 0.3, "arctic/tokens_computed": 40.0,
        "arctic/zorro_applied": 0.0, "arctic/zorro_token_saving": 0.25, "arctic/passes": 1.0, "grad_norm": 0.9,
        "lr": 1e-6})
    # already collapsed, and a .sum/.tokens pair left uncollapsed
    vendor = {"actor/pg_loss": 0.41, "actor/pg_clipfrac": 0.0, "loss": 0.41, "kl_loss.sum": 3.0, "kl_loss.tokens": 12.0}
    got = mini_batch_metrics(vendor, {"last_lr": 1e-6}, kl_coef=None)
    assert got == pytest.approx({"actor/pg_loss": 0.41, "actor/pg_clipfrac": 0.0, "loss": 0.41, "kl_loss": 0.25,
                                 "lr": 1e-6})


def test_mfu_from_the_parameter_count(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    est = FlopsEstimator(str(tiny_model_dir), peak_tflops_per_device=1e-6)
    assert est.num_params == real
    assert est.mfu(100, 2.0, devices=1, training=True) == pytest.approx(6 * real * 100 / 2.0 / 1e6)
    assert est.mfu(100, 2.0, devices=2, training=False) == pytest.approx(2 * real * 100 / 2.0 / 2e6)
    assert FlopsEstimator(str(tiny_model_dir), peak_tflops_per_device=None).mfu(100, 1.0, devices=1,
                                                                                 training=True) == 0.0
    assert FlopsEstimator("/nonexistent", peak_tflops_per_device=1.0).mfu(100, 1.0, devices=1, training=True) == 0.0
    del torch


def test_registered_as_arctic_and_concrete():
    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

    assert RemoteBackendRegistry.get("arctic") is ArcticRLClient
    assert issubclass(ArcticRLClient, RemoteBackend) and not inspect.isabstract(ArcticRLClient)
    assert "arctic" in RemoteBackendRegistry.list()


def test_reconnect_handle_validation():
    from verl.workers.remote_client.arctic.jobs import check_handle

    good = {"backend": "arctic", "handle_version": 1, "url": "http://10.0.0.5:7000", "protocol": 2,
            "job_ids": {"sampling": 1, "log_prob": 2, "training": 3}, "step": 4, "instance_id": "abc"}
    assert check_handle(json.loads(json.dumps(good))) == good
    for bad, field in [
        ([good], "handle"),
        ({**good, "handle_version": 2}, "handle.handle_version"),
        ({**good, "step": "4"}, "handle.step"),
        ({**good, "protocol": True}, "handle.protocol"),
        ({k: v for k, v in good.items() if k != "url"}, "handle.url"),
        ({**good, "job_ids": {"trainer": 3}}, "handle.job_ids"),
    ]:
        with pytest.raises(RemoteBackendConfigError) as err:
            check_handle(bad)
        assert err.value.field == field


# ------------------------------------------------------------------------------ vendor contract helpers


def test_vendor_refusals_are_decided_from_the_features():
    """No 'policy_losses' feature (the vendor's server): vanilla at the vendor's fixed clip values only; with it,
    every served loss mode and any clip values pass. Refusals name the key; the vendor's are told apart."""
    from arctic_rl.protocol import Features
    from verl.workers.remote_client.arctic.loss_config import check_loss_support

    v, _ = settings(GRPO)
    check_loss_support(v, frozenset())  # verl's defaults are the vendor's constants
    for actor, key in [({"clip_ratio_high": 0.28}, "clip_ratio_high"), ({"clip_ratio_c": 10.0}, "clip_ratio_c"),
                       ({"clip_ratio": 0.3}, "clip_ratio"), ({"policy_loss": {"loss_mode": "gspo"}},
                                                              "policy_loss.loss_mode")]:
        v, _ = settings(deep(GRPO, {"actor_rollout_ref": {"actor": actor}}))
        with pytest.raises(RemoteBackendConfigError) as err:
            check_loss_support(v, frozenset())
        assert err.value.field == f"actor_rollout_ref.actor.{key}" and "vendor" in str(err.value)
        check_loss_support(v, frozenset({Features.POLICY_LOSSES}))
    v, _ = settings(deep(GRPO, {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "cispo"}}}}))
    with pytest.raises(RemoteBackendConfigError) as err:  # unserved everywhere, by name
        check_loss_support(v, frozenset({Features.POLICY_LOSSES}))
    assert err.value.field == "actor_rollout_ref.actor.policy_loss.loss_mode" and err.value.received == "cispo"
    assert "sapo" in str(err.value) and err.value.allowed == ["vanilla", "gspo", "bypass_mode"]


@pytest.mark.parametrize(("given", "expected"), [
    (None, {"loss_type": "ppo_clip", "rollout_is": "sequence", "rollout_is_threshold": 2.0}),  # verl's dataclass
    ({"loss_type": "reinforce"}, {"loss_type": "reinforce", "rollout_is": None}),  # a mapping: the loss's .get
    ({"rollout_is": "token", "rollout_is_threshold": "0.5_2.0", "bypass_mode": True, "_target_": "x"},
     {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"}),
])
def test_bypass_mode_rollout_correction_as_verls_loss_reads_it(given, expected):
    actor = {"policy_loss": {"loss_mode": "bypass_mode", **({"rollout_correction": given} if given else {})}}
    v, _ = settings(deep(GRPO, {"actor_rollout_ref": {"actor": actor}}))
    rc = build_loss_config(v, loss_scale_tokens=None).rollout_correction
    assert {k: getattr(rc, k) for k in expected} == expected


@pytest.mark.parametrize(("given", "key"), [
    ({"loss_type": "ppo"}, "loss_type"), ({"rollout_is": "tokens"}, "rollout_is"),
    ({"rollout_rs": "token_k9"}, "rollout_rs"), ({"rollout_is_threshold": "3_1"}, "rollout_is_threshold"),
    ({"rollout_is_treshold": 2.0}, "rollout_is_treshold"),
])
def test_bypass_mode_rollout_correction_errors_name_the_key(given, key):
    actor = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": given}}
    v, _ = settings(deep(GRPO, {"actor_rollout_ref": {"actor": actor}}))
    with pytest.raises(RemoteBackendConfigError) as err:
        build_loss_config(v, loss_scale_tokens=None)
    assert err.value.field == f"actor_rollout_ref.actor.policy_loss.rollout_correction.{key}"


def test_folding_is_weights_into_advantages_is_exact_under_the_clipped_loss():
    """loss(w * A) == w * loss(A) token by token for w >= 0 (clip and dual clip included); negative
    weights are refused naming the field."""
    import torch

    from arctic_rl.protocol import LossConfig
    from arctic_rl.server.compute.losses import ppo_clip_loss
    from arctic_rl.server.compute.token_logprobs import TokenLogprobs
    from verl.workers.remote_client.arctic.layout import fold_is_weights

    g = torch.Generator().manual_seed(0)
    shape = (6, 9)
    logprobs = -torch.rand(shape, generator=g) * 3
    old = logprobs + torch.randn(shape, generator=g) * 1.5  # ratios far outside [0.8, 1.2] (and > 3): clipping happens
    adv = torch.randn(shape, generator=g) * 2
    mask = torch.rand(shape, generator=g) > 0.2
    weights = torch.rand(shape, generator=g) * 3
    weights[0, :4] = 0.0
    out = TokenLogprobs(logprobs, None, 0, 0)
    cfg = LossConfig(loss_scale_tokens=float(mask.sum()))
    weighted, _ = ppo_clip_loss(out, {"response_mask": mask, "old_log_probs": old, "advantages": adv,
                                      "rollout_is_weights": weights}, cfg)
    batch = {"response_mask": mask, "advantages": adv.clone(), "rollout_is_weights": weights}
    fold_is_weights(batch)
    assert "rollout_is_weights" not in batch
    folded, metrics = ppo_clip_loss(out, {"response_mask": mask, "old_log_probs": old,
                                          "advantages": batch["advantages"]}, cfg)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0
    torch.testing.assert_close(folded, weighted, rtol=1e-6, atol=1e-7)
    with pytest.raises(RemoteBackendConfigError) as err:
        fold_is_weights({"response_mask": mask, "advantages": adv, "rollout_is_weights": weights - 1.0})
    assert err.value.field == "data.rollout_is_weights"


def test_rollout_full_determinism_asks_the_sampling_job_to_run_calls_alone():
    v, a = settings({"actor_rollout_ref": {"rollout": {"full_determinism": True}}})
    assert build_job_config("sampling", v, a)["full_determinism"] is True
    assert build_job_config("training", v, a)["full_determinism"] is False  # remote_backend.train.full_determinism's
    v, a = settings()
    assert build_job_config("sampling", v, a)["full_determinism"] is False
