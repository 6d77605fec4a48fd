"""Hostile input against the reference server (a real process): every case gets its 4xx, the server
stays healthy, and what it had already accepted is untouched.

This extends ``test_robustness_on_cpu.py`` (malformed frames, missing tensors, one dotted loss
name, the evil ``torch.save``, auth, one 413) with the rest of the matrix: lying DSSST1 headers,
pickle and zip bodies, wrong dtypes and shapes, NaN/inf in every place a number goes, negative and
huge lengths, mismatched batch sizes, every kind of dotted path as a loss, checkpoint paths that
leave the root (``..``, absolute, a symlink), unknown ids and wrong job types, oversized and lying
bodies, slow-loris heads and bodies (bounded by ``--head-timeout-s`` / ``--body-timeout-s``), and a
flood of concurrent requests (bounded by ``--limit-concurrency``: 503, retryable).

The server holds a trained training job (one optimizer step) through all of it; the last test
checks its step counter, its accumulated micro-batches and its log-probs are what they were.
Plus the client side: the bearer token is sent (and never put in a handle or a log), and the
server refuses a non-loopback bind without a token.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from tests.support.server import REPO_ROOT, decode, free_port, good_body, post_frame, running_server

pytestmark = pytest.mark.slow

TIMEOUT_S = 3  # --body-timeout-s and --head-timeout-s of the server under test
OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
DOTTED = ["os.system", "builtins.eval", "builtins.exec", "__import__", "subprocess.Popen",
          "verl.trainer.ppo.core_algos.compute_policy_loss", "arctic_rl.server.compute.losses.compute_loss", "grpo\x00",
          "", "GRPO"]


def frame(header: dict, data: bytes, *, header_len: int | None = None) -> bytes:
    """A hand-made safetensors/DSSST1 frame whose header may lie."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def dss(tree) -> dict:
    return {"__metadata__": {"dss": json.dumps({"v": "DSSST1", "tree": tree})}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    args = ("--max-body-mb", "1", "--body-timeout-s", str(TIMEOUT_S), "--head-timeout-s", str(TIMEOUT_S),
            "--limit-concurrency", "48")
    with running_server(tmp_path_factory.mktemp("server"), extra_args=args) as server:
        ids = {}
        for job_type in ("training", "log_prob", "sampling"):
            config = {"model_name": str(tiny_model_dir), "job_type": job_type, "checkpoint_path": "hostile"}
            ids[job_type] = decode(requests.post(server.url + "/initialize", json=config, timeout=300))["job_id"]
        server.ids = ids
        t = ids["training"]
        decode(post_frame(server, f"/forward-backward?job_id={t}", good_body()))
        decode(requests.post(f"{server.url}/step?job_id={t}", json={}, timeout=120))
        server.accepted = {"logprobs": forward_logprobs(server), **counters(server)}
        assert server.accepted["global_step"] == 1
        yield server


def forward_logprobs(server) -> torch.Tensor:
    body = good_body()
    return decode(post_frame(server, f"/forward?job_id={server.ids['training']}", body))["batch"]["logprobs"]


def counters(server) -> dict:
    info = requests.get(f"{server.url}/job/{server.ids['training']}", timeout=30).json()
    return {"global_step": info["global_step"], "pending_micro_batches": info["pending_micro_batches"]}


def healthy(server) -> None:
    assert requests.get(server.url + "/health", timeout=10).json()["status"] == "OK"


def expect(response, status, field=None):
    assert response.status_code == status, (response.status_code, response.text[:500])
    detail = response.json()["detail"]
    if field is not None:
        assert detail["field"] == field, detail
    return detail


# ------------------------------------------------------------------------------------------------ frames


I64 = b"\x01\x00\x00\x00\x00\x00\x00\x00"
LYING_FRAMES = [
    ("header_len 2^63", frame(dss(["t", "x"]), I64, header_len=2**63)),
    ("header_len past the end", frame(dss(["t", "x"]), I64, header_len=10_000)),
    ("shape larger than data", frame({**dss(["t", "x"]), "x": {"dtype": "I64", "shape": [2**31, 2**31],
                                                                "data_offsets": [0, 8]}}, I64)),
    ("bytes not a multiple of dtype", frame({**dss(["t", "x"]), "x": {"dtype": "F32", "shape": [1],
                                                                       "data_offsets": [0, 3]}}, b"\0" * 3)),
    ("negative dim", frame({**dss(["t", "x"]), "x": {"dtype": "I64", "shape": [-1], "data_offsets": [0, 8]}}, I64)),
    ("offsets overlap", frame({**dss(["d", [["a", ["t", "a"]], ["b", ["t", "b"]]]]),
                               "a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
                               "b": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, I64)),
    ("offsets leave a gap", frame({**dss(["t", "x"]), "x": {"dtype": "I64", "shape": [1],
                                                             "data_offsets": [8, 16]}}, I64 * 2)),
    ("unknown dtype", frame({**dss(["t", "x"]), "x": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 8]}}, I64)),
    ("header is a list", frame([1, 2, 3], b"")),  # type: ignore[arg-type]
    ("plain safetensors, no dss", frame({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, I64)),
    ("skeleton names a missing tensor", frame({**dss(["t", "nope"]), "x": {"dtype": "I64", "shape": [1],
                                                                            "data_offsets": [0, 8]}}, I64)),
    ("skeleton nested 50k deep", frame({"__metadata__": {
        "dss": '{"v": "DSSST1", "tree": ' + '["l", [' * 50_000 + ']]' * 50_000 + '}'}}, b"")),
    ("wrong wire version", frame({"__metadata__": {"dss": json.dumps({"v": "DSSST9", "tree": ["j", 1]})}}, b"")),
]


@pytest.mark.parametrize("name, data", LYING_FRAMES, ids=[n for n, _ in LYING_FRAMES])
def test_lying_dssst1_frames_are_400(srv, name, data):
    for path in ("/forward-backward", "/forward", "/generate"):
        job = srv.ids["sampling" if path == "/generate" else "training"]
        expect(requests.post(f"{srv.url}{path}?job_id={job}", data=data, headers=OCTET, timeout=60), 400, "body")
    healthy(srv)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/arctic_rl_pwned_by_pickle",))


def _zip(entries: dict[str, bytes], compression=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return buf.getvalue()


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


PICKLES = [
    ("raw pickle", pickle.dumps(_Boom(), protocol=2)),
    ("raw pickle proto 5", pickle.dumps({"batch": _Boom()}, protocol=5)),
    ("torch.save zip (benign)", _torch_save(good_body())),
    ("zip with a pickle inside", _zip({"archive/data.pkl": pickle.dumps(_Boom()), "archive/version": b"3\n"})),
    ("zip bomb (10 MB of zeros deflated)", _zip({"archive/data.pkl": b"\0" * 10_000_000})),
    ("random bytes", os.urandom(4096)),
]


@pytest.mark.parametrize("name, data", PICKLES, ids=[n for n, _ in PICKLES])
def test_pickle_and_zip_bodies_are_refused_without_running(srv, name, data):
    marker = "/tmp/arctic_rl_pwned_by_pickle"
    if os.path.exists(marker):
        os.remove(marker)
    t = srv.ids["training"]
    for path in (f"/forward-backward?job_id={t}", f"/forward?job_id={t}", f"/generate?job_id={srv.ids['sampling']}"):
        if name.startswith("torch.save") and "generate" in path:
            continue
        expect(requests.post(srv.url + path, data=data, headers=OCTET, timeout=60), 400, "body")
    if "torch.save" not in name:  # v1 paths read torch.save archives through the weights-only loader
        for path in (f"/fwd-bwd?job_id={t}", f"/fwd-no-grad?job_id={t}"):
            expect(requests.post(srv.url + path, data=data, headers=OCTET, timeout=60), 400, "body")
    expect(requests.post(srv.url + "/initialize", data=data, headers=JSON, timeout=60), 400, "body")
    assert not os.path.exists(marker)
    healthy(srv)


# ------------------------------------------------------------------------------------------------ batches


def with_batch(**changes):
    body = good_body()
    for key, value in changes.items():
        body["batch"][key] = value
    return body


B, L = 2, 6
BAD_BATCHES = [
    ("bool input_ids", with_batch(input_ids=torch.ones(B, L, dtype=torch.bool)), "batch.input_ids"),
    ("uint64-sized ids", with_batch(input_ids=torch.full((B, L), 2**40)), "batch.input_ids"),
    ("int advantages", with_batch(advantages=torch.ones(B, L, dtype=torch.int64)), "batch.advantages"),
    ("3-d input_ids", with_batch(input_ids=torch.zeros(B, L, 1, dtype=torch.long)), "batch.input_ids"),
    ("wide attention_mask", with_batch(attention_mask=torch.ones(B, L + 1, dtype=torch.long)),
     "batch.attention_mask"),
    ("zero rows", {"batch": {k: v[:0] for k, v in good_body()["batch"].items()}, "meta": {},
                   "processing": {"loss_fn": "grpo"}}, "batch.input_ids"),
    ("prompts has 3 rows", with_batch(prompts=torch.zeros(3, 3, dtype=torch.long)), "batch.prompts"),
    ("response_mask has 1 row", with_batch(response_mask=torch.ones(1, L, dtype=torch.long)), "batch.response_mask"),
    ("nan old_log_probs in padding", with_batch(old_log_probs=torch.tensor([[float("nan")] + [0.0] * 5] * 2)),
     "batch.old_log_probs"),
    ("inf rollout_is_weights", with_batch(rollout_is_weights=torch.full((B, L), float("inf"))),
     "batch.rollout_is_weights"),
    ("negative positions", with_batch(position_ids=torch.full((B, L), -3)), "batch.position_ids"),
]


@pytest.mark.parametrize("name, body, field", BAD_BATCHES, ids=[b[0] for b in BAD_BATCHES])
def test_wrong_dtypes_shapes_and_values_are_400(srv, name, body, field):
    expect(post_frame(srv, f"/forward-backward?job_id={srv.ids['training']}", body), 400, field)
    healthy(srv)


NON_FINITE = [
    ("meta temperature nan", {"meta": {"temperature": float("nan")}}, "meta.temperature"),
    ("meta temperature inf", {"meta": {"temperature": float("inf")}}, "meta.temperature"),
    ("clip_ratio inf", {"processing": {"loss_fn": "grpo", "config": {"clip_ratio": float("inf")}}},
     "processing.config.clip_ratio"),
    ("loss_scale_tokens nan", {"processing": {"loss_fn": "grpo", "config": {"loss_scale_tokens": float("nan")}}},
     "processing.config.loss_scale_tokens"),
    ("max_prompt_len negative", {"meta": {"max_prompt_len": -1}}, "meta.max_prompt_len"),
    ("rollout_n zero", {"meta": {"rollout_n": 0}}, "meta.rollout_n"),
    ("meta rollout_is_weights inf", {"meta": {"rollout_is_weights": torch.full((2, 6), float("inf"))}},
     "meta.rollout_is_weights"),
    ("meta rollout_is_weights shape", {"meta": {"rollout_is_weights": torch.ones(1, 11)}}, "meta.rollout_is_weights"),
    ("meta rollout_is_weights text", {"meta": {"rollout_is_weights": "all"}}, "meta.rollout_is_weights"),
    ("meta batch_num_tokens zero-d nan", {"meta": {"batch_num_tokens": torch.tensor(float("nan"))}},
     "meta.batch_num_tokens"),
    ("meta batch_num_tokens negative", {"meta": {"batch_num_tokens": -5}}, "meta.batch_num_tokens"),
]


@pytest.mark.parametrize("name, change, field", NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_non_finite_and_out_of_range_numbers_are_400(srv, name, change, field):
    body = good_body()
    body.update(change)
    expect(post_frame(srv, f"/forward-backward?job_id={srv.ids['training']}", body), 400, field)
    t = srv.ids["training"]
    for text in ('{"learning_rate": NaN}', '{"learning_rate": Infinity}', '{"learning_rate": -Infinity}'):
        expect(requests.post(f"{srv.url}/step?job_id={t}", data=text, headers=JSON, timeout=30), 400, "learning_rate")
    healthy(srv)


@pytest.mark.parametrize("loss", DOTTED)
def test_any_dotted_path_as_a_loss_is_400_on_every_path(srv, loss):
    t = srv.ids["training"]
    for path in ("/forward-backward", "/forward"):
        detail = expect(post_frame(srv, f"{path}?job_id={t}", good_body(loss_fn=loss)), 400, "processing.loss_fn")
        assert "verl_grpo" in detail["allowed"] and loss not in detail["allowed"]
    body = good_body()
    body["processing"]["post"] = [loss or "x"]
    expect(post_frame(srv, f"/forward-backward?job_id={t}", body), 400, "processing.post")
    healthy(srv)


GENERATE = [
    ("max_tokens 0", {"max_tokens": 0}, "sampling_params.max_tokens"),
    ("max_tokens -1", {"max_tokens": -1}, "sampling_params.max_tokens"),
    ("max_tokens 10^12", {"max_tokens": 10**12}, "sampling_params.max_tokens"),
    ("n 0", {"n": 0}, "sampling_params.n"),
    ("n 10^6", {"n": 10**6}, "sampling_params.n"),
    ("temperature inf", {"temperature": float("inf")}, "sampling_params.temperature"),
    ("temperature nan", {"temperature": float("nan")}, "sampling_params.temperature"),
    ("top_p 0", {"top_p": 0.0}, "sampling_params.top_p"),
    ("top_k -5", {"top_k": -5}, "sampling_params.top_k"),
    ("seed 2^70", {"seed": 2**70}, "sampling_params.seed"),
    ("stop id out of vocab", {"stop_token_ids": [10**9]}, "sampling_params.stop_token_ids"),
    ("unknown knob", {"max_tokens": 2, "best_of": 4}, "sampling_params.best_of"),
]


@pytest.mark.parametrize("name, params, field", GENERATE, ids=[g[0] for g in GENERATE])
def test_generation_lengths_and_numbers_are_bounded(srv, name, params, field):
    job = srv.ids["sampling"]
    expect(post_frame(srv, f"/generate?job_id={job}", {"prompts": [[5, 6]], "sampling_params": params}), 400, field)
    healthy(srv)


def test_generation_prompt_abuse(srv):
    job = srv.ids["sampling"]
    url = f"/generate?job_id={job}"
    expect(post_frame(srv, url, {"prompts": [[5]] * 70_000, "sampling_params": {"max_tokens": 1}}), 400)
    expect(post_frame(srv, url, {"prompts": [], "sampling_params": {}}), 400, "prompts")
    expect(post_frame(srv, url, {"prompts": [[-1]], "sampling_params": {"max_tokens": 1}}), 400, "prompts.0")
    expect(post_frame(srv, url, {"prompts": [[5] * 5000], "sampling_params": {"max_tokens": 1}}), 400)
    expect(post_frame(srv, url, {"prompts": "abc"}), 400, "prompts")
    healthy(srv)


# ------------------------------------------------------------------------------------------------ control


def test_checkpoint_paths_outside_the_root_are_400(srv, tmp_path):
    t = srv.ids["training"]
    outside = tmp_path / "outside"
    outside.mkdir()
    link = srv.checkpoint_root / "escape"
    link.symlink_to(outside, target_is_directory=True)
    try:
        cases = ["../x", "a/../../b", "/etc", "/tmp", str(outside), "escape", "escape/sub", "x\x00y", "",
                 str(srv.checkpoint_root / ".." / "x")]
        for path in cases:
            expect(requests.post(f"{srv.url}/save?job_id={t}", json={"path": path}, timeout=60), 400, "path")
            expect(requests.post(f"{srv.url}/load-checkpoint?job_id={t}", json={"path": path}, timeout=60), 400,
                   "path")
        assert list(outside.iterdir()) == []
        expect(requests.post(f"{srv.url}/load-checkpoint?job_id={t}", json={"step": 987654}, timeout=60), 404)
        expect(requests.post(f"{srv.url}/load-checkpoint?job_id={t}", json={"step": -1}, timeout=60), 400, "step")
        expect(requests.post(srv.url + "/initialize", json={"model_name": "x", "job_type": "training",
                                                            "checkpoint_path": "/etc/../../etc"}, timeout=60),
               400, "checkpoint_path")
    finally:
        link.unlink()
    healthy(srv)


def test_unknown_ids_and_wrong_job_types(srv):
    ids, u = srv.ids, srv.url
    for job in (0, -1, 2**70):
        expect(requests.post(f"{u}/step?job_id={job}", json={}, timeout=30), 404, "job_id")
        expect(requests.get(f"{u}/job/{job}", timeout=30), 404, "job_id")
    for job in ("abc", "1.5", ""):
        expect(requests.post(f"{u}/step?job_id={job}", json={}, timeout=30), 422, "job_id")
    expect(requests.post(f"{u}/step?job_id={ids['sampling']}", json={}, timeout=30), 400, "job_id")
    expect(requests.post(f"{u}/save?job_id={ids['log_prob']}", json={}, timeout=30), 400, "job_id")
    expect(requests.post(f"{u}/load-checkpoint?job_id={ids['sampling']}", json={}, timeout=30), 400, "job_id")
    expect(post_frame(srv, f"/generate?job_id={ids['log_prob']}", {"prompts": [[5]]}), 400, "job_id")
    expect(post_frame(srv, f"/forward-backward?job_id={ids['sampling']}", good_body()), 400, "job_id")
    sync = {"source_sub_job_id": ids["training"], "target_sub_job_ids": [ids["training"]]}
    expect(requests.post(f"{u}/weight-sync?job_id={ids['training']}", json=sync, timeout=30), 400)
    sync = {"source_sub_job_id": ids["sampling"], "target_sub_job_ids": [ids["sampling"]]}
    expect(requests.post(f"{u}/weight-sync?job_id={ids['sampling']}", json=sync, timeout=30), 400)
    expect(requests.post(f"{u}/initialize", json={"model_name": "x", "job_type": "log_prob", "seed": 2**70},
                         timeout=30), 400, "seed")
    deep = "[" * 100_000 + "]" * 100_000
    expect(requests.post(f"{u}/initialize", data=deep, headers=JSON, timeout=30), 400, "body")
    expect(requests.post(f"{u}/step?job_id={ids['training']}", data=deep, headers=JSON, timeout=30), 400, "body")
    healthy(srv)


# ------------------------------------------------------------------------------------------------ transport


def _raw(port: int, data: bytes, *, read_s: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def test_oversized_and_lying_bodies(srv):
    t = srv.ids["training"]
    big = b"\0" * (2 * 1024 * 1024)  # the server was started with --max-body-mb 1
    expect(requests.post(f"{srv.url}/forward-backward?job_id={t}", data=big, headers=OCTET, timeout=60), 413, "body")

    def chunks():
        for _ in range(32):
            yield b"\0" * 65536

    expect(requests.post(f"{srv.url}/forward?job_id={t}", data=chunks(), headers=OCTET, timeout=60), 413, "body")
    # Content-Length claims 1 TB but 100 bytes come: the server drains (so honest clients can read
    # their 413) -- bounded by --body-timeout-s, then it answers and closes
    head = (f"POST /forward-backward?job_id={t} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {10**12}\r\n\r\n").encode()
    t0 = time.monotonic()
    answer = _raw(srv.port, head + b"\0" * 100, read_s=TIMEOUT_S + 5)
    assert answer.startswith((b"HTTP/1.1 413", b"HTTP/1.1 408")), answer[:200]
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    # a 1 MB request head arriving in pieces: over h11's limit on an incomplete head
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: ")
        answer = b""
        try:
            for _ in range(16):
                sock.sendall(b"a" * 65536)
                time.sleep(0.02)
        except OSError:  # the server already answered and closed
            pass
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
    assert answer.startswith(b"HTTP/1.1 4"), answer[:200]
    healthy(srv)


@pytest.mark.parametrize("kind", ["body", "head"])
def test_slow_loris_is_cut_off_and_the_server_stays_healthy(srv, kind):
    if kind == "body":
        start = (b"POST /initialize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{")
    else:
        start = b"POST /initialize HTTP/1.1\r\nHost: x\r\n"
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(start)
        s.settimeout(0.25)
        answer, closed = b"", False
        while time.monotonic() - t0 < TIMEOUT_S + 15:
            try:
                s.sendall(b" " if kind == "body" else b"X")  # one byte every 0.25 s: never idle
            except OSError:
                closed = True
                break
            try:
                chunk = s.recv(4096)
                if not chunk:
                    closed = True
                    break
                answer += chunk
            except TimeoutError:
                pass
            if kind == "body" and answer:  # it answered: /health must work meanwhile too
                healthy(srv)
        elapsed = time.monotonic() - t0
    assert closed, f"still open after {elapsed:.1f} s"
    assert elapsed < TIMEOUT_S + 5, elapsed
    if kind == "body":
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body-timeout-s" in answer
    healthy(srv)


def test_flood_of_concurrent_requests_is_bounded(srv):
    """300 requests at once (status reads, garbage frames, bad generations) against
    --limit-concurrency 48: each is answered -- 200, its 4xx, or 503 (retryable) -- none hangs."""
    t, s = srv.ids["training"], srv.ids["sampling"]

    def one(i: int) -> int:
        kind = i % 3
        try:
            if kind == 0:
                r = requests.get(srv.url + "/status", timeout=60)
            elif kind == 1:
                r = requests.post(f"{srv.url}/forward-backward?job_id={t}", data=os.urandom(512), headers=OCTET,
                                  timeout=60)
            else:
                r = post_frame(srv, f"/generate?job_id={s}", {"prompts": [[5]], "sampling_params": {"n": 0}},
                               timeout=60)
            return r.status_code
        except requests.ConnectionError:
            return -1  # refused/reset under load: a client retries it

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=100) as pool:
        statuses = list(pool.map(one, range(300)))
    elapsed = time.monotonic() - t0
    assert set(statuses) <= {200, 400, 503, -1}, sorted(set(statuses))
    assert statuses.count(200) > 0 and statuses.count(400) > 0
    assert statuses.count(-1) <= 30, statuses.count(-1)
    assert elapsed < 120
    healthy(srv)


def test_nothing_accepted_was_lost(srv):
    """After all of the above: the step counter, the (empty) accumulation and the weights are unchanged."""
    assert counters(srv) == {k: srv.accepted[k] for k in ("global_step", "pending_micro_batches")}
    assert torch.equal(forward_logprobs(srv), srv.accepted["logprobs"])
    status = requests.get(srv.url + "/status", timeout=30).json()
    assert sorted(int(k) for k in status["jobs"]) == sorted(srv.ids.values())
    healthy(srv)


# ------------------------------------------------------------------------------------------------ auth


def test_client_sends_the_token_and_never_leaks_it(tmp_path, caplog, monkeypatch):
    from verl.remote_backend.errors import RemoteServerError
    from verl.workers.remote_client.arctic.arctic_config import RetryConfig, TimeoutsConfig
    from verl.workers.remote_client.arctic.http import TOKEN_ENV, ArcticHttp

    caplog.set_level(logging.DEBUG)
    token = "tok-" + os.urandom(8).hex()
    with running_server(tmp_path, token=token) as locked:
        def http(tok):
            return ArcticHttp(locked.url, timeouts=TimeoutsConfig(), retry=RetryConfig(max_attempts=1), token=tok)

        assert http(token).get_json("/status")["status"] == "OK"
        monkeypatch.setenv(TOKEN_ENV, token)
        assert http(None).get_json("/status")["status"] == "OK"  # from $ARCTIC_RL_TOKEN
        monkeypatch.delenv(TOKEN_ENV)
        for wrong in (None, token + "x"):
            with pytest.raises(RemoteServerError) as err:
                http(wrong).post_json("/initialize", {"model_name": "x"})
            assert err.value.status == 401 and "bearer token" in str(err.value)
        assert token not in repr(http(token)) and token not in caplog.text


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_non_loopback_bind_needs_a_token_or_the_insecure_flag(host):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("ARCTIC_RL_SERVER_TOKEN", None)
    cmd = [sys.executable, "-m", "arctic_rl.server", "--host", host, "--port", str(free_port())]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "refusing to bind" in refused.stderr
    if host == "192.0.2.1":  # TEST-NET-1: never this machine's address, so the bind itself fails
        insecure = subprocess.run(cmd + ["--insecure-no-token"], env=env, capture_output=True, text=True,
                                  timeout=300, check=False)
        assert "INSECURE" in insecure.stderr and "refusing to bind" not in insecure.stderr
        assert insecure.returncode != 0  # could not bind 192.0.2.1
