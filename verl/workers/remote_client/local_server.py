"""Start and stop a local reference Arctic RL server (``python -m arctic_rl.server``) as a subprocess.

Used when ``remote_backend.server.url`` is null: the adapter that creates the jobs (the driver's)
starts one server on a free 127.0.0.1 port, hands out only its URL (workers attach to it), and
stops it on ``destroy()`` or at interpreter exit; the server also watches the starting process
(``--exit-with-parent``) and shuts down if it is killed outright. The server's stdout/stderr go to a log file
(``<log_dir>/arctic_server-<port>.log``); a server that dies or does not answer ``/health`` in
time is reported with the tail of that log. The token, if any, reaches the server through its
environment (``ARCTIC_RL_SERVER_TOKEN``), never its command line, which other users can read.

What is not here: talking to the server (:mod:`.http`) or deciding when to start one (:mod:`.arctic_rl`).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from verl.remote_backend.errors import RemoteConnectionError, RemoteTimeoutError

from .arctic_config import LocalServerConfig

__all__ = ["LocalServer", "start_local_server"]

logger = logging.getLogger(__name__)

SERVER_TOKEN_ENV = "ARCTIC_RL_SERVER_TOKEN"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LocalServer:
    """A running local server process; :meth:`stop` is idempotent (also registered with ``atexit``)."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    checkpoint_root: Path
    _tmpdir: tempfile.TemporaryDirectory | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; only this process."""
        with self._lock:
            if self.proc.poll() is None:
                logger.info("stopping the local Arctic RL server (pid %d, %s)", self.proc.pid, self.url)
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("local server pid %d ignored SIGTERM for %.0f s; killing it", self.proc.pid, timeout_s)
                    self.proc.kill()
                    self.proc.wait(timeout=timeout_s)
            atexit.unregister(self.stop)
            if self._tmpdir is not None:
                self._tmpdir.cleanup()
                self._tmpdir = None


def start_local_server(cfg: LocalServerConfig, *, token: str | None = None, python: str | None = None) -> LocalServer:
    """Start ``python -m arctic_rl.server`` as configured and wait until ``/health`` answers."""
    tmpdir = None
    if cfg.checkpoint_root:
        root = Path(cfg.checkpoint_root).expanduser().resolve()
    else:
        tmpdir = tempfile.TemporaryDirectory(prefix="arctic_rl_server_")
        root = Path(tmpdir.name)
    root.mkdir(parents=True, exist_ok=True)
    log_dir = Path(cfg.log_dir).expanduser().resolve() if cfg.log_dir else root
    log_dir.mkdir(parents=True, exist_ok=True)
    attempts = 3 if cfg.port == 0 else 1  # a free port can be taken before the server binds it
    for attempt in range(1, attempts + 1):
        port = cfg.port or _free_port(cfg.host)
        server = _spawn(cfg, port, root, log_dir, token, python or sys.executable, tmpdir)
        try:
            _wait_healthy(server, cfg.startup_timeout_s)
            return server
        except RemoteConnectionError:
            in_use = "address already in use" in server.log_tail().lower()
            server._tmpdir = None  # keep the directory for the next attempt
            server.stop()
            if not (in_use and attempt < attempts):
                if tmpdir is not None:
                    tmpdir.cleanup()
                raise
            logger.warning("port %d was taken before the local server bound it; trying another", port)
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _spawn(cfg: LocalServerConfig, port: int, root: Path, log_dir: Path, token: str | None, python: str,
           tmpdir: tempfile.TemporaryDirectory | None) -> LocalServer:
    cmd = [python, "-m", "arctic_rl.server", "--host", cfg.host, "--port", str(port), "--checkpoint-root", str(root),
           "--device", cfg.device, "--sampler", cfg.sampler, "--threads", str(cfg.threads),
           "--exit-with-parent", str(os.getpid())]
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(cfg.threads), MKL_NUM_THREADS=str(cfg.threads), TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.pop(SERVER_TOKEN_ENV, None)
    if token:
        env[SERVER_TOKEN_ENV] = token
    log_path = log_dir / f"arctic_server-{port}.log"
    with open(log_path, "ab") as log:
        # own session: a Ctrl-C in the driver's terminal must not kill the server before the
        # driver has destroyed its jobs; stop() ends it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    server = LocalServer(url=f"http://{host}:{port}", proc=proc, log_path=log_path, checkpoint_root=root,
                         _tmpdir=tmpdir)
    atexit.register(server.stop)
    logger.info("started a local Arctic RL server: pid %d, %s, log %s", proc.pid, server.url, log_path)
    return server


def _wait_healthy(server: LocalServer, timeout_s: float) -> None:
    endpoint = f"GET {server.url}/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive:
            raise RemoteConnectionError(
                endpoint, f"the local server exited with code {server.proc.returncode}; log {server.log_path}:\n"
                f"{server.log_tail()}")
        try:
            if requests.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RemoteTimeoutError(endpoint, timeout_s, f"the local server did not become healthy; log {server.log_path}:\n"
                             f"{server.log_tail()}")
