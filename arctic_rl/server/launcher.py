"""Start and stop one reference server process (``python -m arctic_rl.server``) on this machine.

The one launcher of the reference server: the adapter's ``LocalServer`` (what a verl run starts when
``remote_backend.server.url`` is null) and the test suite both start theirs with :class:`ServerProcess`.
It binds a free port when none is given (and tries another if that one is taken before the server
binds it), sends the server's output to ``<log_dir>/arctic_server-<port>.log``, waits until ``/health``
answers, and stops only its own process: SIGTERM, or SIGKILL with ``hard=True``. :meth:`restart` kills
the server outright and starts it again on the same port with the same checkpoint root, as a
supervisor would. The token reaches the server through its environment (``ARCTIC_RL_SERVER_TOKEN``),
never its command line, which other users of the machine can read; the server watches the process
that started it (``--exit-with-parent``) and shuts down if that one is killed outright.

A start that fails raises :class:`ServerExited` (the process ended first) or :class:`ServerNotHealthy`
(``/health`` did not answer in time; the process is stopped), both carrying the tail of the log.

What is not here: the server itself (:mod:`arctic_rl.server.__main__`) or deciding when to start one.
Like all of ``arctic_rl`` it never imports verl, nor torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from arctic_rl.server.__main__ import TOKEN_ENV

__all__ = ["ServerExited", "ServerNotHealthy", "ServerProcess", "ServerStartError", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    """The server process did not come up; ``log_path`` and ``log_tail`` say what it printed."""

    def __init__(self, message: str, log_path: Path | None, log_tail: str) -> None:
        super().__init__(message)
        self.log_path = log_path
        self.log_tail = log_tail

    def __reduce__(self):  # picklable with every field (an exception's default pickling keeps only args)
        return (self.__class__, (self.args[0], self.log_path, self.log_tail))


class ServerExited(ServerStartError):
    """The process ended (``returncode``) before ``/health`` answered."""

    def __init__(self, message: str, log_path: Path | None, log_tail: str, returncode: int | None = None) -> None:
        super().__init__(message, log_path, log_tail)
        self.returncode = returncode

    def __reduce__(self):
        return (self.__class__, (self.args[0], self.log_path, self.log_tail, self.returncode))


class ServerNotHealthy(ServerStartError, TimeoutError):
    """``/health`` did not answer within ``timeout_s``; the process has been stopped."""

    def __init__(self, message: str, log_path: Path | None, log_tail: str, timeout_s: float = 0.0) -> None:
        super().__init__(message, log_path, log_tail)
        self.timeout_s = timeout_s

    def __reduce__(self):
        return (self.__class__, (self.args[0], self.log_path, self.log_tail, self.timeout_s))


@dataclass(eq=False)
class ServerProcess:
    """One ``python -m arctic_rl.server`` process: :meth:`start`, :meth:`stop`, :meth:`restart`.

    ``port=0`` picks a free port at the first start; restarts keep it. ``extra_args`` are appended to the
    command line (any other server option); ``env`` adds to the inherited environment.
    """

    checkpoint_root: Path
    log_dir: Path | None = None  # default: the checkpoint root
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    sampler: str = "auto"
    threads: int = 1
    token: str | None = None
    extra_args: Sequence[str] = ()
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    exit_with_parent: bool = True
    startup_timeout_s: float = 180.0
    proc: subprocess.Popen | None = field(default=None, init=False)
    log_path: Path | None = field(default=None, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header a client needs for this server (empty without a token)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        """The command line (no token: that goes through the environment)."""
        cmd = [self.python, "-m", "arctic_rl.server", "--host", self.host, "--port", str(self.port),
               "--checkpoint-root", str(self.checkpoint_root), "--device", self.device, "--sampler", self.sampler,
               "--threads", str(self.threads)]
        if self.exit_with_parent:
            cmd += ["--exit-with-parent", str(os.getpid())]
        return cmd + list(self.extra_args)

    def start(self) -> None:
        """Start the process and return once ``/health`` answers (see the module docstring for failures)."""
        with self._lock:
            if self.alive:
                raise RuntimeError(f"the server at {self.url} is already running (pid {self.proc.pid})")
            pick = self.port == 0
            attempts = 3 if pick else 1  # a free port can be taken before the server binds it
            for attempt in range(1, attempts + 1):
                if pick:
                    self.port = free_port(self.host)
                self._spawn()
                try:
                    self._wait_healthy()
                    return
                except ServerExited as exc:
                    if not (pick and attempt < attempts and "address already in use" in exc.log_tail.lower()):
                        raise
                    self.port = 0

    def stop(self, *, hard: bool = False, timeout_s: float = 20.0) -> None:
        """SIGTERM (SIGKILL with ``hard``) this process and reap it; SIGKILL after ``timeout_s``. Idempotent."""
        with self._lock:
            proc, self.proc = self.proc, None
            if proc is None:
                return
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=timeout_s)
            self.proc = proc  # kept: its pid and return code stay readable after a stop

    def restart(self) -> None:
        """Kill the server without a goodbye (SIGKILL) and start a fresh one on the same port."""
        with self._lock:
            self.stop(hard=True)
            self.start()

    def log_tail(self, max_chars: int = 4000) -> str:
        """The last ``max_chars`` of the log (all starts on this port)."""
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:] if self.log_path else ""
        except OSError:
            return ""

    def _spawn(self) -> None:
        Path(self.checkpoint_root).mkdir(parents=True, exist_ok=True)
        log_dir = Path(self.log_dir if self.log_dir is not None else self.checkpoint_root)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"arctic_server-{self.port}.log"
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env.pop(TOKEN_ENV, None)
        env.update(self.env)
        if self.token:
            env[TOKEN_ENV] = self.token
        with open(self.log_path, "ab") as log:
            # its own session: a Ctrl-C in the starting terminal must not reach the server before its
            # owner has destroyed the jobs; stop() ends it
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=self.cwd, start_new_session=True)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise ServerExited(f"the server exited with code {code}; log {self.log_path}:\n{self.log_tail()}",
                                   self.log_path, self.log_tail(), code)
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerNotHealthy(f"the server did not answer /health within {self.startup_timeout_s:g} s; log "
                               f"{self.log_path}:\n{self.log_tail()}", self.log_path, self.log_tail(),
                               self.startup_timeout_s)
