"""The lifecycle ABC, the registry rules, the error tree (pickling included), and the owner's clean-up
under repeated signals."""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import signal
import time
from typing import ClassVar

import pytest

import verl.remote_backend as rb
from verl.remote_backend import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend import errors as E


def test_public_surface_is_pinned():
    assert set(rb.__all__) == {
        "RemoteBackend",
        "RemoteBackendRegistry",
        "RemoteBackendConfigError",
        "RemoteBackendError",
        "RemoteConnectionError",
        "RemoteJobNotFoundError",
        "RemoteProtocolError",
        "RemoteServerError",
        "RemoteTimeoutError",
    }
    for name in rb.__all__:
        assert getattr(rb, name) is not None


def test_abstract_members_are_exactly_the_lifecycle():
    assert inspect.isabstract(RemoteBackend)
    assert RemoteBackend.__abstractmethods__ == frozenset(
        {"from_config", "reconnect_handle", "destroy", "update_weights", "save_checkpoint", "requires_single_forwarder"}
    )
    for compute in ("compute_log_prob", "update_actor", "generate"):
        assert not hasattr(RemoteBackend, compute), f"{compute} belongs to adapters, not the ABC"
    assert isinstance(inspect.getattr_static(RemoteBackend, "from_config"), classmethod)
    params = inspect.signature(RemoteBackend.from_config).parameters
    assert list(params) == ["main_config", "handle"]
    assert params["handle"].kind is inspect.Parameter.KEYWORD_ONLY and params["handle"].default is None
    with pytest.raises(TypeError):
        RemoteBackend()  # type: ignore[abstract]


class _Backend(RemoteBackend):
    created: ClassVar[list] = []

    def __init__(self, config, handle):
        self.config, self.handle, self.destroyed = config, handle, 0

    @classmethod
    def from_config(cls, main_config, *, handle=None):
        return cls(main_config, handle)

    def reconnect_handle(self) -> dict:
        return {"url": "http://127.0.0.1:1", "jobs": [1, 2]}

    def destroy(self) -> None:
        self.destroyed += 1

    def update_weights(self):
        return {}

    def save_checkpoint(self):
        return {}

    def requires_single_forwarder(self) -> bool:
        return True


@pytest.fixture
def clean_registry(monkeypatch):
    """Run a test against empty tables, restoring the real ones afterwards."""
    from verl.remote_backend.base import _Table

    for attr, kind in (("_backends", "remote backend"), ("_workers", "worker"), ("_replicas", "replica")):
        monkeypatch.setattr(RemoteBackendRegistry, attr, _Table(kind, f"Register a {kind} like so."))
    monkeypatch.setattr(RemoteBackendRegistry, "_loaded", {})
    return RemoteBackendRegistry


def test_register_get_create_list(clean_registry):
    R = clean_registry
    assert R.register("toy")(_Backend) is _Backend
    assert R.get("toy") is _Backend
    assert R.list() == ["toy"]
    backend = R.create("toy", {"k": 1}, handle={"h": 1})
    assert isinstance(backend, _Backend) and backend.config == {"k": 1} and backend.handle == {"h": 1}
    json.dumps(backend.reconnect_handle())


def test_reregistering_same_object_is_noop_and_different_object_raises(clean_registry):
    R = clean_registry
    R.register("toy")(_Backend)
    R.register("toy")(_Backend)

    class Other(_Backend):
        pass

    with pytest.raises(ValueError) as info:
        R.register("toy")(Other)
    msg = str(info.value)
    assert "_Backend" in msg and "Other" in msg and "'toy'" in msg


def test_unknown_name_lists_registered_and_says_how(clean_registry):
    R = clean_registry
    R.register("alpha")(_Backend)
    with pytest.raises(KeyError) as info:
        R.get("beta")
    msg = str(info.value)
    assert "'beta'" in msg and "alpha" in msg and "Register" in msg


def test_only_remote_backend_subclasses_register(clean_registry):
    with pytest.raises(TypeError):
        clean_registry.register("bad")(dict)


def test_worker_and_replica_loaders_are_lazy_and_cached(clean_registry):
    R = clean_registry
    calls = []

    def load_worker():
        calls.append("w")
        return _Backend

    R.register_worker("toy", load_worker)
    R.register_replica("toy", lambda: dict)
    assert calls == []  # nothing imported at registration
    assert R.get_worker("toy") is _Backend
    assert R.get_worker("toy") is _Backend
    assert calls == ["w"]  # loaded once
    assert R.get_replica("toy") is dict
    with pytest.raises(KeyError, match="registered: \\['toy'\\]"):
        R.get_worker("nope")
    with pytest.raises(TypeError):
        R.register_worker("x", "not callable")  # type: ignore[arg-type]
    R.register_worker("toy", load_worker)  # same loader again: no-op
    with pytest.raises(ValueError):
        R.register_worker("toy", lambda: None)


@pytest.mark.slow  # a subprocess that imports verl and ray: tens of seconds on two cores
def test_importing_the_package_registers_no_backend_eagerly():
    import subprocess
    import sys

    code = "import sys, verl.remote_backend as rb; print(rb.RemoteBackendRegistry.list()); print('verl.workers.remote_client.arctic.arctic_rl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["[]", "False"]


ERRORS = [
    E.RemoteBackendError("plain"),
    E.RemoteBackendConfigError("remote_backend.server.protocol", "unknown protocol", allowed=["auto", "v1", "v2"], received="v3"),
    E.RemoteServerError("/forward-backward", 400, "advantages: non-finite values", detail={"field": "advantages"}),
    E.RemoteJobNotFoundError("/step", 404, "Job 3 not found"),
    E.RemoteConnectionError("/health", "connection refused"),
    E.RemoteTimeoutError("/generate", 12.5, "read timeout"),
    E.RemoteProtocolError("/forward", "missing batch.logprobs"),
]


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_pickle_intact(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.__dict__ == err.__dict__
    assert isinstance(back, E.RemoteBackendError)


def test_error_messages_name_what_matters():
    cfg = ERRORS[1]
    assert "remote_backend.server.protocol" in str(cfg) and "v3" in str(cfg) and "v2" in str(cfg)
    assert isinstance(cfg, ValueError)
    srv = ERRORS[2]
    assert "/forward-backward" in str(srv) and "400" in str(srv) and "advantages" in str(srv)
    assert not srv.retryable and E.RemoteServerError("/x", 503, "busy").retryable
    assert isinstance(ERRORS[3], E.RemoteServerError)
    assert isinstance(ERRORS[4], ConnectionError) and isinstance(ERRORS[5], TimeoutError)


# ------------------------------------------------------------------ clean-up under repeated signals
class _SignalledWhileDestroyed(_Backend):
    """Its ``destroy`` gets ``times`` SIGINTs (a user pressing Ctrl-C again while the jobs go)."""

    times = 0

    def destroy(self) -> None:
        for _ in range(self.times):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs in this (main) thread before the next line
        self.destroyed += 1


@pytest.mark.parametrize("times", [1, 2])
def test_one_more_ctrl_c_does_not_cut_the_clean_up_short(times, caplog):
    from verl.remote_backend.lifecycle import BackendOwner

    # Python's own Ctrl-C handler, also when pytest runs as a background job (which ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        backend = _SignalledWhileDestroyed(None, None)
        backend.times = times
        owner = BackendOwner("fake", backend)
        with caplog.at_level(logging.WARNING, logger="verl.remote_backend.lifecycle"):
            if times == 1:  # logged, ignored; the jobs are destroyed
                owner.destroy()
                assert backend.destroyed == 1
                assert "SIGINT received while destroying the jobs of remote backend 'fake'" in caplog.text
            else:  # the second one ends it, as Ctrl-C does (for a clean-up that hangs)
                with pytest.raises(KeyboardInterrupt):
                    owner.destroy()
                assert backend.destroyed == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        owner.destroy()  # once only, even after an interrupted attempt
        assert backend.destroyed == (1 if times == 1 else 0)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_ctrl_c_stays_ignored_during_the_clean_up():
    from verl.remote_backend.lifecycle import BackendOwner

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a job started in the background
    try:
        backend = _SignalledWhileDestroyed(None, None)
        backend.times = 2
        BackendOwner("fake", backend).destroy()
        assert backend.destroyed == 1
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
