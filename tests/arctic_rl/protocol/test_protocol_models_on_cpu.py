"""The protocol's models: strict where we send, tolerant where we read, nested fields typed, meta keys checked.

* every request model refuses an unknown key and names it (nested ones too: ``sampling_params.<key>``,
  ``processing.config.<key>``); every answer model accepts keys it does not know;
* a misspelt ``meta`` key is refused by the client before sending and by the server with a 400, each naming
  the key, the allowed keys and what was received; every key the vendor's clients send still passes;
* the nested models (``ds_worker_config``, ``processing.config``, ``sampling_params``) carry on the wire what
  was given, and the golden DSSST1 frames made by the vendor's encoder parse and round-trip through them;
* sampling parameters are cleaned by one function with one warned-once set.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ValidationError

from arctic_rl import dssst1, protocol
from arctic_rl.protocol import (
    BatchMeta,
    DsWorkerConfig,
    FieldError,
    ForwardBackwardResponse,
    ForwardResponse,
    GenerateRequest,
    JobConfig,
    LossConfig,
    Processing,
    SamplingParams,
    Strict,
    Tolerant,
    clean_sampling_params,
    validate_meta,
)

#: a valid body of every request model (what a client sends)
REQUESTS: dict[str, dict[str, Any]] = {
    "DestroyRequest": {"job_type": "training"},
    "StepRequest": {},
    "SaveRequest": {},
    "LoadCheckpointRequest": {"step": 1},
    "WeightSyncRequest": {"source_sub_job_id": 1, "target_sub_job_ids": [2]},
    "V1SyncWeightsRequest": {"training_job_id": 1, "sampling_job_id": 2},
    "GenerateRequest": {"prompts": ["a"]},
    "SamplingParams": {},
    "LossConfig": {},
    "RolloutCorrection": {},
    "Processing": {},
    "BatchMeta": {},
    "ResetPrefixCacheRequest": {},
    "OperationRequest": {"operation_type": "weight-sync"},
    "WeightNormRequest": {"training_job_id": 1, "sampling_job_id": 2},
    "LogProbsRequest": {"prompts": ["a"]},
    "BatchShape": {"prompt_len": 8, "response_len": 4, "forward_rows": 16, "forward_backward_rows": 8},
}
#: a valid body of every answer model (what a client reads)
ANSWERS: dict[str, dict[str, Any]] = {
    "InitializeResponse": {"job_id": 1, "job_type": "training", "running": True},
    "JobInfo": {"job_id": 1, "job_type": "training", "model_name": "m", "status": "RUNNING"},
    "HealthResponse": {"status": "OK"},
    "ErrorDetail": {"message": "m"},
    "ForwardBackwardResponse": {"job_id": 1, "metrics": {}},
    "ForwardResponse": {"job_id": 1, "batch": {}},
    "StepResponse": {},
    "SaveResponse": {"path": "p"},
    "LoadCheckpointResponse": {"path": "p", "global_step": 1},
    "WeightSyncResponse": {},
    "TokenLogprob": {"logprob": -1.0},
    "GenerateResult": {"text": "", "token_ids": [1], "finish_reason": "stop", "prompt_len": 1, "generation_len": 1},
    "GenerateResponse": {"job_id": 1, "results": []},
    "WeightNormResponse": {"training_norm": 1.0, "sampling_norm": 1.0, "training_num_params": 1,
                           "sampling_num_params": 1},
}


def _models(base: type[BaseModel]) -> set[str]:
    return {name for name in protocol.__all__
            if isinstance(getattr(protocol, name), type) and issubclass(getattr(protocol, name), base)
            and getattr(protocol, name) is not base}


def test_every_model_is_strict_or_tolerant_and_covered_here():
    # JobConfig and DsWorkerConfig are tolerant on purpose: the vendor's server ignores unknown keys there
    assert _models(Strict) == set(REQUESTS)
    assert _models(Tolerant) == set(ANSWERS) | {"JobConfig", "DsWorkerConfig"}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_strict_request_models_refuse_an_unknown_field_naming_it(name):
    model = getattr(protocol, name)
    model.model_validate(REQUESTS[name])
    with pytest.raises(ValidationError) as err:
        model.model_validate({**REQUESTS[name], "bogus_knob": 1})
    assert [e["loc"] for e in err.value.errors()] == [("bogus_knob",)]
    assert err.value.errors()[0]["type"] == "extra_forbidden"


@pytest.mark.parametrize(("model", "body", "loc"), [
    (GenerateRequest, {"prompts": ["a"], "sampling_params": {"temprature": 0.5}}, ("sampling_params", "temprature")),
    (Processing, {"loss_fn": "grpo", "config": {"clip_ratoi": 0.1}}, ("config", "clip_ratoi")),
    (Processing, {"config": {"rollout_correction": {"rollout_iss": "token"}}},
     ("config", "rollout_correction", "rollout_iss")),
])
def test_nested_request_models_refuse_an_unknown_field_naming_its_path(model, body, loc):
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    assert err.value.errors()[0]["loc"] == loc


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_tolerant_answer_models_accept_extra_fields(name):
    parsed = getattr(protocol, name).model_validate({**ANSWERS[name], "added_by_a_newer_server": [1, 2]})
    assert parsed.model_extra == {"added_by_a_newer_server": [1, 2]}


def test_job_config_ignores_unknown_keys_and_ds_worker_config_keeps_the_vendors():
    body = {"model_name": "m", "some_vendor_key": 1,
            "ds_worker_config": {"attn_implementation": "sdpa", "logits_compute_from_fp32_inputs": True}}
    config = JobConfig.model_validate(body)
    assert isinstance(config.ds_worker_config, DsWorkerConfig)
    assert config.ds_worker_config.attn_implementation == "sdpa"
    assert config.ds_worker_config.model_extra == {"logits_compute_from_fp32_inputs": True}
    dumped = config.model_dump(mode="json")
    assert "some_vendor_key" not in dumped
    # the wire carries the keys given, not the model's defaults
    assert dumped["ds_worker_config"] == body["ds_worker_config"]
    with pytest.raises(ValidationError) as err:
        JobConfig.model_validate({"model_name": "m", "ds_worker_config": {"rollout_n": 0}})
    assert err.value.errors()[0]["loc"] == ("ds_worker_config", "rollout_n")


def test_batch_shape_travels_in_ds_worker_config_and_refuses_bad_sizes_naming_them():
    shape = REQUESTS["BatchShape"]
    config = JobConfig.model_validate({"model_name": "m", "ds_worker_config": {"batch_shape": shape}})
    assert config.ds_worker_config.batch_shape.forward_rows == 16
    assert config.model_dump(mode="json")["ds_worker_config"] == {"batch_shape": shape}
    assert JobConfig.model_validate({"model_name": "m", "ds_worker_config": {}}).ds_worker_config.batch_shape is None
    for key, bad in (("prompt_len", 0), ("forward_rows", protocol.MAX_BATCH_SHAPE_SIZE + 1), ("response_len", "x")):
        with pytest.raises(ValidationError) as err:
            JobConfig.model_validate({"model_name": "m", "ds_worker_config": {"batch_shape": {**shape, key: bad}}})
        assert err.value.errors()[0]["loc"] == ("ds_worker_config", "batch_shape", key)


def test_sampling_params_are_typed_and_sent_as_given():
    given = {"max_tokens": 4, "temperature": 1.0, "n": 1}
    request = GenerateRequest.model_validate({"prompts": [[1, 2]], "sampling_params": given})
    assert isinstance(request.sampling_params, SamplingParams) and request.sampling_params.max_tokens == 4
    assert request.model_dump(mode="json")["sampling_params"] == given
    assert GenerateRequest(prompts=["a"]).model_dump(mode="json")["sampling_params"] is None


def test_processing_config_is_a_loss_config_sent_whole_and_empty_when_absent():
    loss = LossConfig(clip_ratio=0.3, use_kl_loss=True)
    body = Processing(loss_fn="verl_grpo", config=loss).model_dump(mode="json")
    assert body["config"] == loss.model_dump(mode="json", exclude={"rollout_correction"})
    assert Processing.model_validate(body).config == loss
    assert Processing(post=["identity"]).model_dump(mode="json")["config"] == {}


# ------------------------------------------------------------------ meta keys
def test_misspelt_meta_key_is_refused_naming_it_the_allowed_keys_and_what_was_received():
    with pytest.raises(FieldError) as err:
        validate_meta({"rollout_n": 2, "temprature": 0.7})
    assert err.value.field == "meta.temprature" and err.value.received == "temprature"
    assert "temperature" in err.value.allowed and err.value.allowed == sorted(BatchMeta.model_fields)
    assert "['rollout_n', 'temprature']" in str(err.value)


def test_every_meta_key_the_vendors_clients_send_passes():
    # integrations/verl/adapter.py (compute_log_prob, update_actor) and sft/client.py of Arctic-Platform
    vendor = {"zorro_train_enable": False, "zorro_train_max_rollouts": None, "load_balancer": None, "rollout_n": 2,
              "max_prompt_len": 4, "max_response_len": 4, "max_token_len_per_gpu": 1024, "temperature": 1.0,
              "calculate_entropy": False, "pad_token_id": 0, "drop_position_ids": True, "logits_optimization": "none",
              "logits_optimization_peak_mem_size_in_gib": 4, "logits_compute_in_fp32": False,
              "actor_config": {"clip_ratio": 0.2, "strategy": "fsdp"}, "policy_loss_config": {"loss_mode": "vanilla"},
              "global_batch_size": 4, "batch_num_tokens": 12.0, "rollout_is_weights": None,
              "gas_microbatches": True, "sample_packing": False}
    assert validate_meta(vendor).model_dump(mode="json", exclude_unset=True) == vendor


def test_client_refuses_a_misspelt_meta_key_before_sending():
    from verl.remote_backend.errors import RemoteBackendConfigError
    from verl.workers.remote_client.arctic.training import forward_body

    with pytest.raises(RemoteBackendConfigError) as err:
        forward_body({}, {"rollout_n": 2, "pad_token_idx": 0}, Processing())
    assert err.value.field == "meta.pad_token_idx" and err.value.received == "pad_token_idx"
    assert "pad_token_id" in err.value.allowed


def test_server_answers_a_misspelt_meta_key_with_a_400_naming_it():
    from arctic_rl.server.errors import BadRequest
    from arctic_rl.server.http.validation import parse_batch_body

    ids = torch.tensor([[1, 2, 3, 4]])
    body = {"batch": {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompts": ids[:, :2]},
            "meta": {"calculate_entropyy": True}, "processing": {}}
    with pytest.raises(BadRequest) as err:
        parse_batch_body(body, vocab_size=10, train=False)
    assert err.value.status_code == 400
    detail = err.value.detail()
    assert detail["field"] == "meta.calculate_entropyy" and detail["received"] == "calculate_entropyy"
    assert "calculate_entropy" in detail["allowed"]
    body["meta"] = {"calculate_entropy": True}
    assert parse_batch_body(body, vocab_size=10, train=False).meta.calculate_entropy


# ------------------------------------------------------------------ golden frames of the vendor's encoder
def test_golden_forward_backward_request_round_trips_through_the_nested_models(shared_dir):
    frame = dssst1.loads((shared_dir / "conformance/dssst1/fwd_bwd_request.dssst1").read_bytes())
    meta = validate_meta(frame["meta"])
    assert meta.model_dump(mode="json", exclude_unset=True) == frame["meta"]
    processing = Processing.model_validate(frame["processing"])
    assert processing.config == LossConfig(clip_ratio=frame["processing"]["config"]["clip_ratio"])
    sent = processing.model_dump(mode="json")
    assert {k: sent[k] for k in ("loss_fn", "post")} == {k: frame["processing"][k] for k in ("loss_fn", "post")}
    assert frame["processing"]["config"].items() <= sent["config"].items()
    assert Processing.model_validate(sent) == processing
    # and back through the codec: the same frame, as the vendor's decoder reads it
    again = dssst1.loads(dssst1.dumps({"batch": frame["batch"], "meta": meta.model_dump(mode="json", exclude_unset=True),
                                       "processing": sent}))
    assert again["meta"] == frame["meta"] and Processing.model_validate(again["processing"]) == processing


@pytest.mark.parametrize(("name", "model"), [("fwd_bwd_response", ForwardBackwardResponse),
                                             ("forward_response", ForwardResponse)])
def test_golden_answers_parse_and_round_trip(shared_dir, name, model):
    frame = dssst1.loads((shared_dir / f"conformance/dssst1/{name}.dssst1").read_bytes())
    parsed = model.model_validate(frame)
    dumped = parsed.model_dump()
    assert dumped.keys() >= frame.keys()
    for key, value in frame.items():
        if isinstance(value, dict):
            assert dumped[key].keys() == value.keys()
            for k, v in value.items():
                assert torch.equal(dumped[key][k], v) if isinstance(v, torch.Tensor) else dumped[key][k] == v
        else:
            assert dumped[key] == value


# ------------------------------------------------------------------ sampling parameters
def test_sampling_params_are_cleaned_by_one_function_with_one_warned_once_set(caplog, monkeypatch):
    from arctic_rl.protocol import generation
    from verl.remote_backend.errors import RemoteBackendConfigError
    from verl.workers.remote_client.arctic import generation as client_generation
    from verl.workers.remote_client.arctic import replica

    monkeypatch.setattr(generation, "_warned", set())
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        params = clean_sampling_params({"max_new_tokens": 3, "frobnicate": 1, "detokenize": False})
        assert params == SamplingParams(max_tokens=3)
        client_generation.clean_sampling_params({"frobnicate": 2})
        replica.to_protocol_sampling_params({"frobnicate": 3}, prompt_len=1, response_length=4, prompt_length=4)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("frobnicate" in m for m in messages) == 1 and sum("detokenize" in m for m in messages) == 1
    assert not hasattr(replica, "_warned") and not hasattr(client_generation, "_warned")
    with pytest.raises(FieldError) as err:
        clean_sampling_params({"top_p": 0})
    assert err.value.field == "sampling_params.top_p" and err.value.received == 0
    with pytest.raises(RemoteBackendConfigError, match="sampling_params.temperature"):
        client_generation.clean_sampling_params({"temperature": -1})
