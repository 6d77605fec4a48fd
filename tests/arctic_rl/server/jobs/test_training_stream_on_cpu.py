"""``--training-stream``: the training and log_prob jobs' calls on a CUDA stream apart from the sampler's
(``jobs/training_stream.py``).

On a CPU the stream changes nothing: a call is a plain call and no CUDA function runs (checked by making every CUDA
entry point the module uses raise), whatever the mode; a sampler never runs on it. A server started with
``--training-stream on`` trains, syncs weights and generates as one without it. The stream itself runs on a GPU:
``test_training_stream_gpu.py``.
"""

from __future__ import annotations

import pytest
import requests
import torch

from arctic_rl.protocol import JobType
from arctic_rl.server.jobs.training_stream import TrainingStream
from arctic_rl.server.settings import ServerSettings
from tests.support.server import decode, make_batch, post_frame, running_server


@pytest.fixture
def no_cuda(monkeypatch):
    """Every CUDA entry point training_stream uses fails the test if called."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a CUDA function was called")

    for name in ("synchronize", "Stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_the_mode_is_checked_naming_the_field():
    with pytest.raises(ValueError, match=r"training_stream: expected one of \['on', 'off'\], got 'yes'"):
        TrainingStream("yes")
    with pytest.raises(ValueError, match=r"training_stream: expected one of \['on', 'off'\], got 'true'"):
        ServerSettings(training_stream="true")
    assert ServerSettings().training_stream == "off"


@pytest.mark.parametrize("mode", ["on", "off"])
def test_on_a_cpu_a_call_is_a_plain_call(no_cuda, mode):
    stream = TrainingStream(mode)
    assert stream.call(1, JobType.TRAINING, torch.device("cpu"), lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError, match="raised inside"):
        stream.call(1, JobType.LOG_PROB, "cpu", lambda: {}["raised inside"])
    assert stream.stream is None
    stream.settle("cpu")
    stream.drop(1)


@pytest.mark.parametrize(("mode", "job_type"), [("on", JobType.SAMPLING), ("off", JobType.TRAINING),
                                                ("off", JobType.LOG_PROB)])
def test_no_stream_for_a_sampler_or_when_off_even_on_cuda(no_cuda, mode, job_type):
    stream = TrainingStream(mode)
    assert stream.call(7, job_type, "cuda:0", lambda: "ran") == "ran"
    assert stream.stream is None
    if mode == "off":
        stream.settle("cuda:0")  # nothing to wait for when off


def test_a_server_with_the_training_stream_on_trains_syncs_and_generates(tmp_path, tiny_model_dir):
    with running_server(tmp_path, extra_args=["--training-stream", "on"]) as srv:
        url = srv.url
        training = decode(requests.post(url + "/initialize", timeout=300, json={
            "model_name": str(tiny_model_dir), "job_type": "training", "checkpoint_path": "train",
            "ds_config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}}))["job_id"]
        sampling = decode(requests.post(url + "/initialize", timeout=300,
                                        json={"model_name": str(tiny_model_dir), "job_type": "sampling"}))["job_id"]
        batch = make_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]])
        batch["advantages"] = batch["response_mask"].float()
        batch["old_log_probs"] = torch.zeros(batch["input_ids"].shape)
        body = {"batch": batch, "meta": {}, "processing": {"loss_fn": "grpo", "config": {}}}
        fb = post_frame(srv, f"/forward-backward?job_id={training}", body)
        assert fb.status_code == 200, fb.text
        assert requests.post(f"{url}/step?job_id={training}", json={}, timeout=120).status_code == 200
        synced = requests.post(f"{url}/weight-sync?job_id={training}", timeout=120, json={
            "source_sub_job_id": training, "target_sub_job_ids": [sampling]})
        assert synced.status_code == 200 and synced.json()["synced"] == [sampling], synced.text
        answer = decode(post_frame(srv, f"/generate?job_id={sampling}", {
            "prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 3, "ignore_eos": True, "temperature": 0.0}}))
        assert answer["results"][0]["generation_len"] == 3
        assert answer["weight_version"] == synced.json()["weight_version"]
