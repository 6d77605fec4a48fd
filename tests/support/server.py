"""Test helper: the reference Arctic RL server as a real subprocess, and request bodies for it.

The process is the product's own launcher, :class:`arctic_rl.server.launcher.ServerProcess` (the one
``LocalServer`` uses); :func:`running_server` only fixes the test layout::

    from tests.support.server import running_server

    with running_server(tmp_path, token=None, extra_args=()) as srv:
        requests.get(srv.url + "/health", headers=srv.headers)
        srv.restart()               # kill -9 and start again: same port, same checkpoint root
        srv.proc, srv.log_tail()    # the Popen, and what the server logged

``python -m arctic_rl.server`` runs on a free 127.0.0.1 port, on CPU with one thread, with
``--checkpoint-root <tmp_path>/checkpoints`` and its log in ``<tmp_path>``; the context waits for
``/health`` and stops the process (only that one) on exit. Tests that need a tiny model use the
``tiny_model_dir`` fixture (tests/conftest.py); scripts call ``arctic_rl.tiny_models.build_tiny_model``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import requests

from arctic_rl.server.launcher import ServerProcess, free_port

__all__ = [
    "REPO_ROOT",
    "ServerProcess",
    "check_server_flag",
    "decode",
    "free_port",
    "good_body",
    "make_batch",
    "post_frame",
    "running_server",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


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
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)  # this checkout first
    server = ServerProcess(checkpoint_root=workdir / "checkpoints", log_dir=workdir, token=token,
                           extra_args=tuple(extra_args), startup_timeout_s=startup_timeout, cwd=REPO_ROOT,
                           env={"PYTHONPATH": path})
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


def good_body(**processing) -> dict:
    """A valid ``/forward-backward`` body of two rows (GRPO loss, advantages 1, old log-probs -4) to spoil
    one field at a time; ``processing`` adds to or replaces its ``processing`` keys."""
    import torch

    batch = make_batch([[5, 6, 7], [8, 9]], [[10, 11, 12], [13]])
    batch["advantages"] = torch.ones(batch["input_ids"].shape) * batch["response_mask"]
    batch["old_log_probs"] = torch.full(batch["input_ids"].shape, -4.0) * batch["response_mask"]
    return {"batch": batch, "meta": {"temperature": 1.0}, "processing": {"loss_fn": "grpo", **processing}}


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


def check_server_flag(monkeypatch: pytest.MonkeyPatch, flag: str, env: str, *, bad: str, good: tuple[str, object],
                      from_env: tuple[str, object], bad_env: str) -> None:
    """``python -m arctic_rl.server``'s ``flag`` and the environment variable ``env`` behind it: a ``bad`` value of
    the flag, or ``bad_env`` in the variable, is a usage error; the variable sets the value when the flag is not
    given (``from_env``: text, value) and the flag wins over it (``good``: text, value)."""
    from arctic_rl.server.__main__ import parse_args

    field = flag.lstrip("-").replace("-", "_")
    with pytest.raises(SystemExit):
        parse_args([flag, bad])
    monkeypatch.setenv(env, from_env[0])
    assert getattr(parse_args([]), field) == from_env[1]
    assert getattr(parse_args([flag, good[0]]), field) == good[1]
    monkeypatch.setenv(env, bad_env)
    with pytest.raises(SystemExit):
        parse_args([])
