"""A running Tinker peer for tests: SkyRL's Tinker API server on CPU, driven by the official SDK.

:func:`running_peer` builds the server's own venv with ``<shared>/peers/tinker/setup.sh`` (into
``$XDG_CACHE_HOME/tinker-peer/venv``, or ``~/.cache/...``: idempotent, ~1 min cold), writes a tiny
Qwen3 under a path the SDK's tokenizer heuristics accept, starts the server on a free loopback
port with ``start.sh`` and stops it with ``stop.sh``. Outside CI a missing kit or SDK skips; under
CI (``CI=true``) it fails, so a green CI means these tests ran.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VERL_REMOTE_BACKEND_SHARED", REPO.parent / "shared"))
KIT = SHARED / "peers" / "tinker"
#: any key of the hosted service's shape: the peer checks nothing, the SDK wants the prefix
PEER_API_KEY = "tml-local-peer"


def _missing(text: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(text, pytrace=False)
    pytest.skip(text)


def require_peer_kit() -> Path:
    try:
        import tinker  # noqa: F401
    except ImportError:
        _missing("the tinker SDK is not installed (bash scripts/install.sh --test installs tinker==0.24.1)")
    if not (KIT / "start.sh").exists():
        _missing(f"the Tinker peer kit is missing at {KIT} (set VERL_REMOTE_BACKEND_SHARED)")
    return KIT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_peer_model(root: Path) -> Path:
    """The tiny Qwen3 under ``root/peer/tiny-qwen3`` (three or more ``/`` and no ``:``: the SDK's
    ``get_tokenizer`` rewrites two-slash names)."""
    from arctic_rl.tiny_models import build_tiny_model

    out = root / "peer" / "tiny-qwen3"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.json").exists():
        build_tiny_model(out, "qwen3", seed=0)
    return out


@contextlib.contextmanager
def running_peer(workdir: Path, *, model: Path | None = None, env: dict | None = None) -> Iterator[tuple[str, Path]]:
    """Set up (cached), start and finally stop a peer serving ``model`` (default: a tiny Qwen3);
    yields ``(base_url, model_dir)``."""
    kit = require_peer_kit()
    t0 = time.monotonic()
    setup = subprocess.run(["bash", str(kit / "setup.sh")], capture_output=True, text=True, timeout=1200,
                           check=False)
    if setup.returncode != 0:
        pytest.fail(f"tinker peer setup.sh failed:\n{setup.stdout[-2000:]}\n{setup.stderr[-3000:]}", pytrace=False)
    model = build_peer_model(workdir) if model is None else Path(model)
    state = workdir / "peer-state"
    port = _free_port()
    run_env = {**os.environ, "TINKER_PEER_MAX_LORA_ADAPTERS": "8", **(env or {})}
    start = subprocess.run(["bash", str(kit / "start.sh"), str(model), str(port), str(state)], capture_output=True,
                           text=True, timeout=600, env=run_env, check=False)
    if start.returncode != 0 or f"READY {port}" not in start.stdout:
        subprocess.run(["bash", str(kit / "stop.sh"), str(state)], capture_output=True, timeout=120, check=False)
        pytest.fail(f"tinker peer did not start:\n{start.stdout[-2000:]}\n{start.stderr[-3000:]}", pytrace=False)
    print(f"[tinker peer] set up and started in {time.monotonic() - t0:.1f} s on port {port}", file=sys.stderr)
    try:
        yield f"http://127.0.0.1:{port}", model
    finally:
        subprocess.run(["bash", str(kit / "stop.sh"), str(state)], capture_output=True, timeout=120, check=False)
