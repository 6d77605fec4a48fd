"""The bearer token guards every route of the reference server, the vendor's control routes included.

The routes are read from the FastAPI app itself (:func:`arctic_rl.server.app.create_app`), so a route
added later is covered without touching this test. Each one, with every method it answers, is called
on a real server process started with ``--token``: with no ``Authorization`` header, with a wrong
token and with a header that is not ``Bearer`` -> 401, a JSON ``detail`` naming the field, and
``WWW-Authenticate: Bearer``. With the right token the same call gets past the guard (anything but
401), which shows the route exists on the running process.

``GET /health`` is the one route meant to be public (a load balancer's probe); it is the only
exception, and the test fails if another route turns out to be open.
"""

from __future__ import annotations

import re

import pytest
import requests

from arctic_rl.protocol import Paths
from arctic_rl.server.app import create_app
from arctic_rl.server.settings import ServerSettings
from tests.support.server import running_server

pytestmark = pytest.mark.slow

TOKEN = "route-guard-token"
#: routes meant to be reachable without a token
PUBLIC = {("GET", Paths.HEALTH)}
WRONG_HEADERS = {
    "no header": {},
    "wrong token": {"Authorization": f"Bearer {TOKEN}x"},
    "empty bearer": {"Authorization": "Bearer "},
    "not bearer": {"Authorization": TOKEN},
    "basic scheme": {"Authorization": f"Basic {TOKEN}"},
}


def _concrete(path: str) -> str:
    """A route template with its path parameters filled (``/job/{job_id}`` -> ``/job/1``)."""
    return re.sub(r"\{[^}]+\}", "1", path)


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every HTTP route the app serves, ``HEAD`` left out (Starlette adds it to ``GET``)."""
    app = create_app(ServerSettings(token=TOKEN))
    found = set()
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                found.add((method, route.path))
    app.state.server.shutdown()
    return sorted(found)


ROUTES = app_routes()


def test_the_route_list_holds_the_vendor_control_routes():
    """The enumeration is not empty or partial: v2, v1 and the vendor's control routes are all in it."""
    paths = {path for _, path in ROUTES}
    expected = {Paths.GENERATE, Paths.FORWARD_BACKWARD, Paths.WEIGHT_SYNC, Paths.V1_FWD_BWD, Paths.V1_SYNC_WEIGHTS,
                Paths.SLEEP_INFERENCE, Paths.OPERATION, Paths.WEIGHT_NORM, Paths.LOG_PROBS, Paths.JOB, Paths.HEALTH}
    assert expected <= paths, sorted(expected - paths)
    assert PUBLIC <= set(ROUTES)


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("locked"), token=TOKEN) as server:
        yield server


def _call(server, method: str, path: str, headers: dict) -> requests.Response:
    url = server.url + _concrete(path)
    if method in ("POST", "PUT", "PATCH"):
        return requests.request(method, url + "?job_id=1", json={}, headers=headers, timeout=60)
    return requests.request(method, url + ("?job_id=1" if "{" not in path else ""), headers=headers, timeout=60)


@pytest.mark.parametrize("method, path", [r for r in ROUTES if r not in PUBLIC], ids=lambda v: v)
def test_every_route_refuses_a_missing_or_wrong_token(locked, method, path):
    for name, headers in WRONG_HEADERS.items():
        response = _call(locked, method, path, headers)
        assert response.status_code == 401, (name, method, path, response.status_code, response.text[:300])
        assert response.headers.get("WWW-Authenticate") == "Bearer", (name, path)
        detail = response.json()["detail"]
        assert detail["field"] == "Authorization", (name, path, detail)
        expected = "missing bearer token" if name == "no header" else "invalid bearer token"
        assert detail["message"] == expected, (name, path, detail)
    allowed = _call(locked, method, path, {"Authorization": f"Bearer {TOKEN}"})
    assert allowed.status_code != 401 and allowed.status_code < 500, (method, path, allowed.text[:300])


def test_health_is_the_only_public_route(locked):
    for method, path in PUBLIC:
        response = _call(locked, method, path, {})
        assert response.status_code == 200, (method, path, response.text[:300])
    assert requests.get(locked.url + Paths.HEALTH, timeout=30).json()["status"] == "OK"
    # a path that is no route at all is guarded too (the middleware runs before routing)
    response = requests.get(locked.url + "/no-such-route", timeout=30)
    assert response.status_code == 401 and response.json()["detail"]["field"] == "Authorization"
