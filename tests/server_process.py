"""Test helper: the reference Arctic RL server as a REAL subprocess, and tiny local models.

Usage (pytest, ``--import-mode=importlib``; put the tests dir on ``sys.path`` first)::

    import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from server_process import running_server, tiny_model_dir

    with running_server(tmp_path, token=None, extra_args=()) as srv:
        requests.get(srv.url + "/health", headers=srv.headers)
        srv.restart()            # kill -9 and start again: same port, same checkpoint root
        srv.proc, srv.log_text()  # the Popen, and what the server logged

``python -m arctic_rl.server`` runs on a free 127.0.0.1 port with ``--checkpoint-root
<tmp_path>/checkpoints`` and one torch thread; the context waits for ``/health`` and kills the
process (only that one) on exit. Its output goes to ``<tmp_path>/server-<n>.log``, whose tail is
included when it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

__all__ = [
    "REPO_ROOT",
    "ServerProcess",
    "decode",
    "free_port",
    "make_batch",
    "post_frame",
    "running_server",
    "tiny_model_dir",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model_dir(path: str | os.PathLike, arch: str = "qwen3", *, seed: int = 0, **config_kwargs) -> Path:
    """A tiny model + char tokenizer under ``path`` (built once; reused if already there)."""
    from arctic_rl.tiny_models import build_tiny_model

    out = Path(path)
    if (out / "config.json").is_file():
        return out
    return build_tiny_model(out, arch, seed=seed, **config_kwargs)


@dataclass
class ServerProcess:
    """A running ``python -m arctic_rl.server`` (see the module docstring)."""

    workdir: Path
    token: str | None = None
    extra_args: Sequence[str] = ()
    startup_timeout: float = 180.0
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    _starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def checkpoint_root(self) -> Path:
        return self.workdir / "checkpoints"

    @property
    def headers(self) -> dict[str, str]:
        """``Authorization`` header for the server's token (empty without one)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def command(self) -> list[str]:
        cmd = [PYTHON, "-m", "arctic_rl.server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--checkpoint-root", str(self.checkpoint_root), "--device", "cpu", "--threads", "1"]
        if self.token:
            cmd += ["--token", self.token]
        return cmd + list(self.extra_args)

    def start(self) -> None:
        self._starts += 1
        self.log_path = self.workdir / f"server-{self._starts}.log"
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=str(REPO_ROOT),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout}s:\n{self.log_text()[-4000:]}")

    def stop(self, *, hard: bool = False) -> None:
        """SIGTERM (SIGKILL with ``hard``) our process, and wait for it."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)

    def restart(self) -> None:
        """Kill the server without a goodbye (SIGKILL) and start a fresh one on the same port."""
        self.stop(hard=True)
        self.start()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""


@contextlib.contextmanager
def running_server(
    tmp_path: str | os.PathLike,
    token: str | None = None,
    extra_args: Sequence[str] = (),
    *,
    startup_timeout: float = 180.0,
) -> Iterator[ServerProcess]:
    """Start the server in ``tmp_path``, yield it when healthy, always stop it."""
    workdir = Path(tmp_path)
    workdir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(workdir, token=token, extra_args=tuple(extra_args), startup_timeout=startup_timeout)
    try:
        server.start()
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------
# Bodies
# ------------------------------------------------------------------------------------------


def make_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int = 0):
    """A dense ``[B, P+R]`` forward/backward ``batch``: left-padded prompts, right-padded responses.

    Returns ``input_ids, attention_mask, position_ids, prompts, responses`` and a full-width
    ``response_mask`` (zeros over the prompt columns), all int64.
    """
    import torch

    if len(prompts) != len(responses):
        raise ValueError(f"prompts/responses: expected equal lengths, got {len(prompts)} and {len(responses)}")
    p = max(len(x) for x in prompts)
    r = max(len(x) for x in responses)
    b = len(prompts)
    prompt_ids = torch.full((b, p), pad_id, dtype=torch.long)
    response_ids = torch.full((b, r), pad_id, dtype=torch.long)
    mask = torch.zeros((b, p + r), dtype=torch.long)
    for i, (pr, rs) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, p - len(pr) :] = torch.tensor(list(pr), dtype=torch.long)
        response_ids[i, : len(rs)] = torch.tensor(list(rs), dtype=torch.long)
        mask[i, p - len(pr) : p + len(rs)] = 1
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    response_mask = mask.clone()
    response_mask[:, :p] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_mask,
    }


def post_frame(server: ServerProcess, path: str, obj, *, headers: dict | None = None, timeout: float = 300.0):
    """POST ``obj`` as a DSSST1 frame (with the server's auth header); returns the ``requests`` response."""
    from arctic_rl import dssst1

    all_headers = {"Content-Type": "application/octet-stream", **server.headers, **(headers or {})}
    return requests.post(server.url + path, data=bytes(dssst1.dumps(obj)), headers=all_headers, timeout=timeout)


def decode(response: requests.Response):
    """A response body: DSSST1 frames decoded, JSON parsed; raises with the body on a non-2xx."""
    from arctic_rl import dssst1

    if not response.ok:
        raise AssertionError(
            f"{response.request.method} {response.url} -> {response.status_code}: {response.text[:2000]}"
        )
    if response.headers.get("content-type", "").startswith("application/octet-stream"):
        return dssst1.loads(response.content)
    return response.json()
