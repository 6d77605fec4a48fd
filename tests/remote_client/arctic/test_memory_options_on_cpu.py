"""The memory options of the Arctic adapter reach the jobs in the form each server expects, and the servers'
memory report reaches verl's metrics.

``remote_backend.train.deepspeed.offload_optimizer`` / ``offload_param`` / ``zero_stage: 3`` and
activation checkpointing (``remote_backend.train.gradient_checkpointing``, else verl's
``actor_rollout_ref.model.enable_gradient_checkpointing``) are checked in our job configs and in what the
vendor's own code (Arctic-Platform's ``DeepSpeedWorker`` and ``ModelSpec``, run in a subprocess) makes of
them. ``response_logprobs_only`` is asked of servers listing ``response_logprobs`` only.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from arctic_rl.protocol import JobType
from tests.support.arctic import verl_main_config
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
from verl.workers.remote_client.arctic.builders import build_job_config, build_meta
from verl.workers.remote_client.arctic.metrics import mini_batch_metrics
from verl.workers.remote_client.common.verl_settings import VerlSettings

BASE = {
    "data": {"train_batch_size": 8, "max_prompt_length": 64, "max_response_length": 32},
    "trainer": {"default_local_dir": "checkpoints/proj/exp"},
    "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 4}},
}


def _configs(verl_gc: bool = False, arctic: dict | None = None) -> tuple[VerlSettings, ArcticConfig]:
    from omegaconf import OmegaConf

    overrides = {**BASE, "actor_rollout_ref": {**BASE["actor_rollout_ref"],
                                               "model": {"enable_gradient_checkpointing": verl_gc}}}
    cfg = verl_main_config(overrides)
    if arctic:
        cfg.remote_backend = OmegaConf.merge(cfg.remote_backend, OmegaConf.create(arctic))
    return VerlSettings.from_main_config(cfg), ArcticConfig.from_main_config(cfg)


@pytest.mark.parametrize(
    "verl_gc, ours, sent",
    [(False, None, False), (True, None, True), (True, False, False), (False, True, True)],
)
def test_gradient_checkpointing_follows_verl_unless_set(verl_gc, ours, sent):
    verl, arctic = _configs(verl_gc, {"train": {"gradient_checkpointing": ours}})
    for job in (JobType.TRAINING, JobType.LOG_PROB):
        assert build_job_config(job, verl, arctic)["ds_worker_config"]["enable_gradient_checkpointing"] is sent


def test_gradient_checkpointing_must_be_a_bool_or_null():
    with pytest.raises(RemoteBackendConfigError, match=r"remote_backend\.train\.gradient_checkpointing"):
        _configs(False, {"train": {"gradient_checkpointing": "yes"}})


OFFLOAD = {"train": {"deepspeed": {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}}}


def test_offload_and_stage_3_reach_both_jobs_configs():
    verl, arctic = _configs(False, OFFLOAD)
    train = build_job_config(JobType.TRAINING, verl, arctic)
    zero = train["ds_config"]["zero_optimization"]
    assert zero == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    log_prob = build_job_config(JobType.LOG_PROB, verl, arctic)
    assert log_prob["log_prob_config"]["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert log_prob["ds_config"] == log_prob["log_prob_config"]
    off = build_job_config(JobType.TRAINING, *_configs(False, {"train": {"deepspeed": {"zero_stage": 2}}}))
    assert off["ds_config"]["zero_optimization"] == {"stage": 2}
    with pytest.raises(RemoteBackendConfigError, match=r"offload_param"):
        _configs(False, {"train": {"deepspeed": {"zero_stage": 2, "offload_param": True}}})


_VENDOR_PROBE = r"""
import json, sys
sys.path[:0] = sys.argv[1:3]
jobs = json.loads(sys.stdin.read())
from arctic_platform.common.deepspeed_worker import DeepSpeedWorker
from arctic_platform.model.config import ModelSpec
worker = DeepSpeedWorker.__ray_actor_class__  # the class under @ray.remote; its config builders use no state
train, log_prob = jobs["training"], jobs["log_prob"]
out = {
    "train_ds": worker.ds_training_config(None, train, dict(train["ds_config"]), dict(train["ds_worker_config"])),
    "log_prob_ds": worker.ds_inference_config(None, log_prob["log_prob_config"], dict(log_prob["ds_worker_config"])),
    "train_gc": ModelSpec.from_ds_worker_config("m", train["ds_worker_config"]).patches.gradient_checkpointing,
}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_the_vendors_worker_takes_the_options_as_sent(vendor_kit, vendor_src):
    """The vendor's ``DeepSpeedWorker`` passes ``ds_config``'s ZeRO section to DeepSpeed as is (offload included),
    keeps ``offload_param`` for its forward-only job, and turns ``enable_gradient_checkpointing`` into its
    model's patch (its own default is on: the adapter always sends the key)."""
    verl, arctic = _configs(False, {"train": {**OFFLOAD["train"], "gradient_checkpointing": True}})
    jobs = {job.value: build_job_config(job, verl, arctic) for job in (JobType.TRAINING, JobType.LOG_PROB)}
    stubs = vendor_kit / "arctic-inference-stubs"
    proc = subprocess.run([sys.executable, "-c", _VENDOR_PROBE, str(vendor_src), str(stubs)], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["train_ds"]["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "cpu"}}
    assert got["log_prob_ds"]["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert got["train_gc"] is True
    no_gc = build_job_config(JobType.TRAINING, *_configs(True, {"train": {"gradient_checkpointing": False}}))
    assert no_gc["ds_worker_config"]["enable_gradient_checkpointing"] is False  # sent explicitly: the vendor's default is on


def test_response_logprobs_only_is_sent_only_when_asked():
    verl, arctic = _configs()
    common = {"max_prompt_len": 8, "max_response_len": 4, "temperature": 1.0, "calculate_entropy": False,
              "pad_token_id": 0}
    assert "response_logprobs_only" not in build_meta(verl, arctic, **common)
    assert build_meta(verl, arctic, **common, response_logprobs_only=True)["response_logprobs_only"] is True


def test_server_memory_report_reaches_verls_metrics():
    call = {"loss": 0.5, "memory/training/weights_gib": 0.25, "memory/log_prob/weights_gib": 0.125,
            "memory/training/device_max_allocated_gib": 3.0, "memorable": 1.0}
    out = mini_batch_metrics(call, {"grad_norm": 1.0}, kl_coef=None)
    assert out["arctic/memory/training/weights_gib"] == 0.25  # verl shows it as actor/arctic/memory/...
    assert out["arctic/memory/log_prob/weights_gib"] == 0.125
    assert out["arctic/memory/training/device_max_allocated_gib"] == 3.0
    assert "memorable" not in out and "arctic/memorable" not in out
