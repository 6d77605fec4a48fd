"""Checkpoints of the reference server, against a real server process that is killed and restarted.

Covers: save -> SIGKILL -> restart -> initialize -> load gives a next step (losses, grad norm, LR
schedule, weights) bit-for-bit equal to the uninterrupted run; ``save_total_limit`` pruning; the
``export_hf`` directory loads with ``transformers``; request paths cannot escape the checkpoint root.
"""

import pathlib

import pytest
import requests
import torch

from tests.support.server import decode, make_batch, post_frame

pytestmark = pytest.mark.slow


def initialize(server, config: dict) -> dict:
    return decode(requests.post(server.url + "/initialize", json=config, timeout=300))


def training_config(model_dir, checkpoint_path="run"):
    return {
        "model_name": str(model_dir),
        "job_type": "training",
        "checkpoint_path": checkpoint_path,
        "ds_config": {
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 6, "warmup_type": "linear"},
            },
        },
    }


def bodies():
    batch_a = make_batch([[5, 6, 7], [8, 9]], [[20, 21, 22], [23]])
    batch_b = make_batch([[10, 11], [12, 13, 14]], [[24, 25], [26, 27, 28]])
    return [{"batch": b, "meta": {}, "processing": {"loss_fn": "sft"}} for b in (batch_a, batch_b)]


def train_step(srv, job_id):
    """One mini-batch: one /forward-backward of both batches' rows (the server splits it into its 2
    micro-batches), then /step."""
    batch = make_batch([[5, 6, 7], [8, 9], [10, 11], [12, 13, 14]], [[20, 21, 22], [23], [24, 25], [26, 27, 28]])
    body = {"batch": batch, "meta": {}, "processing": {"loss_fn": "sft"}}
    losses = [decode(post_frame(srv, f"/forward-backward?job_id={job_id}", body))["metrics"]["loss"]]
    return losses, decode(requests.post(f"{srv.url}/step?job_id={job_id}", json={}, timeout=60))["metrics"]


def probe(srv, job_id):
    return decode(post_frame(srv, f"/forward?job_id={job_id}", bodies()[0]))["batch"]["logprobs"]


def hf_weights(path):
    from safetensors.torch import load_file

    return load_file(str(pathlib.Path(path) / "model.safetensors"))


def save(srv, job_id, **body):
    response = requests.post(f"{srv.url}/save?job_id={job_id}", json=body, timeout=120)
    return response


def test_resume_after_a_kill_is_bit_for_bit(reference_server, tiny_model_dir):
    init = initialize(reference_server, training_config(tiny_model_dir))
    jid = init["job_id"]
    for _ in range(2):
        train_step(reference_server, jid)
    saved = decode(save(reference_server, jid))
    assert saved["global_step"] == 2 and saved["path"].endswith("run/checkpoint-2")
    assert (reference_server.checkpoint_root / "run" / "latest").read_text() == "checkpoint-2"
    losses, metrics = train_step(reference_server, jid)  # the uninterrupted step 3
    logprobs = probe(reference_server, jid)
    weights = hf_weights(decode(save(reference_server, jid, path="uninterrupted", export_hf=True))["hf_path"])

    instance = requests.get(reference_server.url + "/health").json()["instance_id"]
    reference_server.restart()  # SIGKILL: no chance to flush anything
    assert requests.get(reference_server.url + "/health").json()["instance_id"] != instance
    assert requests.get(reference_server.url + "/status").json()["jobs"] == {}

    jid = initialize(reference_server, training_config(tiny_model_dir))["job_id"]
    loaded = decode(requests.post(f"{reference_server.url}/load-checkpoint?job_id={jid}", json={}, timeout=120))
    assert loaded["global_step"] == 2 and loaded["path"] == saved["path"]
    losses2, metrics2 = train_step(reference_server, jid)
    assert losses2 == losses
    assert metrics2 == metrics and metrics2["global_step"] == 3
    assert torch.equal(probe(reference_server, jid), logprobs)
    weights2 = hf_weights(decode(save(reference_server, jid, path="resumed", export_hf=True))["hf_path"])
    assert weights2.keys() == weights.keys() and all(torch.equal(weights2[k], weights[k]) for k in weights)
    requests.post(f"{reference_server.url}/destroy?job_id={jid}", json={"job_type": "training"}, timeout=60)


def test_total_limit_export_hf_and_explicit_steps(reference_server, tiny_model_dir):
    jid = initialize(reference_server, training_config(tiny_model_dir, "limits"))["job_id"]
    try:
        for step in (1, 2, 3):
            out = decode(save(reference_server, jid, step=step, save_total_limit=2))
            assert out["path"].endswith(f"limits/checkpoint-{step}")
        assert out["pruned"] == [str(reference_server.checkpoint_root / "limits" / "checkpoint-1")]
        assert sorted(p.name for p in (reference_server.checkpoint_root / "limits").glob("checkpoint-*")) == [
            "checkpoint-2",
            "checkpoint-3",
        ]
        loaded = decode(requests.post(f"{reference_server.url}/load-checkpoint?job_id={jid}", json={"step": 2},
                                      timeout=60))
        assert loaded["path"].endswith("checkpoint-2")
        missing = requests.post(f"{reference_server.url}/load-checkpoint?job_id={jid}", json={"step": 1}, timeout=60)
        assert missing.status_code == 404

        exported = decode(save(reference_server, jid, path="export", export_hf=True))
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(exported["hf_path"], dtype=torch.float32).eval()
        assert AutoTokenizer.from_pretrained(exported["hf_path"]).eos_token == "<|im_end|>"
        batch = bodies()[0]["batch"]
        with torch.no_grad():
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).logits
        lp = (
            torch.log_softmax(logits[:, :-1].float(), -1)
            .gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1))
            .squeeze(-1)
        )
        real = batch["response_mask"][:, 1:].bool()
        assert torch.allclose(probe(reference_server, jid)[:, :-1][real], lp[real], atol=1e-5)
    finally:
        requests.post(f"{reference_server.url}/destroy?job_id={jid}", json={"job_type": "training"}, timeout=60)


def test_paths_cannot_escape_the_checkpoint_root(reference_server, tiny_model_dir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (reference_server.checkpoint_root / "link-out").symlink_to(outside, target_is_directory=True)
    bad_config = training_config(tiny_model_dir, "../../escape")
    response = requests.post(reference_server.url + "/initialize", json=bad_config, timeout=60)
    assert response.status_code == 400 and response.json()["detail"]["field"] == "checkpoint_path"
    jid = initialize(reference_server, training_config(tiny_model_dir, "safe"))["job_id"]
    try:
        for path in ("../x", "a/../../x", str(outside), "link-out", "link-out/deeper", "/etc"):
            for endpoint in ("save", "load-checkpoint"):
                r = requests.post(f"{reference_server.url}/{endpoint}?job_id={jid}", json={"path": path}, timeout=60)
                assert r.status_code == 400, (endpoint, path, r.text)
                assert r.json()["detail"]["field"] == "path"
        assert list(outside.iterdir()) == []
        assert requests.get(reference_server.url + "/health").status_code == 200
    finally:
        requests.post(f"{reference_server.url}/destroy?job_id={jid}", json={"job_type": "training"}, timeout=60)
