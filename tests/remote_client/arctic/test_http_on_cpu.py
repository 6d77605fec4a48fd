"""The Arctic adapter's HTTP layer (verl/workers/remote_client/arctic/http.py, wire.py).

A tiny scripted HTTP server runs in a thread (stdlib ``http.server``): each test queues the
answers it needs -- error bodies in the shapes servers really send, 503 bursts, dropped
connections, slow answers -- and inspects what the client sent. This is for the transport only;
the adapter's behaviour against the real reference server is tested in
``test_client_integration_on_cpu.py``.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import torch

from arctic_rl import dssst1
from arctic_rl.protocol import ProtocolVersion
from arctic_rl.v1compat import torch_save_bytes
from verl.remote_backend.errors import (
    RemoteConnectionError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
    RemoteServerError,
    RemoteTimeoutError,
)
from verl.workers.remote_client.arctic.arctic_config import RetryConfig, TimeoutsConfig
from verl.workers.remote_client.arctic.http import TOKEN_ENV, ArcticHttp
from verl.workers.remote_client.arctic.wire import decode_response, detect_protocol, encode_body


class Stub:
    """Scripted answers per path; records every request."""

    def __init__(self) -> None:
        self.script: dict[str, list] = {}
        self.seen: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _serve(self):
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?")[0]
                stub.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body,
                                  "peer": self.client_address})
                queue = stub.script.get(path) or [(200, "application/json", b"{}")]
                action = queue.pop(0) if len(queue) > 1 else queue[0]
                if action == "drop":  # close without answering
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(action, tuple) and action[0] == "sleep":
                    time.sleep(action[1])
                    action = (200, "application/json", b"{}")
                status, ctype, payload = action[:3]
                extra = action[3] if len(action) > 3 else {}
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def on(self, path: str, *actions) -> None:
        self.script[path] = list(actions)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def js(status: int, obj, headers: dict | None = None):
    return (status, "application/json", json.dumps(obj).encode(), headers or {})


@pytest.fixture()
def stub():
    s = Stub()
    yield s
    s.close()


def make_http(url: str, *, attempts: int = 4, idempotency: bool = False, token: str | None = None, **timeouts):
    http = ArcticHttp(url, timeouts=TimeoutsConfig(**timeouts), retry=RetryConfig(max_attempts=attempts,
                      backoff_initial_s=0.001, backoff_max_s=0.01), token=token, idempotency=idempotency)
    return http


def test_server_detail_dict_is_in_the_error(stub):
    detail = {"message": "unknown loss", "field": "processing.loss_fn", "allowed": ["verl_grpo"], "received": "os.system"}
    stub.on("/forward-backward", js(400, {"detail": detail}))
    http = make_http(stub.url)
    with pytest.raises(RemoteServerError) as err:
        http.request("POST", "/forward-backward", params={"job_id": 3}, data=b"x", op="forward_backward")
    e = err.value
    assert type(e) is RemoteServerError and e.status == 400 and not e.retryable
    assert e.endpoint == "POST /forward-backward?job_id=3"
    assert e.detail == detail
    for part in ("unknown loss", "processing.loss_fn", "verl_grpo", "'os.system'"):
        assert part in e.server_message and part in str(e)


@pytest.mark.parametrize(
    "answer, message",
    [
        (js(422, {"detail": [{"loc": ["body", "job_type"], "msg": "Input should be 'training'", "type": "enum"}]}),
         "job_type: Input should be 'training'"),
        ((500, "text/plain", b"Internal Server Error"), "Internal Server Error"),
        (js(409, {"detail": "a training job already exists"}), "a training job already exists"),
    ],
)
def test_other_error_shapes(stub, answer, message):
    stub.on("/initialize", answer)
    with pytest.raises(RemoteServerError) as err:
        make_http(stub.url).post_json("/initialize", {"model_name": "m"})
    assert err.value.status == answer[0] and message in err.value.server_message


def test_404_for_a_job_is_job_not_found_but_unknown_route_is_not(stub):
    stub.on("/job/7", js(404, {"detail": {"message": "no job 7", "field": "job_id", "received": 7}}))
    stub.on("/fwd-bwd", js(404, {"detail": "Not Found"}))
    http = make_http(stub.url)
    with pytest.raises(RemoteJobNotFoundError) as err:
        http.get_json("/job/7")
    assert err.value.status == 404 and "no job 7" in str(err.value)
    with pytest.raises(RemoteServerError) as err:
        http.request("POST", "/fwd-bwd", params={"job_id": 1}, data=b"")
    assert not isinstance(err.value, RemoteJobNotFoundError) and "protocol generation" in str(err.value)


def test_idempotent_call_retries_transient_statuses_with_the_same_request_id(stub, caplog):
    stub.on("/forward", js(503, {"detail": "busy"}), js(502, {"detail": "gateway"}), js(200, {"ok": 1}))
    caplog.set_level(logging.WARNING, logger="verl.workers.remote_client.arctic.http")
    resp = make_http(stub.url).request("POST", "/forward", params={"job_id": 1}, data=b"abc", idempotent=True,
                                       op="forward")
    assert resp.json() == {"ok": 1}
    ids = {r["headers"]["X-Request-Id"] for r in stub.seen}
    assert len(stub.seen) == 3 and len(ids) == 1
    logged = [r.getMessage() for r in caplog.records]
    assert any("attempt 1/4" in m and "HTTP 503: busy" in m for m in logged)
    assert any("attempt 2/4" in m and "HTTP 502" in m for m in logged)


def test_non_idempotent_call_is_not_retried_unless_the_server_replays_ids(stub):
    stub.on("/step", js(503, {"detail": "busy"}), js(200, {"metrics": {}}))
    with pytest.raises(RemoteServerError) as err:
        make_http(stub.url).post_json("/step", {}, params={"job_id": 1}, op="step")
    assert err.value.status == 503 and err.value.retryable and len(stub.seen) == 1
    stub.seen.clear()
    stub.on("/step", js(503, {"detail": "busy"}), js(200, {"metrics": {}}))
    resp = make_http(stub.url, idempotency=True).post_json("/step", {}, params={"job_id": 1}, op="step")
    assert resp.status_code == 200 and len(stub.seen) == 2
    assert stub.seen[0]["headers"]["X-Request-Id"] == stub.seen[1]["headers"]["X-Request-Id"]


def test_dropped_connection_is_retried_only_for_safe_calls(stub):
    stub.on("/forward-backward", "drop", js(200, {}))
    with pytest.raises(RemoteConnectionError):
        make_http(stub.url).request("POST", "/forward-backward", params={"job_id": 1}, data=b"g")
    assert len(stub.seen) == 1  # may have been applied: never re-sent
    stub.seen.clear()
    stub.on("/health", "drop", js(200, {"status": "OK"}))
    assert make_http(stub.url).get_json("/health") == {"status": "OK"}
    assert len(stub.seen) == 2


def test_refused_connection_is_retried_for_any_call_then_reported(caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.WARNING, logger="verl.workers.remote_client.arctic.http")
    http = make_http(f"http://127.0.0.1:{port}", attempts=3)
    with pytest.raises(RemoteConnectionError) as err:
        http.post_json("/step", {}, params={"job_id": 1})  # never reached the server: safe to retry
    assert err.value.endpoint == "POST /step?job_id=1"
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2


def test_slow_answer_is_a_timeout_naming_the_limit(stub):
    stub.on("/forward", ("sleep", 1.0))
    with pytest.raises(RemoteTimeoutError) as err:
        make_http(stub.url, forward_s=0.3).request("POST", "/forward", params={"job_id": 1}, data=b"", op="forward",
                                                   idempotent=True)
    assert err.value.timeout_s == 0.3 and "/forward" in str(err.value)


def test_retry_after_is_honoured_within_the_cap(stub):
    stub.on("/generate", js(429, {"detail": "slow down"}, {"Retry-After": "5"}), js(200, {}))
    http = make_http(stub.url)
    delays = []
    http._sleep = delays.append
    http.request("POST", "/generate", params={"job_id": 1}, data=b"", idempotent=True, op="generate")
    assert delays == [0.01]  # Retry-After 5 s, capped by backoff_max_s


def test_headers_token_request_id_step_and_bytearray_body(stub, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    http = make_http(stub.url)
    frame = bytearray(b"\x00\x01" * 5000)
    http.request("POST", "/forward", params={"job_id": 2}, data=frame, content_type="application/octet-stream", step=7)
    http.get_json("/health")
    post, get = stub.seen
    assert post["body"] == bytes(frame) and post["headers"]["Content-Length"] == "10000"
    assert post["headers"]["Authorization"] == "Bearer from-env"
    assert post["headers"]["X-Arctic-Step"] == "7" and len(post["headers"]["X-Request-Id"]) == 36
    assert "X-Request-Id" not in get["headers"] and get["headers"]["Authorization"] == "Bearer from-env"
    assert "from-env" not in repr(http)
    stub.seen.clear()
    make_http(stub.url, token="configured").get_json("/health")
    assert stub.seen[0]["headers"]["Authorization"] == "Bearer configured"


def test_one_session_reuses_its_connection(stub):
    http = make_http(stub.url)
    for _ in range(5):
        http.get_json("/health")
    http.post_json("/step", {})
    assert len({r["peer"] for r in stub.seen}) == 1  # one TCP connection for all six calls


@pytest.mark.parametrize(
    "paths, expected",
    [(["/health", "/forward-backward", "/forward", "/save"], ProtocolVersion.V2),
     (["/health", "/fwd-bwd", "/fwd-no-grad", "/sync-weights"], ProtocolVersion.V1)],
)
def test_protocol_detection_from_openapi(stub, paths, expected):
    stub.on("/openapi.json", js(200, {"openapi": "3.1.0", "paths": {p: {} for p in paths}}))
    assert detect_protocol(make_http(stub.url)) is expected
    assert detect_protocol(make_http(stub.url), "v1") is ProtocolVersion.V1  # configured wins, no call
    assert len(stub.seen) == 1


def test_protocol_detection_failures_are_explained(stub):
    stub.on("/openapi.json", js(200, {"paths": {"/health": {}}}))
    with pytest.raises(RemoteProtocolError, match="server.protocol"):
        detect_protocol(make_http(stub.url))
    stub.on("/openapi.json", js(404, {"detail": "Not Found"}))
    with pytest.raises(RemoteProtocolError, match="set remote_backend.server.protocol"):
        detect_protocol(make_http(stub.url))


def _answer(content_type: str, body: bytes) -> requests.Response:
    resp = requests.Response()
    resp.status_code = 200
    resp.headers["Content-Type"] = content_type
    resp._content = body
    return resp


def test_bodies_round_trip_in_both_generations_and_pickles_are_refused():
    obj = {"batch": {"logprobs": torch.randn(2, 3)}, "metrics": {"loss": 1.5}}
    for version in (ProtocolVersion.V2, ProtocolVersion.V1):
        body = encode_body(version, obj)
        back = decode_response(version, _answer("application/octet-stream", bytes(body)), "POST /forward")
        assert torch.equal(back["batch"]["logprobs"], obj["batch"]["logprobs"]) and back["metrics"] == {"loss": 1.5}
    assert isinstance(encode_body(ProtocolVersion.V2, obj), bytearray)
    assert dssst1.loads(encode_body(ProtocolVersion.V2, obj))["metrics"] == {"loss": 1.5}

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        decode_response(ProtocolVersion.V1, _answer("application/octet-stream", buf.getvalue()), "POST /fwd-bwd")
    with pytest.raises(RemoteProtocolError):
        decode_response(ProtocolVersion.V2, _answer("application/octet-stream", torch_save_bytes(obj)), "POST /forward")
    assert decode_response(ProtocolVersion.V2, _answer("application/json", b'{"a": 1}'), "x") == {"a": 1}
