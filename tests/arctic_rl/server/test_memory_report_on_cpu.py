"""The memory report and ``response_logprobs`` through a real reference server process.

``GET /status`` carries each job's ``memory`` (bytes by part; the GPU-only parts absent on CPU), every
``/forward-backward`` answer all jobs' parts as ``memory/<job type>/<part>_gib``, and ``/forward`` with
``meta.response_logprobs_only`` answers the response tokens' values of the full answer, zeros elsewhere.
"""

from __future__ import annotations

import pytest
import requests
import torch

from tests.support.server import decode, make_batch, post_frame

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
RESPONSES = [[20, 21, 22], [23, 24, 25, 26], [27]]


def _initialize(srv, model_dir, job_type: str) -> int:
    config = {"model_name": str(model_dir), "job_type": job_type, "checkpoint_path": "train",
              "ds_config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}}
    return decode(requests.post(srv.url + "/initialize", json=config, timeout=300))["job_id"]


def test_status_and_metrics_carry_each_jobs_memory(reference_server, tiny_model_dir):
    srv = reference_server
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # fp32 on CPU
    jobs = {job_type: _initialize(srv, tiny_model_dir, job_type) for job_type in ("training", "log_prob")}
    try:
        batch = make_batch(PROMPTS, RESPONSES)
        g = torch.Generator().manual_seed(0)
        batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g) * batch["response_mask"]
        batch["old_log_probs"] = torch.full(batch["input_ids"].shape, -4.0)
        body = {"batch": batch, "meta": {}, "processing": {"loss_fn": "grpo", "config": {}}}
        metrics = decode(post_frame(srv, f"/forward-backward?job_id={jobs['training']}", body))["metrics"]
        assert metrics["memory/training/weights_gib"] == pytest.approx(param_bytes / 2**30, abs=1e-6)
        assert metrics["memory/training/gradients_gib"] == pytest.approx(param_bytes / 2**30, abs=1e-6)
        assert metrics["memory/log_prob/weights_gib"] == pytest.approx(param_bytes / 2**30, abs=1e-6)
        assert not any(name.startswith("memory/") and "device_" in name for name in metrics)  # CPU: absent
        decode(requests.post(f"{srv.url}/step?job_id={jobs['training']}", timeout=60))
        status = decode(requests.get(srv.url + "/status", timeout=30))["jobs"]
        train = status[str(jobs["training"])]["memory"]
        assert train["weights"] == param_bytes and train["optimizer_state"] >= 2 * param_bytes
        assert status[str(jobs["log_prob"])]["memory"]["weights"] == param_bytes

        # /forward: the response tokens' values only, equal to the full answer's there
        fwd = {"batch": make_batch(PROMPTS, RESPONSES), "meta": {"calculate_entropy": True}, "processing": {}}
        full = decode(post_frame(srv, f"/forward?job_id={jobs['log_prob']}", fwd))["batch"]
        fwd["meta"]["response_logprobs_only"] = True
        part = decode(post_frame(srv, f"/forward?job_id={jobs['log_prob']}", fwd))["batch"]
        p = batch["prompts"].shape[1]
        cols = slice(p - 1, batch["input_ids"].shape[1] - 1)  # shifted: column c predicts token c+1
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(part[key][:, cols], full[key][:, cols], rtol=1e-5, atol=1e-6)
            assert not part[key][:, : p - 1].any() and full[key][:, : p - 1].any()
    finally:
        for job_type, job_id in jobs.items():
            requests.post(f"{srv.url}/destroy?job_id={job_id}", json={"job_type": job_type}, timeout=60)
