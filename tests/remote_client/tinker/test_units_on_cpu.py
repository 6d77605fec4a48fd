"""Unit tests of the Tinker adapter: config, verl options, batch conversion, SDK records.

Hand-computed values throughout; no server. The SDK-record tests need the ``tinker`` SDK (the
``test`` extra installs 0.24.1 on Python >= 3.11, the version the open peer speaks); the last test
reruns this module with the newest SDK on PyPI, the one hosted-service users get.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from tests.support.tinker import REPO, skip_or_fail
from verl.remote_backend.errors import (
    RemoteBackendConfigError,
    RemoteConnectionError,
    RemoteProtocolError,
    RemoteServerError,
    RemoteTimeoutError,
)
from verl.workers.remote_client.tinker import batch as tb
from verl.workers.remote_client.tinker.config import TinkerConfig
from verl.workers.remote_client.tinker.options import learning_rate, plan_run
from verl.workers.remote_client.tinker.sampling import eos_token_ids, tinker_sampling_params
from verl.workers.remote_client.tinker.sdk import (
    TESTED_SDK,
    full_length_logprobs,
    make_datum,
    map_error,
    untested_sdk_line,
)

YAML = Path(__file__).resolve().parents[3] / "verl/trainer/config/remote_backend/tinker.yaml"


def _nested(rows: list[list[float]], dtype=torch.float32) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _main(**overrides) -> OmegaConf:
    base = {
        "remote_backend": OmegaConf.to_container(OmegaConf.load(YAML)),
        "actor_rollout_ref": {
            "model": {"path": "/models/tiny-qwen3", "lora_rank": 8},
            "actor": {"ppo_mini_batch_size": 2, "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                      "loss_agg_mode": "token-mean", "use_kl_loss": False, "entropy_coeff": 0.0,
                      "policy_loss": {"loss_mode": "vanilla"},
                      "optim": {"lr": 1e-3, "lr_warmup_steps": 2, "lr_scheduler_type": "cosine",
                                "total_training_steps": 10, "min_lr_ratio": 0.0, "num_cycles": 0.5}},
            "rollout": {"n": 4, "temperature": 1.0},
        },
    }
    return OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(overrides))


# ------------------------------------------------------------------ config
def test_shipped_yaml_and_dataclass_mirror_each_other():
    shipped = yaml.safe_load(YAML.read_text(encoding="utf-8"))
    assert TinkerConfig.from_dict(shipped).to_dict() == TinkerConfig().to_dict()

    def keys(d, prefix=""):
        return {f"{prefix}{k}" for k in d} | {x for k, v in d.items() if isinstance(v, dict) for x in keys(v, f"{k}.")}

    assert keys(shipped) == keys(TinkerConfig().to_dict())


@pytest.mark.parametrize("data, field", [
    ({"train": {"loss_fn": "dro"}}, "remote_backend.train.loss_fn"),
    ({"train": {"lora_rank": 0}}, "remote_backend.train.lora_rank"),
    ({"server": {"url": "ftp://x"}}, "remote_backend.server.url"),
    ({"timeouts": {"call_s": 0}}, "remote_backend.timeouts.call_s"),
    ({"rollout": {"max_batch_size": "8"}}, "remote_backend.rollout.max_batch_size"),
    ({"server": {"token": "x"}}, "remote_backend.server.token"),
    ({"checkpoint": {"load_path": "/tmp/x"}}, "remote_backend.checkpoint.load_path"),
])
def test_bad_config_values_are_refused_naming_the_key(data, field):
    with pytest.raises(RemoteBackendConfigError) as info:
        TinkerConfig.from_dict(data)
    assert info.value.field == field


# ------------------------------------------------------------------ verl options
def test_plan_maps_clip_ratios_rank_and_mini_batches():
    run = plan_run(_main(), TinkerConfig.from_main_config(_main()))
    assert run.loss_fn == "ppo"
    assert run.loss_fn_config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    assert (run.lora_rank, run.mini_batch_rows, run.base_model) == (8, 8, "/models/tiny-qwen3")
    newer = _main(actor_rollout_ref={"model": {"lora_rank": 0, "lora": {"rank": 16}}})  # verl's model.lora.rank
    assert plan_run(newer, TinkerConfig.from_main_config(newer)).lora_rank == 16


@pytest.mark.parametrize("overrides, field", [
    ({"actor_rollout_ref": {"model": {"lora_rank": 0}}}, "actor_rollout_ref.model.lora_rank"),
    ({"actor_rollout_ref": {"actor": {"use_kl_loss": True}}}, "actor_rollout_ref.actor.use_kl_loss"),
    ({"actor_rollout_ref": {"actor": {"entropy_coeff": 0.01}}}, "actor_rollout_ref.actor.entropy_coeff"),
    ({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "gspo"}}}},
     "actor_rollout_ref.actor.policy_loss.loss_mode"),
    ({"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-sum-norm"}}},
     "actor_rollout_ref.actor.loss_agg_mode"),
    ({"actor_rollout_ref": {"rollout": {"temperature": 0.7}}}, "actor_rollout_ref.rollout.temperature"),
    ({"actor_rollout_ref": {"rollout": {"quantization": "fp8"}}}, "actor_rollout_ref.rollout.quantization"),
    ({"remote_backend": {"train": {"lora_rank": 4}}}, "remote_backend.train.lora_rank"),
    ({"actor_rollout_ref": {"actor": {"optim": {"lr_scheduler_type": "linear"}}}},
     "actor_rollout_ref.actor.optim.lr_scheduler_type"),
])
def test_options_tinker_cannot_honour_are_refused_naming_the_key(overrides, field):
    main = _main(**overrides)
    with pytest.raises(RemoteBackendConfigError) as info:
        plan_run(main, TinkerConfig.from_main_config(main))
    assert info.value.field == field


def test_verls_rollout_engine_keys_away_from_its_defaults_are_named_in_one_warning(caplog):
    """They size the local vLLM stock verl would start: not applied on Tinker, and the log says which."""
    defaults = {"gpu_memory_utilization": 0.5, "max_num_seqs": 256, "enforce_eager": False}  # verl 0.9.1's yaml
    quiet = _main(actor_rollout_ref={"rollout": defaults})
    with caplog.at_level("WARNING"):
        plan_run(quiet, TinkerConfig.from_main_config(quiet))
    assert "local vLLM" not in caplog.text
    sized = _main(actor_rollout_ref={"rollout": {"gpu_memory_utilization": 0.7, "max_num_seqs": 256,
                                                 "engine_kwargs": {"vllm": {"kv_cache_memory_bytes": 1 << 30}}}})
    with caplog.at_level("WARNING"):
        plan_run(sized, TinkerConfig.from_main_config(sized))
    lines = [r.getMessage() for r in caplog.records if "local vLLM" in r.getMessage()]
    assert len(lines) == 1 and "gpu_memory_utilization=0.7" in lines[0]
    assert "engine_kwargs.vllm.kv_cache_memory_bytes=1073741824" in lines[0] and "max_num_seqs" not in lines[0]


def test_learning_rate_follows_verls_warmup_and_cosine():
    run = plan_run(_main(), TinkerConfig.from_main_config(_main()))
    # warm-up 2 steps from 0; cosine over the 8 steps after it, to min_lr_ratio 0
    assert [learning_rate(run, s) for s in (0, 1, 2)] == pytest.approx([0.0, 5e-4, 1e-3])
    assert learning_rate(run, 6) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(run, 10) == pytest.approx(0.0, abs=1e-12)
    const = _main(remote_backend={"train": {"lr_schedule": "constant"}})
    assert learning_rate(plan_run(const, TinkerConfig.from_main_config(const)), 0) == pytest.approx(1e-3)


# ------------------------------------------------------------------ batches
def _batch(padded: bool = False):
    from verl.utils import tensordict_utils as tu

    prompts, responses = [[5, 6, 7], [5, 6]], [[8, 9], [10, 11, 12]]
    fields = {
        "input_ids": _nested([p + r for p, r in zip(prompts, responses)], torch.int64),
        "prompts": _nested(prompts, torch.int64),
        "responses": _nested(responses, torch.int64),
    }
    mask, old, adv = [[1.0, 1.0], [1.0, 1.0, 0.0]], [[-0.5, -1.0], [-0.1, -0.2, -0.3]], [[2.0, 2.0], [-1.0, -1.0, -1.0]]
    if padded:
        def pad(rows):
            return torch.tensor([r + [0.0] * (4 - len(r)) for r in rows])

        fields.update(response_mask=pad(mask), old_log_probs=pad(old), advantages=pad(adv))
    else:
        fields.update(response_mask=_nested(mask), old_log_probs=_nested(old), advantages=_nested(adv))
    return tu.get_tensordict(fields)


@pytest.mark.parametrize("padded", [False, True])
def test_rows_and_response_values_from_nested_and_padded_batches(padded):
    data = _batch(padded)
    rows = tb.split_rows(data)
    assert rows.tokens == [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12]]
    assert (rows.prompt_lens, rows.response_lens) == ([3, 2], [2, 3])
    values = tb.response_values(data, "old_log_probs", rows)
    assert [len(v) for v in values] == [2, 3]
    assert [x for v in values for x in v] == pytest.approx([-0.5, -1.0, -0.1, -0.2, -0.3])


def test_datum_inputs_align_response_values_with_their_target_tokens():
    rows = tb.split_rows(_batch())
    tokens, inputs = tb.target_inputs(rows, 0, {"logprobs": [-0.5, -1.0], "advantages": [0.5, 0.5]})
    assert tokens == [5, 6, 7, 8]  # t_0 .. t_{L-2}
    assert inputs["target_tokens"] == [6, 7, 8, 9]  # target j predicts t_{j+1}: 8 and 9 are targets 2 and 3
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -1.0]
    assert inputs["advantages"] == [0.0, 0.0, 0.5, 0.5]
    tokens, inputs = tb.target_inputs(rows, 1, {"advantages": [1.0, 2.0, 3.0]})
    assert tokens == [5, 6, 10, 11] and inputs["target_tokens"] == [6, 10, 11, 12]
    assert inputs["advantages"] == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(RemoteBackendConfigError, match="data.advantages"):
        tb.target_inputs(rows, 1, {"advantages": [1.0]})


def test_nested_log_probs_are_what_verls_response_slicing_expects():
    from verl.workers.utils.padding import response_from_nested

    data = _batch()
    rows = tb.split_rows(data)
    per_target = [[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, -7.0, -8.0]]
    nested = tb.nested_like(per_target, rows)
    assert nested.offsets().tolist() == data["input_ids"].offsets().tolist()
    assert nested.values().tolist() == [-1.0, -2.0, -3.0, -4.0, 0.0, -5.0, -6.0, -7.0, -8.0, 0.0]
    response = response_from_nested(nested, data["response_mask"])
    # response token k of row b is target P-1+k: row 0 -> targets 2, 3; row 1 -> targets 1, 2, 3
    assert [r.tolist() for r in response.unbind()] == [[-3.0, -4.0], [-6.0, -7.0, -8.0]]


def test_row_scales_turn_tinkers_sum_into_verls_aggregation():
    masks = [[1.0, 1.0], [1.0, 1.0, 0.0]]
    assert tb.row_scales(masks, "token-mean", None) == pytest.approx([0.25, 0.25])
    # verl 0.9.1 reads loss_scale_factor only in seq-mean-token-sum-norm: token-mean ignores it
    assert tb.row_scales(masks, "token-mean", 10.0) == pytest.approx([0.25, 0.25])
    assert tb.row_scales(masks, "seq-mean-token-sum", None) == pytest.approx([0.5, 0.5])
    assert tb.row_scales(masks, "seq-mean-token-mean", None) == pytest.approx([0.25, 0.25])
    assert tb.row_scales([[1.0], [1.0, 1.0, 1.0]], "seq-mean-token-mean", None) == pytest.approx([0.5, 1 / 6])
    # the summed, scaled loss equals verl's token-mean: sum(l * s) over 4 tokens of loss 1 = 1
    assert sum(m * s for row, s in zip(masks, tb.row_scales(masks, "token-mean", None)) for m in row) == 1.0
    with pytest.raises(RemoteBackendConfigError, match="loss_agg_mode"):
        tb.row_scales(masks, "seq-mean-token-sum-norm", None)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_scale_factor", [None, 10])
def test_row_scales_equal_verls_agg_loss(mode, loss_scale_factor):
    """Tinker's summed loss with the rows' scales is verl's own ``agg_loss`` of the same per-token losses."""
    from verl.trainer.ppo.core_algos import agg_loss

    losses = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, 3.0], [-0.75, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    scales = tb.row_scales([m.tolist() for m in mask], mode, loss_scale_factor)
    summed = sum(float((losses[b] * mask[b]).sum()) * scales[b] for b in range(len(scales)))
    expected = agg_loss(losses, mask, mode, batch_num_tokens=int(mask.sum()), global_batch_size=len(mask),
                        loss_scale_factor=loss_scale_factor)
    assert summed == pytest.approx(float(expected), rel=1e-6)


def test_batch_without_prompt_boundaries_is_refused():
    from verl.utils import tensordict_utils as tu

    data = tu.get_tensordict({"input_ids": _nested([[1, 2, 3]], torch.int64)})
    with pytest.raises(RemoteBackendConfigError, match="prompt from response"):
        tb.split_rows(data)


# ------------------------------------------------------------------ sampling params, SDK records
def test_sampling_params_are_validated_and_mapped():
    fields, n = tinker_sampling_params({"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": -1, "seed": 3,
                                        "stop": ["\n"], "logprobs": True})
    assert n == 1 and fields == {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": -1, "seed": 3,
                                 "stop": ["\n"]}
    assert tinker_sampling_params({"max_tokens": 4, "n": 3, "top_k": 0})[0]["top_k"] == -1
    for bad, field in (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 4, "top_p": 0}, "top_p"),
                       ({"max_tokens": 4, "n": 0}, "n")):
        with pytest.raises(RemoteBackendConfigError) as info:
            tinker_sampling_params(bad)
        assert info.value.field == f"sampling_params.{field}"


def test_samples_stop_at_the_models_end_of_sequence_like_verls_vllm_rollout(tiny_model_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(tiny_model_dir)).eos_token_id
    assert eos is not None and eos_token_ids(str(tiny_model_dir)) == [eos]
    base = {"max_tokens": 8}
    assert tinker_sampling_params(base, [eos])[0]["stop"] == [eos]  # verl sends no stop: the EOS id ends a sample
    assert tinker_sampling_params({**base, "stop": [3, eos]}, [eos])[0]["stop"] == [3, eos]
    assert tinker_sampling_params({**base, "stop": [3]}, [eos, 9])[0]["stop"] == [3, eos, 9]
    assert tinker_sampling_params({**base, "stop": ["\n"]}, [eos])[0]["stop"] == ["\n"]  # strings or ids, not both
    assert tinker_sampling_params({**base, "ignore_eos": True}, [eos])[0]["stop"] is None
    assert tinker_sampling_params(base)[0]["stop"] is None


def test_compute_logprobs_lengths_are_normalised():
    assert full_length_logprobs([None, -1.0, -2.0], 3, "x") == [None, -1.0, -2.0]  # hosted service
    assert full_length_logprobs([-1.0, -2.0], 3, "x") == [None, -1.0, -2.0]  # n-1 values (open servers)
    with pytest.raises(RemoteProtocolError):
        full_length_logprobs([-1.0], 3, "x")


def test_the_tinker_extra_is_bounded_to_the_sdk_tested_end_to_end():
    """SDK >= 0.25 sends protobuf, which no open server installable here speaks: the extra stops below it."""
    from packaging.specifiers import SpecifierSet

    extra = re.search(r"\"tinker\": \['tinker([^;']*)", (Path(REPO) / "setup.py").read_text())
    assert extra is not None, "setup.py: no tinker extra"
    allowed = SpecifierSet(extra.group(1))
    assert TESTED_SDK in allowed
    assert "0.25.0" not in allowed and "0.38.0" not in allowed and "0.24.0" not in allowed


def test_a_different_installed_sdk_is_named_in_one_start_up_line():
    assert untested_sdk_line(TESTED_SDK) is None
    line = untested_sdk_line("0.38.0")
    assert line is not None and "0.38.0" in line and TESTED_SDK in line and "\n" not in line


def test_sdk_records_carry_the_converted_rows():
    tinker = pytest.importorskip("tinker")
    rows = tb.split_rows(_batch())
    datum = make_datum(tinker.types, *tb.target_inputs(rows, 0, {"logprobs": [-0.5, -1.0], "advantages": [1.0, 1.0]}))
    assert datum.model_input.to_ints() == [5, 6, 7, 8]
    inputs = {k: (v.tolist() if hasattr(v, "tolist") else v.data) for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [6, 7, 8, 9]
    assert inputs["logprobs"] == pytest.approx([0.0, 0.0, -0.5, -1.0])
    fields, _ = tinker_sampling_params({"max_tokens": 8, "seed": 1, "stop": None})
    params = tinker.types.SamplingParams(**fields)
    assert (params.max_tokens, params.seed, params.top_k) == (8, 1, -1)
    assert set(tinker.types.AdamParams.model_fields) >= {"learning_rate", "beta1", "beta2", "eps"}


def test_sdk_errors_map_into_our_error_tree():
    tinker = pytest.importorskip("tinker")
    import httpx

    request = httpx.Request("POST", "http://127.0.0.1:9/api/v1/forward")
    assert isinstance(map_error(tinker.APIConnectionError(request=request), "forward"), RemoteConnectionError)
    err = map_error(ValueError("Error: 400 - {'detail': 'LoRA rank 64 must be between 1 and 32'}"), "create")
    assert getattr(err, "status", None) == 400 and "LoRA rank 64" in str(err)
    timeout = map_error(tinker.APITimeoutError(request=request), "forward")
    assert isinstance(timeout, RemoteTimeoutError) and timeout.endpoint == "forward"
    for status, cls in ((401, tinker.AuthenticationError), (429, tinker.RateLimitError),
                        (500, tinker.InternalServerError)):
        response = httpx.Response(status, request=request, json={"detail": "x"})
        err = map_error(cls("refused", response=response, body=None), "forward_backward")
        assert isinstance(err, RemoteServerError) and err.status == status, (cls, err)
        assert err.retryable == (status == 429)
    categories = {c.value: c for c in tinker.types.RequestErrorCategory}
    user = map_error(tinker.RequestFailedError("bad datum", "req-1", categories["user"]), "forward_backward")
    assert isinstance(user, RemoteServerError) and user.status == 400
    assert user.detail == {"request_id": "req-1", "category": "user"}
    server = map_error(tinker.RequestFailedError("engine died", "req-2", categories["server"]), "optim_step")
    assert isinstance(server, RemoteServerError) and server.status == 500 and "engine died" in str(server)
    assert isinstance(map_error(RuntimeError("odd"), "sample"), RemoteProtocolError)


#: set in the rerun of this module with the newest SDK (so that it does not rerun itself)
_NEWEST_SDK_RUN = "VERL_TINKER_NEWEST_SDK_RUN"


@pytest.mark.slow
def test_this_module_passes_with_the_newest_sdk_on_pypi(tmp_path):
    """The suite's venv has tinker 0.24.1 (the last SDK the open peer speaks); users of the hosted service get
    the newest. Rerun the tests above in a subprocess with the newest ``tinker`` on PyPI installed into an
    overlay directory ahead of the venv's site-packages. Its dependencies stay the venv's: a release that needs
    a new one fails here, naming it."""
    if os.environ.get(_NEWEST_SDK_RUN):
        pytest.skip("this is the rerun with the newest SDK")
    overlay = tmp_path / "newest-sdk"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                          "--no-deps", "--target", str(overlay), "tinker"],
                         capture_output=True, text=True, timeout=600, check=False)
    if pip.returncode != 0:
        skip_or_fail(f"could not install the newest tinker SDK from PyPI:\n{pip.stderr[-2000:]}")
    env = {**os.environ, _NEWEST_SDK_RUN: "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(overlay), os.environ.get("PYTHONPATH")) if p)}
    probe = subprocess.run([sys.executable, "-c", "import tinker; print(tinker.__version__, tinker.__file__)"],
                           env=env, capture_output=True, text=True, timeout=300, check=False)
    assert probe.returncode == 0, f"the newest tinker SDK does not import here:\n{probe.stderr[-3000:]}"
    version, where = probe.stdout.split()
    assert Path(where).is_relative_to(overlay), f"imported tinker {version} from {where}, not from the overlay"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          str(Path(__file__).resolve())], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, f"with tinker {version}:\n{run.stdout[-5000:]}\n{run.stderr[-2000:]}"
    print(f"tinker {version}: {run.stdout.strip().splitlines()[-1]}")
