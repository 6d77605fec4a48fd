"""Start and stop a local reference Arctic RL server (``python -m arctic_rl.server``) as a subprocess.

Used when ``remote_backend.server.url`` is null: the adapter that creates the jobs (the driver's)
starts one server on a free 127.0.0.1 port, hands out only its URL (workers attach to it), and
stops it on ``destroy()`` or at interpreter exit; the server also watches the starting process
(``--exit-with-parent``) and shuts down if it is killed outright. The server's stdout/stderr go to a log file
(``<log_dir>/arctic_server-<port>.log``); a server that dies or does not answer ``/health`` in
time is reported with the tail of that log. The token, if any, reaches the server through its
environment (``ARCTIC_RL_SERVER_TOKEN``), never its command line, which other users can read.

The process itself is :class:`arctic_rl.server.launcher.ServerProcess`, the one launcher of the
reference server (the tests start theirs with it too); this module adds the configuration, a
temporary checkpoint root, the ``atexit`` hook and this package's error types.

What is not here: talking to the server (:mod:`.http`) or deciding when to start one (:mod:`.arctic_rl`).
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from arctic_rl.server.launcher import ServerExited, ServerNotHealthy, ServerProcess
from verl.remote_backend.errors import RemoteConnectionError, RemoteTimeoutError

from .arctic_config import LocalServerConfig

__all__ = ["LocalServer", "start_local_server"]

logger = logging.getLogger(__name__)


class LocalServer:
    """A running local server process; :meth:`stop` is idempotent (also registered with ``atexit``)."""

    def __init__(self, process: ServerProcess, tmpdir: tempfile.TemporaryDirectory | None = None) -> None:
        self._process = process
        self._tmpdir = tmpdir

    @property
    def url(self) -> str:
        return self._process.url

    @property
    def proc(self) -> subprocess.Popen:
        return self._process.proc

    @property
    def log_path(self) -> Path:
        return self._process.log_path

    @property
    def checkpoint_root(self) -> Path:
        return Path(self._process.checkpoint_root)

    @property
    def alive(self) -> bool:
        return self._process.alive

    def log_tail(self, max_chars: int = 4000) -> str:
        return self._process.log_tail(max_chars)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; only this process."""
        if self._process.alive:
            logger.info("stopping the local Arctic RL server (pid %d, %s)", self.proc.pid, self.url)
        self._process.stop(timeout_s=timeout_s)
        atexit.unregister(self.stop)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


def _extra_args(cfg: LocalServerConfig) -> tuple[str, ...]:
    """Server flags of the options that keep the server's own default when null."""
    args: tuple[str, ...] = ()
    if cfg.zorro_min_saving is not None:
        args += ("--zorro-min-saving", repr(float(cfg.zorro_min_saving)))
    if cfg.zorro_trials is not None:
        args += ("--zorro-trials", str(int(cfg.zorro_trials)))
    if cfg.in_flight_on_weight_load is not None:
        args += ("--in-flight-on-weight-load", cfg.in_flight_on_weight_load)
    if cfg.warm_up is not None:
        args += ("--warm-up", cfg.warm_up)
    if cfg.training_stream is not None:
        args += ("--training-stream", cfg.training_stream)
    if cfg.release_at_sync is not None:
        args += ("--release-at-sync", cfg.release_at_sync)
    if cfg.vllm_engine_process is not None:
        args += ("--vllm-engine-process", cfg.vllm_engine_process)
    return args


def start_local_server(cfg: LocalServerConfig, *, token: str | None = None, python: str | None = None) -> LocalServer:
    """Start ``python -m arctic_rl.server`` as configured and wait until ``/health`` answers."""
    tmpdir = None
    if cfg.checkpoint_root:
        root = Path(cfg.checkpoint_root).expanduser().resolve()
    else:
        tmpdir = tempfile.TemporaryDirectory(prefix="arctic_rl_server_")
        root = Path(tmpdir.name)
    log_dir = Path(cfg.log_dir).expanduser().resolve() if cfg.log_dir else root
    process = ServerProcess(checkpoint_root=root, log_dir=log_dir, host=cfg.host, port=cfg.port, device=cfg.device,
                            sampler=cfg.sampler, threads=cfg.threads, token=token, python=python or sys.executable,
                            startup_timeout_s=cfg.startup_timeout_s, extra_args=_extra_args(cfg))
    try:
        process.start()
    except ServerExited as exc:
        _cleanup(tmpdir)
        raise RemoteConnectionError(f"GET {process.url}/health", f"the local server exited with code {exc.returncode}; "
                                    f"log {exc.log_path}:\n{exc.log_tail}") from None
    except ServerNotHealthy as exc:
        _cleanup(tmpdir)
        raise RemoteTimeoutError(f"GET {process.url}/health", exc.timeout_s, "the local server did not become healthy; "
                                 f"log {exc.log_path}:\n{exc.log_tail}") from None
    except BaseException:
        process.stop()
        _cleanup(tmpdir)
        raise
    server = LocalServer(process, tmpdir)
    atexit.register(server.stop)
    logger.info("started a local Arctic RL server: pid %d, %s, log %s", server.proc.pid, server.url, server.log_path)
    return server


def _cleanup(tmpdir: tempfile.TemporaryDirectory | None) -> None:
    if tmpdir is not None:
        tmpdir.cleanup()
