"""Bad input, auth, size limits and the v1 paths of the reference server (real server processes).

Every malformed request gets its 4xx with a JSON ``detail`` naming the field, and the server stays
healthy; a pickle that would run code when unpickled is refused without running it.
"""

import io
import json
import os
import pathlib
import subprocess
import sys

import pytest
import requests
import torch

from arctic_rl import dssst1
from arctic_rl.protocol import LOSS_NAMES, POST_PROCESSORS
from tests.support.server import REPO_ROOT, decode, free_port, good_body, make_batch, post_frame, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(reference_server, tiny_model_dir):
    """The module's server, holding one job of each type (``srv.ids``)."""
    ids = {}
    for job_type in ("training", "log_prob", "sampling"):
        config = {"model_name": str(tiny_model_dir), "job_type": job_type, "checkpoint_path": "rb"}
        ids[job_type] = decode(requests.post(reference_server.url + "/initialize", json=config, timeout=300))["job_id"]
    reference_server.ids = ids
    return reference_server


def with_token(token):
    """A consistent body (input_ids == prompts | responses) holding ``token`` in a response."""
    body = good_body()
    fresh = make_batch([[5, 6, 7], [8, 9]], [[10, token, 12], [13]])
    body["batch"].update({k: fresh[k] for k in ("input_ids", "prompts", "responses")})
    return body


def with_change(section, key, value):
    body = good_body()
    if value is None:
        body[section].pop(key)
    else:
        body[section][key] = value
    return body


def assert_error(response, status, field=None):
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert set(detail) >= {"message", "field", "allowed", "received"} and detail["message"]
    if field is not None:
        assert detail["field"] == field, detail
    return detail


FB = "/forward-backward?job_id={training}"
BAD_FRAMES = [
    (b"\x00" * 3, "short"),
    (b"\xff" * 64, "garbage"),
    (bytes(dssst1.dumps(good_body()))[:-7], "truncated"),
    (json.dumps({"batch": {}}).encode(), "json"),
    (b"", "empty"),
]


@pytest.mark.parametrize("data, name", BAD_FRAMES, ids=[n for _, n in BAD_FRAMES])
def test_malformed_frames_are_400(srv, data, name):
    response = requests.post(
        srv.url + FB.format(**srv.ids), data=data, headers={"Content-Type": "application/octet-stream"}
    )
    assert_error(response, 400, "body")
    assert requests.get(srv.url + "/health").status_code == 200


BAD_BODIES = [
    ("missing tensor", with_change("batch", "old_log_probs", None), "batch.old_log_probs"),
    ("float ids", with_change("batch", "input_ids", torch.zeros(2, 6)), "batch.input_ids"),
    ("batch sizes", with_change("batch", "advantages", torch.zeros(3, 6)), "batch.advantages"),
    ("nan advantages", with_change("batch", "advantages", torch.full((2, 6), float("nan"))), "batch.advantages"),
    (
        "inf old_log_probs",
        with_change("batch", "old_log_probs", torch.full((2, 6), float("-inf"))),
        "batch.old_log_probs",
    ),
    ("vocab range", with_token(10_000), "batch.input_ids"),
    ("negative ids", with_token(-1), "batch.input_ids"),
    ("ids disagree", with_change("batch", "responses", torch.zeros(2, 3, dtype=torch.long)), "batch.input_ids"),
    ("1-d tensor", with_change("batch", "attention_mask", torch.ones(6)), "batch.attention_mask"),
    ("not a tensor", with_change("batch", "position_ids", [[0, 1]]), "batch.position_ids"),
    ("unknown loss", with_change("processing", "loss_fn", "arctic_platform.evil.loss"), "processing.loss_fn"),
    ("unknown post", with_change("processing", "post", "os.system"), "processing.post"),
    (
        "bad loss config",
        with_change("processing", "config", {"loss_agg_mode": "max"}),
        "processing.config.loss_agg_mode",
    ),
    ("bad meta", with_change("meta", "temperature", 0), "meta.temperature"),
    ("not a dict", [1, 2, 3], "body"),
]


@pytest.mark.parametrize("name, body, field", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_are_400_naming_the_field(srv, name, body, field):
    detail = assert_error(post_frame(srv, FB.format(**srv.ids), body), 400, field)
    if name == "unknown loss":
        assert detail["allowed"] == list(LOSS_NAMES)
    if name == "unknown post":
        assert detail["allowed"] == list(POST_PROCESSORS)
    assert requests.get(srv.url + "/health").status_code == 200
    info = requests.get(f"{srv.url}/job/{srv.ids['training']}").json()
    assert info["pending_micro_batches"] == 0  # nothing was accumulated


def test_jobs_and_control_calls(srv, tiny_model_dir):
    ids = srv.ids
    assert_error(post_frame(srv, "/forward-backward?job_id=999", good_body()), 404, "job_id")
    assert_error(post_frame(srv, f"/forward-backward?job_id={ids['log_prob']}", good_body()), 400, "job_id")
    assert_error(post_frame(srv, f"/forward?job_id={ids['sampling']}", good_body()), 400, "job_id")
    assert_error(post_frame(srv, f"/generate?job_id={ids['training']}", {"prompts": ["a"]}), 400, "job_id")
    assert_error(post_frame(srv, "/forward-backward", good_body()), 422, "job_id")
    assert_error(requests.get(srv.url + "/job/abc"), 422, "job_id")
    post = lambda path, **kw: requests.post(srv.url + path, timeout=60, **kw)
    assert_error(post("/initialize", json={"model_name": str(tiny_model_dir), "job_type": "training"}), 409, "job_type")
    assert_error(post("/initialize", json={"model_name": str(tiny_model_dir), "job_type": "trainer"}), 400, "job_type")
    assert_error(post("/initialize", json={"job_type": "training"}), 400, "model_name")
    assert_error(post("/initialize", data=b"{not json", headers={"Content-Type": "application/json"}), 400, "body")
    assert_error(post("/initialize", json={"model_name": "/no/such/model", "job_type": "training"}), 409)
    assert_error(post(f"/step?job_id={ids['training']}", json={"learning_rate": "fast"}), 400, "learning_rate")
    assert_error(post(f"/step?job_id={ids['training']}", json={"lr": 1.0}), 400, "lr")
    assert_error(post(f"/step?job_id={ids['training']}"), 400, "ds_config.gradient_accumulation_steps")
    assert_error(
        post(f"/weight-sync?job_id={ids['training']}", json={"target_sub_job_ids": [ids["sampling"]]}),
        400,
        "source_sub_job_id",
    )
    assert_error(post(f"/destroy?job_id={ids['sampling']}", json={"job_type": "training"}), 400, "job_type")
    assert_error(post("/destroy?job_id=999", json={"job_type": "training"}), 404)
    assert_error(post(f"/save?job_id={ids['training']}", json={"step": -1}), 400, "step")
    assert requests.get(srv.url + "/health").status_code == 200
    status = requests.get(srv.url + "/status").json()
    assert sorted(status["jobs"]) == sorted(str(i) for i in ids.values())


def test_unloadable_model_is_400(srv, tiny_model_dir):
    # the log_prob slot is taken: destroy it, fail to create one, create it again
    ids = srv.ids
    decode(requests.post(f"{srv.url}/destroy?job_id={ids['log_prob']}", json={"job_type": "log_prob"}))
    bad = requests.post(srv.url + "/initialize", json={"model_name": "/no/such/model", "job_type": "log_prob"})
    assert_error(bad, 400, "model_name")
    body = {"model_name": str(tiny_model_dir), "job_type": "log_prob"}
    again = decode(requests.post(srv.url + "/initialize", json=body))
    assert again["job_id"] > ids["log_prob"]
    ids["log_prob"] = again["job_id"]


class _Evil:
    """Unpickling this object would create ``marker`` (what a remote-code-execution payload does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_v1_paths_with_torch_save_bodies(srv):
    from arctic_rl.v1compat import torch_load_safe, torch_save_bytes

    ids, body = srv.ids, good_body()
    headers = {"Content-Type": "application/octet-stream"}
    v1 = requests.post(f"{srv.url}/fwd-no-grad?job_id={ids['training']}", data=torch_save_bytes(body), headers=headers)
    v2 = decode(post_frame(srv, f"/forward?job_id={ids['training']}", body))
    assert v1.status_code == 200
    v1_out = torch_load_safe(v1.content)
    assert torch.equal(v1_out["batch"]["logprobs"], v2["batch"]["logprobs"])
    fb = requests.post(f"{srv.url}/fwd-bwd?job_id={ids['training']}", data=torch_save_bytes(body), headers=headers)
    assert fb.status_code == 200 and torch_load_safe(fb.content)["metrics"]["micro_batches"] == 1
    assert decode(requests.post(f"{srv.url}/step?job_id={ids['training']}"))["metrics"]["global_step"] >= 1
    saved = decode(requests.post(f"{srv.url}/save-checkpoint?job_id={ids['training']}"))
    assert pathlib.Path(saved["path"]).is_dir()
    sync = requests.post(
        f"{srv.url}/sync-weights", json={"training_job_id": ids["training"], "sampling_job_id": ids["sampling"]}
    )
    assert sync.status_code == 200 and sync.json()["synced"] == [ids["sampling"]]


def test_malicious_pickle_is_refused_without_running(srv, tmp_path):
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"batch": {"input_ids": _Evil(marker)}, "meta": {}, "processing": {}}, buffer)
    payload = buffer.getvalue()
    assert not marker.exists()
    headers = {"Content-Type": "application/octet-stream"}
    for path in ("/fwd-bwd", "/fwd-no-grad", "/forward-backward", "/forward"):
        response = requests.post(f"{srv.url}{path}?job_id={srv.ids['training']}", data=payload, headers=headers)
        assert_error(response, 400, "body")
    assert not marker.exists()
    assert requests.get(srv.url + "/health").status_code == 200


def test_auth_and_body_limit(tmp_path):
    with running_server(tmp_path, token="s3cret-token", extra_args=("--max-body-mb", "0.05")) as locked:
        assert requests.get(locked.url + "/health").status_code == 200  # open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
            for method, path in (("get", "/status"), ("post", "/initialize"), ("get", "/no-such-path")):
                response = getattr(requests, method)(locked.url + path, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.headers["WWW-Authenticate"] == "Bearer"
                assert response.json()["detail"]["field"] == "Authorization"
        assert requests.get(locked.url + "/status", headers=locked.headers).status_code == 200
        big = {"batch": {"input_ids": torch.zeros(200, 100, dtype=torch.long)}}  # ~160 kB > 50 kB
        response = post_frame(locked, "/forward-backward?job_id=1", big)
        assert_error(response, 413, "body")
        assert response.json()["detail"]["allowed"] == int(0.05 * 1024 * 1024)
        assert requests.get(locked.url + "/status", headers=locked.headers).status_code == 200


def test_refuses_non_loopback_bind_without_token():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    # 192.0.2.1 is TEST-NET-1: never this machine's address, so nothing could be exposed even on failure
    cmd = [sys.executable, "-m", "arctic_rl.server", "--host", "192.0.2.1", "--port", str(free_port())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "--token" in proc.stderr and "192.0.2.1" in proc.stderr
