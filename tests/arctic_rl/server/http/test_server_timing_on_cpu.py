"""The reference server's own seconds per call: the ``Server-Timing`` header on every answer, and its reader."""

from __future__ import annotations

import asyncio

import pytest

from arctic_rl.server_timing import SERVER_TIMING_HEADER, ServerTimingMiddleware, server_seconds


@pytest.mark.parametrize(("value", "seconds"), [
    ("app;dur=12.5", 0.0125),
    ("db;dur=3, app;desc=\"server\";dur=250", 0.25),
    ("app;dur=\"7\"", 0.007),
    (None, None),
    ("", None),
    ("db;dur=3", None),           # another metric only
    ("app", None),                # no duration
    ("app;dur=abc", None),        # malformed
    ("app;dur=-1", None),
])
def test_server_seconds_reads_the_app_metric(value, seconds):
    got = server_seconds(value)
    assert got == (pytest.approx(seconds) if seconds is not None else None)


def test_middleware_times_the_whole_answer():
    sent: list[dict] = []

    async def app(scope, receive, send):
        await asyncio.sleep(0.05)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(ServerTimingMiddleware(app)({"type": "http", "path": "/x"}, receive, send))
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"] == b"text/plain"
    seconds = server_seconds(headers[b"server-timing"].decode())
    assert seconds is not None and 0.04 <= seconds < 5.0
    assert sent[1]["body"] == b"ok"


def test_every_answer_of_the_app_carries_it_refusals_included(tmp_path):
    from fastapi.testclient import TestClient

    from arctic_rl.server import ServerSettings, create_app

    with TestClient(create_app(ServerSettings(checkpoint_root=str(tmp_path), token="secret"))) as client:
        health = client.get("/health")
        refused = client.get("/status")  # no token: 401
        unknown = client.get("/no-such-path", headers={"Authorization": "Bearer secret"})
    assert health.status_code == 200 and refused.status_code == 401 and unknown.status_code == 404
    for resp in (health, refused, unknown):
        assert server_seconds(resp.headers.get(SERVER_TIMING_HEADER)) is not None, resp.headers
