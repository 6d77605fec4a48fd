"""Checkpoint paths and layout of the reference server; path safety lives here.

Layout (``base`` is a training job's directory, or a request's ``path``)::

    <checkpoint root>/<base>/
        latest                      # text: "checkpoint-<step>" of the newest save
        checkpoint-<step>/          # DeepSpeed model + optimizer + scheduler states,
            arctic_rl_checkpoint.json   # our marker (format, global step, model name)
            arctic_rl_rng.pt        # RNG states (read back with weights_only=True)
            hf/                     # optional save_pretrained export (``export_hf``)

Every path a client names is resolved *inside* the server's ``--checkpoint-root``: ``..``
components, absolute paths elsewhere and symlinks that lead out are refused with a 400
(:class:`~arctic_rl.server.errors.BadRequest`). ``JobConfig.checkpoint_path`` is the exception
that is mapped rather than refused, because clients send absolute paths of *their* machine: a
path inside the root is used as is, any other is taken as a sub-directory name under the root
(``/data/run1`` -> ``<root>/data/run1``).

What is not here: what a checkpoint holds (the training engine writes it).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from arctic_rl.server.errors import BadRequest, NotFound

__all__ = [
    "MARKER_FILE",
    "RNG_FILE",
    "checkpoint_dir",
    "find_checkpoint",
    "job_directory",
    "load_rng_state",
    "prune_checkpoints",
    "read_latest",
    "resolve_request_path",
    "save_rng_state",
    "write_latest",
    "write_marker",
]

MARKER_FILE = "arctic_rl_checkpoint.json"
RNG_FILE = "arctic_rl_rng.pt"
LATEST_FILE = "latest"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def _inside(root: Path, path: Path) -> bool:
    return path == root or root in path.parents


def _check_text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{field}: expected a non-empty path string", field=field, received=value)
    if "\x00" in value:
        raise BadRequest(f"{field}: path contains a NUL byte", field=field, received=value)
    return value


def resolve_request_path(root: Path, value: str, *, field: str = "path") -> Path:
    """A client-named path, resolved (symlinks followed) and guaranteed inside ``root``.

    Relative paths are taken relative to ``root``; absolute ones must already lie inside it.
    """
    text = _check_text(value, field)
    requested = Path(text)
    if ".." in requested.parts:
        raise BadRequest(f"{field}: '..' is not allowed in checkpoint paths", field=field, received=text)
    candidate = requested if requested.is_absolute() else root / requested
    resolved = Path(os.path.realpath(candidate))
    if not _inside(root, resolved):
        raise BadRequest(
            f"{field}: resolves outside the server's checkpoint root",
            field=field,
            allowed=f"a path inside {root}",
            received=text,
        )
    return resolved


def job_directory(root: Path, checkpoint_path: str | None, default_name: str) -> Path:
    """The directory of a training job (see the module docstring for the mapping)."""
    if checkpoint_path is None or not str(checkpoint_path).strip():
        return resolve_request_path(root, default_name, field="checkpoint_path")
    text = _check_text(checkpoint_path, "checkpoint_path")
    requested = Path(text)
    if requested.is_absolute():
        resolved = Path(os.path.realpath(requested))
        if _inside(root, resolved):
            return resolved
        requested = requested.relative_to(requested.anchor)
    return resolve_request_path(root, str(requested), field="checkpoint_path")


def checkpoint_dir(base: Path, step: int) -> Path:
    return base / f"checkpoint-{int(step)}"


def write_latest(base: Path, name: str) -> None:
    """Point ``base/latest`` at ``name`` atomically."""
    tmp = base / f".{LATEST_FILE}.tmp"
    tmp.write_text(name)
    os.replace(tmp, base / LATEST_FILE)


def read_latest(base: Path) -> str | None:
    try:
        text = (base / LATEST_FILE).read_text().strip()
    except OSError:
        return None
    if text.isdigit():  # the vendor writes the bare step
        text = f"checkpoint-{text}"
    return text if _CKPT_RE.match(text) else None


def write_marker(ckpt: Path, info: dict[str, Any]) -> None:
    (ckpt / MARKER_FILE).write_text(json.dumps({"format": 1, **info}, indent=1, sort_keys=True))


def find_checkpoint(root: Path, base: Path, step: int | None) -> Path:
    """The checkpoint directory to load: ``base/checkpoint-<step>``; else ``base`` itself when it
    is a checkpoint; else what ``base/latest`` names. :class:`NotFound` when there is none."""
    if step is not None:
        candidate = checkpoint_dir(base, step)
    elif (base / MARKER_FILE).is_file():
        candidate = base
    else:
        latest = read_latest(base)
        if latest is None:
            raise NotFound(f"no checkpoint under {base} (no 'latest' pointer)", field="path", received=str(base))
        candidate = base / latest
    candidate = Path(os.path.realpath(candidate))
    if not _inside(root, candidate):
        raise BadRequest("path: resolves outside the server's checkpoint root", field="path", received=str(candidate))
    if not (candidate / MARKER_FILE).is_file():
        raise NotFound(
            f"no checkpoint at {candidate}", field="step" if step is not None else "path", received=str(candidate)
        )
    return candidate


def prune_checkpoints(base: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Remove all but the newest ``keep`` ``checkpoint-<step>`` directories of ``base``."""
    found = []
    for child in base.iterdir() if base.is_dir() else ():
        match = _CKPT_RE.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            found.append((int(match.group(1)), child))
    found.sort()
    removed = []
    for _, path in found[: max(0, len(found) - keep)]:
        if protect is not None and path == protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def save_rng_state(ckpt: Path) -> None:
    """torch (CPU and CUDA), Python and NumPy RNG states, as tensors and plain values."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass
    torch.save(state, ckpt / RNG_FILE)


def load_rng_state(ckpt: Path) -> bool:
    """Restore what :func:`save_rng_state` wrote (``weights_only=True``). False if absent."""
    path = ckpt / RNG_FILE
    if not path.is_file():
        return False
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    return True
