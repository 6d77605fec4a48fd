"""The two Arctic wire dialects: golden bodies, routes and codecs, each built from ``arctic_rl.protocol``'s models.

The reference server parses these bodies with the same models, so each golden dict below is also
checked to be exactly what the request model produces from it (no field lost or added on the way).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from arctic_rl import dssst1, protocol
from arctic_rl.v1compat import torch_load_safe
from verl.remote_backend.errors import RemoteProtocolError
from verl.workers.remote_client.arctic.answers import parse_answer
from verl.workers.remote_client.arctic.dialect import Dialect, DialectV1, DialectV2, dialect_for

V1, V2 = dialect_for(1), dialect_for(protocol.ProtocolVersion.V2)


def _model_round_trip(model, body: dict, **dump) -> dict:
    return model.model_validate(body).model_dump(mode="json", **dump)


def test_one_small_interface_two_dialects():
    assert inspect.isabstract(Dialect)
    assert isinstance(V1, DialectV1) and isinstance(V2, DialectV2)
    assert (V1.version, V2.version) == (protocol.ProtocolVersion.V1, protocol.ProtocolVersion.V2)
    assert (V1.forward_path, V1.forward_backward_path) == (protocol.Paths.V1_FWD_NO_GRAD, protocol.Paths.V1_FWD_BWD)
    assert (V2.forward_path, V2.forward_backward_path) == (protocol.Paths.FORWARD, protocol.Paths.FORWARD_BACKWARD)
    assert V2.can_load_checkpoints and not V1.can_load_checkpoints
    with pytest.raises(RemoteProtocolError, match="unknown wire generation 3"):
        dialect_for(3)


def test_tensor_codecs():
    body = {"batch": {"input_ids": torch.arange(6).view(2, 3)}, "meta": {"rollout_n": 1}}
    assert torch.equal(dssst1.loads(V2.encode_tensors(body))["batch"]["input_ids"], body["batch"]["input_ids"])
    assert torch.equal(V2.decode_tensors(bytes(V2.encode_tensors(body)))["batch"]["input_ids"],
                       body["batch"]["input_ids"])
    assert torch.equal(torch_load_safe(bytes(V1.encode_tensors(body)))["batch"]["input_ids"],
                       body["batch"]["input_ids"])


def test_step_bodies():
    assert V2.step_body() == {} == _model_round_trip(protocol.StepRequest, {}, exclude_none=True)
    assert V1.step_body() is None


def test_generate_bodies():
    params = {"max_tokens": 4, "temperature": 1.0, "n": 1}
    v2 = V2.generate_payload([[1, 2], [3]], params)
    assert v2.content_type == protocol.OCTET_STREAM and v2.json is None
    golden = {"prompts": [[1, 2], [3]], "sampling_params": params, "routing_key": None, "strict": False}
    assert dssst1.loads(v2.data) == golden == _model_round_trip(protocol.GenerateRequest, golden)
    v1 = V1.generate_payload(["a b", "c"], params)
    assert v1.content_type == protocol.JSON_MEDIA_TYPE and v1.data is None
    assert v1.json == {"prompts": ["a b", "c"], "sampling_params": params}
    with pytest.raises(ValueError, match="prompts"):
        V2.generate_payload([], params)


def test_weight_sync_routes():
    v2 = V2.weight_sync(training=1, sampling=2, log_prob=3, cuda_ipc=False, low_memory=False)
    golden = {"source_sub_job_id": 1, "target_sub_job_ids": [2, 3], "cuda_ipc": False, "low_memory": False}
    assert (v2.path, v2.params, v2.body) == (protocol.Paths.WEIGHT_SYNC, {"job_id": 1}, golden)
    assert golden == _model_round_trip(protocol.WeightSyncRequest, golden)
    assert V2.weight_sync(training=1, sampling=2, log_prob=None, cuda_ipc=True, low_memory=True).body[
        "target_sub_job_ids"] == [2]
    v1 = V1.weight_sync(training=1, sampling=2, log_prob=3, cuda_ipc=False, low_memory=False)
    golden = {"training_job_id": 1, "sampling_job_id": 2, "colocate": False, "cuda_ipc": False, "low_memory": False}
    assert (v1.path, v1.params, v1.body) == (protocol.Paths.V1_SYNC_WEIGHTS, None, golden)
    assert golden == _model_round_trip(protocol.V1SyncWeightsRequest, golden)


def test_save_and_load_bodies():
    v2 = V2.save(step=3, path=None, export_hf=False, save_total_limit=2)
    golden = {"export_hf": False, "checkpoint_type": "resumable", "step": 3, "save_total_limit": 2}
    assert (v2.path, v2.body) == (protocol.Paths.SAVE, golden)
    assert golden == _model_round_trip(protocol.SaveRequest, golden, exclude_none=True)
    assert V2.save(step=None, path=None, export_hf=True, save_total_limit=None).body == {
        "export_hf": True, "checkpoint_type": "resumable"}
    v1 = V1.save(step=3, path="x", export_hf=False, save_total_limit=None)
    assert (v1.path, v1.body) == (protocol.Paths.V1_SAVE_CHECKPOINT, None)
    assert V2.load_checkpoint_body(step=None, path="ck/3") == {"path": "ck/3"} == _model_round_trip(
        protocol.LoadCheckpointRequest, {"path": "ck/3"}, exclude_none=True)
    with pytest.raises(RemoteProtocolError, match="v1 servers cannot load checkpoints"):
        V1.load_checkpoint_body(step=1, path=None)


def test_answers_are_read_with_tolerant_models():
    # the vendor's /step answers {job_id, workers}: no metrics
    assert parse_answer(protocol.StepResponse, {"job_id": 3, "workers": [{}]}, "POST /step").metrics == {}
    with pytest.raises(RemoteProtocolError, match=r"metrics: .*StepResponse.*received 7"):
        parse_answer(protocol.StepResponse, {"metrics": 7}, "POST /step")


def test_forward_backward_body_is_what_the_models_produce():
    """``{batch, meta, processing}``: meta from the builder, checked by ``BatchMeta`` without a key lost or
    added; processing a ``Processing`` as the reference server parses it."""
    from arctic_rl.protocol import BatchMeta, Processing
    from tests.support.arctic import verl_main_config
    from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
    from verl.workers.remote_client.arctic.builders import build_meta
    from verl.workers.remote_client.arctic.loss_config import build_loss_config
    from verl.workers.remote_client.arctic.training import TRAIN_POST, forward_body
    from verl.workers.remote_client.common.verl_settings import VerlSettings

    cfg = verl_main_config(None)
    v, a = VerlSettings.from_main_config(cfg), ArcticConfig.from_main_config(cfg)
    loss = build_loss_config(v, loss_scale_tokens=40.0)
    meta = build_meta(v, a, max_prompt_len=11, max_response_len=32, temperature=0.7, calculate_entropy=True,
                      pad_token_id=3, global_batch_size=8, batch_num_tokens=40.0, loss=loss)
    processing = Processing(loss_fn="verl_grpo", post=list(TRAIN_POST), config=loss)
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    body = forward_body(batch, meta, processing)
    assert body["batch"] is batch
    assert body["meta"] == meta == BatchMeta.model_validate(meta).model_dump(mode="json", exclude_unset=True)
    assert body["processing"] == {"loss_fn": "verl_grpo", "post": ["apply_temperature", "compute_entropy_and_logprobs"],
                                  "config": loss.model_dump(mode="json", exclude={"rollout_correction"})}
    assert Processing.model_validate(body["processing"]).model_dump(mode="json") == body["processing"]
    with pytest.raises(ValueError, match="temperature"):
        forward_body(batch, {**meta, "temperature": 0.0}, processing)
