"""Where a job's memory goes (:mod:`arctic_rl.server.memory`) and the memory-saving options of the training job.

On a tiny real model: the training job's report equals the bytes of the model's parameters, gradients and
AdamW states (computed here from the tensors), the log_prob job's its weights; the report reaches ``/status``
and the ``/forward-backward`` metrics; ZeRO-3, optimizer and parameter offload and gradient checkpointing
reach the DeepSpeed engine and train, and what the server cannot honour is refused naming the key.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.engines.config import build_training_ds_config
from arctic_rl.server.engines.logprob_engine import LogProbEngine
from arctic_rl.server.engines.training import TrainingEngine
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.http.validation import parse_batch_body
from arctic_rl.server.memory import (
    GIB,
    JobMemory,
    job_memory,
    memory_metrics,
    report_gib,
    tensor_bytes,
    vllm_worker_parts,
)
from arctic_rl.server.settings import ServerSettings
from arctic_rl.tiny_models import build_tiny_model

P, R, ROWS = 5, 4, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("memory") / "model", "qwen3", seed=0)


def _body(vocab: int = 90) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (ROWS, P + R), generator=g)
    mask = torch.ones_like(ids)
    return {"batch": {"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :P], "responses": ids[:, P:],
                      "response_mask": mask[:, P:], "advantages": torch.randn(ROWS, R, generator=g),
                      "old_log_probs": torch.full((ROWS, R), -4.0)},
            "meta": {"calculate_entropy": True}, "processing": {"loss_fn": "grpo", "config": {}}}


def _engine(model_dir, tmp_path, zero: dict | None = None, knobs: dict | None = None) -> TrainingEngine:
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero or {"stage": 0}}
    config = JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING, ds_config=ds,
                       ds_worker_config=knobs or {})
    return TrainingEngine(config, ServerSettings(checkpoint_root=tmp_path / "ck"), tmp_path / "job")


def _train_step(engine: TrainingEngine) -> dict:
    batch = parse_batch_body(_body(), vocab_size=engine.vocab_size, train=True)
    out = engine.forward_backward(batch)
    engine.step()
    return out["metrics"]


def test_training_report_equals_the_bytes_of_parameters_gradients_and_adam_states(model_dir, tmp_path):
    engine = _engine(model_dir, tmp_path)
    try:
        params = list(engine.model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        before = engine.memory_report()
        assert before == {"weights": param_bytes}  # nothing trained yet: no gradients, no AdamW state, no pass
        _train_step(engine)
        batch = parse_batch_body(_body(), vocab_size=engine.vocab_size, train=True)
        engine.forward_backward(batch)  # gradients held until the next /step
        report = engine.memory_report()
        optimizer = engine.engine.optimizer
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        assert report["weights"] == param_bytes
        assert report["gradients"] == sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        assert report["gradients"] == param_bytes  # fp32 CPU job: one fp32 gradient per parameter
        assert report["optimizer_state"] == sum(t.numel() * t.element_size() for t in states)
        moments = sum(s["exp_avg"].numel() * 4 + s["exp_avg_sq"].numel() * 4 for s in optimizer.state.values())
        assert moments == 2 * param_bytes and report["optimizer_state"] >= moments
        assert "master_weights" not in report  # fp32 at stage 0: the optimizer steps the model's own parameters
        # the passes' largest logits: rows x response positions x vocab x 4 bytes (fp32 on CPU)
        assert report["largest_logits"] == ROWS * R * engine.vocab_size * 4
        for gpu_only in ("call_peak", "call_transient", "device_max_allocated", "device_reserved", "device_in_use",
                         "offloaded"):
            assert gpu_only not in report  # absent on CPU, not zero
        assert engine.info()["memory"] == engine.memory_report()
    finally:
        engine.close()


def test_log_prob_report_is_its_weights_and_metric_names(model_dir, tmp_path):
    """The log_prob job (a plain copy below ZeRO stage 3) reports its weights; its ZeRO-3 and parameter-offload
    forms are tested in tests/arctic_rl/server/engines/test_logprob_zero3_on_cpu.py."""
    config = JobConfig(model_name=str(model_dir), job_type=JobType.LOG_PROB, ds_config={"zero_optimization": {}})
    engine = LogProbEngine(config, ServerSettings(checkpoint_root=tmp_path / "ck"))
    try:
        param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        assert engine.memory_report() == {"weights": param_bytes}
        engine.forward(parse_batch_body(_body(), vocab_size=engine.vocab_size, train=False))
        report = engine.memory_report()
        assert report["weights"] == param_bytes and report["largest_logits"] == ROWS * (P + R - 1) * engine.vocab_size * 4
        names = memory_metrics([SimpleNamespace(job_type=JobType.LOG_PROB, engine=engine)])
        assert names["memory/log_prob/weights_gib"] == pytest.approx(param_bytes / GIB, abs=1e-6)
        assert set(names) == {f"memory/log_prob/{part}_gib" for part in report}
    finally:
        engine.close()


def test_sampler_reports_weights_and_kv_cache():
    """The vLLM sampler's parts come from its worker's model runner (reached through ``collective_rpc``): the
    model's parameters and the KV cache tensors."""
    model = torch.nn.Linear(8, 4)
    runner = SimpleNamespace(model=model, kv_caches=[torch.zeros(2, 3, 5), torch.zeros(2, 3, 5, dtype=torch.float16)])
    assert vllm_worker_parts(SimpleNamespace(model_runner=runner)) == {"weights": (32 + 4) * 4,
                                                                      "kv_cache": 30 * 4 + 30 * 2}


def test_a_jobs_report_is_its_engines_and_never_fails_the_call():
    model = torch.nn.Linear(8, 4)
    engine = SimpleNamespace(memory_report=lambda: JobMemory(torch.device("cpu")).report(model))
    assert job_memory(engine) == {"weights": 36 * 4}

    def broken() -> dict[str, int]:
        raise RuntimeError("the worker is gone")

    assert job_memory(SimpleNamespace(memory_report=broken)) == {}


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    assert tensor_bytes([a, a, a[2:5], torch.zeros(3, dtype=torch.float64), None, 3]) == (40 + 24, 64)
    flat = torch.zeros(12)  # a flat buffer and the parameters that are slices of it: each byte once
    assert tensor_bytes([flat[0:4], flat[4:10]]) == (40, 40)
    seen: dict = {}
    assert tensor_bytes([flat[0:4], flat[4:10]], seen) == (40, 40)
    assert tensor_bytes([flat, flat[2:3]], seen) == (8, 8)  # only the two floats not counted before
    assert report_gib({"weights": 1 << 30}, "x/") == {"x/weights_gib": 1.0}
    tracker = JobMemory(torch.device("cpu"))
    assert tracker.report(None) == {}


@pytest.mark.parametrize(
    "zero, field",
    [
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "ds_config.zero_optimization.stage"),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "ds_config.zero_optimization.stage"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "ds_config.zero_optimization.offload_param.device"),
        ({"stage": 2, "offload_optimizer": "cpu"}, "ds_config.zero_optimization.offload_optimizer"),
    ],
)
def test_offload_the_server_cannot_run_is_refused_naming_the_key(zero, field):
    with pytest.raises(BadRequest) as err:
        build_training_ds_config({"zero_optimization": zero}, device="cpu", bf16_supported=False)
    assert err.value.field == field


def test_offload_and_stage_3_reach_the_deepspeed_config():
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4},
            "offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    out, _ = build_training_ds_config({"zero_optimization": zero}, device="cpu", bf16_supported=False)
    assert out["zero_optimization"]["stage"] == 3
    assert out["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert out["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert out["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    none, _ = build_training_ds_config({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}},
                                       device="cpu", bf16_supported=False)
    assert "offload_optimizer" not in none["zero_optimization"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero, knobs",
    [
        ({"stage": 3}, {}),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, {}),
        ({"stage": 0}, {"enable_gradient_checkpointing": True}),
    ],
    ids=["zero3", "offload_optimizer", "offload_param", "gradient_checkpointing"],
)
def test_training_job_runs_with_each_memory_option(model_dir, tmp_path, zero, knobs, monkeypatch):
    """Each option reaches DeepSpeed's engine (or the model) and the job trains to the plain job's loss, with the
    LM head run chunk by chunk on hidden states (ZeRO-3 gathers its weight at each chunk, forward and backward)."""
    from arctic_rl.server.compute import token_logprobs as logprobs

    plain = _engine(model_dir, tmp_path / "plain")
    try:
        want = [_train_step(plain)["loss"] for _ in range(2)]
        want_weights = {k: v.clone() for k, v in plain.weights().items()}
        param_bytes = sum(p.numel() * p.element_size() for p in plain.model.parameters())  # tied weights once
    finally:
        plain.close()
    monkeypatch.setattr(logprobs, "_HEAD_CHUNK_BYTES", 3 * 102 * 4)  # 3 positions of the 102-token vocabulary
    engine = _engine(model_dir, tmp_path / "opt", zero, knobs)
    try:
        ds = engine.engine
        assert ds.zero_optimization_stage() == zero["stage"]
        assert bool(ds.zero_cpu_offload()) == ("offload_optimizer" in zero)
        if "offload_param" in zero:
            assert ds.zero_offload_param() is not None and ds.zero_offload_param().device == "cpu"
        assert engine.model.is_gradient_checkpointing == bool(knobs.get("enable_gradient_checkpointing"))
        got = [_train_step(engine)["loss"] for _ in range(2)]
        assert engine.memory_report()["largest_hidden_states"] > 0  # the chunked head ran
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        weights = engine.weights()  # ZeRO-3: gathered, the whole model
        assert weights.keys() == want_weights.keys()
        for name, value in want_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
        engine.forward_backward(parse_batch_body(_body(), vocab_size=engine.vocab_size, train=True))
        report = engine.memory_report()  # fp32 on CPU: whole weights and gradients, wherever DeepSpeed keeps them
        assert report["weights"] == report["gradients"] == param_bytes
        assert report["optimizer_state"] >= 2 * param_bytes
        if zero["stage"] == 3:  # the HF export writes the gathered weights, not the empty partitions
            from transformers import AutoModelForCausalLM

            out = engine.save(tmp_path / "ckpts" / "checkpoint-2", export_hf=True)
            exported = AutoModelForCausalLM.from_pretrained(out["hf_path"]).state_dict()
            for name, value in want_weights.items():
                torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        engine.close()


def test_a_checkpoint_save_runs_no_collective_but_barriers(model_dir, tmp_path, monkeypatch):
    """DeepSpeed's save checks the tag across ranks with two all-reduces of a CUDA tensor; on the server's one-rank
    group that check is void, and on a GPU its first run makes the group's NCCL communicator (RESULTS §2u). The
    real engine saves here with each collective of ``torch.distributed`` recorded (and still run): only barriers,
    which the group's ``cpu:gloo`` runs on the CPU (tests/arctic_rl/server/engines/test_process_group_on_cpu.py)."""
    import torch.distributed as dist

    engine = _engine(model_dir, tmp_path)
    try:
        _train_step(engine)
        assert not engine.engine.checkpoint_tag_validation_enabled()
        called: list[str] = []
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
                     "reduce_scatter_tensor", "all_to_all_single", "barrier"):
            original = getattr(dist, name)

            def spy(*args, _name=name, _original=original, **kwargs):
                called.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(dist, name, spy)
        out = engine.save(tmp_path / "ck" / "checkpoint-1", export_hf=False)
        assert out["global_step"] == 1 and (tmp_path / "ck" / "checkpoint-1").is_dir()
        assert called and set(called) == {"barrier"}, called
    finally:
        engine.close()
