"""The log_prob job honours ``ds_config.zero_optimization``: ZeRO-3 and parameter offload on a tiny real model.

At stage 3 the job runs an inference-only DeepSpeed engine whose parameters are partitions (and, with
``offload_param``, held on the host); its ``/forward`` and ``/log-probs`` answers equal the plain job's, a weight
sync writes every parameter (also from a ZeRO-3 training job in the same process, as the adapter configures
both), its memory report counts the partitions, and what it cannot run is a 400 at job creation naming the key,
the allowed values and what was received.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from arctic_rl.protocol import LOGPROBS_KEY, JobConfig, JobType
from arctic_rl.server.engines.config import build_inference_ds_config
from arctic_rl.server.engines.logprob_engine import LogProbEngine
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.http.validation import parse_batch_body
from arctic_rl.server.settings import ServerSettings
from arctic_rl.tiny_models import build_tiny_model

P, R, ROWS = 5, 4, 4
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every parameter partitioned, however small
OFFLOAD = {**ZERO3, "offload_param": {"device": "cpu"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lp_zero3") / "model", "qwen3", seed=0)


def _engine(model_dir, tmp_path, zero: dict | None) -> LogProbEngine:
    ds = {"zero_optimization": zero} if zero is not None else None
    config = JobConfig(model_name=str(model_dir), job_type=JobType.LOG_PROB, ds_config=ds)
    return LogProbEngine(config, ServerSettings(checkpoint_root=tmp_path / "ck"))


def _forward(engine: Any, **meta) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (ROWS, P + R), generator=g)
    mask = torch.ones_like(ids)
    body = {"batch": {"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :P], "responses": ids[:, P:],
                      "response_mask": mask[:, P:]}, "meta": {"calculate_entropy": True, **meta}}
    result, _, _ = engine.forward(parse_batch_body(body, vocab_size=engine.vocab_size, train=False))
    return result


def _answers(engine: LogProbEngine) -> list[torch.Tensor]:
    shifted, zorro = _forward(engine), _forward(engine, zorro_train_enable=True)
    texts = engine.text_logprobs(["one two three four", "five six seven"])
    return [*shifted.values(), *zorro.values(), texts]


@pytest.fixture(scope="module")
def plain(model_dir, tmp_path_factory):
    engine = _engine(model_dir, tmp_path_factory.mktemp("plain"), None)
    params = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    answers = _answers(engine)
    g = torch.Generator().manual_seed(7)
    synced = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in engine.model.state_dict().items()}
    engine.load_weights(synced)
    answers_after_sync = _answers(engine)
    engine.close()
    return params, answers, synced, answers_after_sync


@pytest.mark.parametrize("zero", [ZERO3, OFFLOAD], ids=["zero3", "offload_param"])
def test_zero3_job_answers_equal_the_plain_jobs(model_dir, tmp_path, plain, zero):
    params, want, synced, want_after_sync = plain
    engine = _engine(model_dir, tmp_path, zero)
    try:
        assert engine.engine.zero_optimization_stage() == 3
        offload = engine.engine.zero_offload_param()
        assert (offload is not None and offload.device == "cpu") == ("offload_param" in zero)
        assert all(p.numel() == 0 for p in engine.model.parameters())  # partitioned between passes
        assert engine.info()["zero_stage"] == 3 and engine.info()["weights_on"] == "cpu"
        param_bytes = sum(p.numel() * p.element_size() for p in params.values())
        assert engine.memory_report() == {"weights": param_bytes}  # the partitions, each byte once
        for got, value in zip(_answers(engine), want, strict=True):
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6)
        engine.load_weights(synced)  # a weight sync writes each partitioned parameter whole
        assert all(p.numel() == 0 for p in engine.model.parameters())
        for got, value in zip(_answers(engine), want_after_sync, strict=True):
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6)
        wrong = {k: (v[:-1] if k.endswith("q_proj.weight") else v) for k, v in synced.items()}
        with pytest.raises(BadRequest, match="q_proj.weight has shape"):
            engine.load_weights(wrong)
    finally:
        engine.close()


def test_weights_synced_from_a_zero3_training_job_give_its_log_probs(model_dir, tmp_path):
    from arctic_rl.server.engines.training import TrainingEngine

    zero = {**OFFLOAD, "offload_optimizer": {"device": "cpu"}}
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}
    settings = ServerSettings(checkpoint_root=tmp_path / "ck")
    trainer = TrainingEngine(JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING, ds_config=ds), settings,
                             tmp_path / "job")
    engine = _engine(model_dir, tmp_path, zero)
    try:
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(3, 90, (ROWS, P + R), generator=g)
        mask = torch.ones_like(ids)
        body = {"batch": {"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :P], "responses": ids[:, P:],
                          "response_mask": mask[:, P:], "advantages": torch.randn(ROWS, R, generator=g),
                          "old_log_probs": torch.full((ROWS, R), -4.0)},
                "meta": {}, "processing": {"loss_fn": "grpo", "config": {}}}
        trainer.forward_backward(parse_batch_body(body, vocab_size=trainer.vocab_size, train=True))
        trainer.step()
        before = _forward(engine)
        engine.load_weights(trainer.weights())
        after, want = _forward(engine), _forward(trainer)
        assert not torch.allclose(after[LOGPROBS_KEY], before[LOGPROBS_KEY])  # the step moved the weights
        for key, value in want.items():
            torch.testing.assert_close(after[key], value, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()
        trainer.close()


def test_below_stage_3_the_job_holds_a_plain_copy():
    for stage in (0, 1, 2):
        config, notes = build_inference_ds_config({"zero_optimization": {"stage": stage}}, bf16=False)
        assert config is None and bool(notes) == (stage > 0)
    config, notes = build_inference_ds_config(None, bf16=True)
    assert config is None and notes == []
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "pin_memory": True}}
    config, notes = build_inference_ds_config({"zero_optimization": zero, "optimizer": {"type": "AdamW"}}, bf16=True)
    assert config["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    assert config["bf16"] == {"enabled": True} and "optimizer" not in config
    assert any("offload_optimizer: ignored" in note for note in notes)


@pytest.mark.parametrize(
    "zero, field, allowed, received",
    [
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "ds_config.zero_optimization.stage", [3], 2),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "ds_config.zero_optimization.offload_param.device",
         ["cpu", "none"], "nvme"),
        ({"stage": 4}, "ds_config.zero_optimization.stage", [0, 1, 2, 3], 4),
        ({"stage": 3, "offload_param": "cpu"}, "ds_config.zero_optimization.offload_param", None, "cpu"),
    ],
)
def test_what_the_job_cannot_run_is_a_400_at_job_creation(tmp_path, zero, field, allowed, received):
    """Refused before any model loads (the model name here does not exist), over HTTP with the JSON detail."""
    from fastapi.testclient import TestClient

    from arctic_rl.server import create_app

    config = {"model_name": str(tmp_path / "no-such-model"), "job_type": "log_prob",
              "ds_config": {"zero_optimization": zero}}
    with TestClient(create_app(ServerSettings(checkpoint_root=str(tmp_path / "ck")))) as client:
        response = client.post("/initialize", json=config)
        jobs = client.get("/status").json()["jobs"]
    assert response.status_code == 400, response.text
    detail = response.json()["detail"]
    assert (detail["field"], detail["allowed"], detail["received"]) == (field, allowed, received), detail
    assert jobs == {}
