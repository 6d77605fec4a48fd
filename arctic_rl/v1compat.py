"""v1 body helpers: the only place this project touches ``torch.save`` pickles.

Arctic RL v1 (PyPI ``arctic-platform`` 0.1.2) sends tensor bodies as ``torch.save`` archives. The
vendor's v1 server reads them with ``torch.load(weights_only=False)``, which runs any code the
sender pickled. This module reads them only through torch's restricted unpickler
(``weights_only=True``: tensors, primitive containers and a small allow-list of torch types, no
arbitrary globals), so a hostile body is refused instead of executed. It is not a codec of its
own: v2 speaks :mod:`arctic_rl.dssst1`, which never unpickles at all.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from arctic_rl.dssst1 import WireError

__all__ = ["torch_load_safe", "torch_save_bytes"]


def torch_load_safe(data: bytes | bytearray | memoryview) -> Any:
    """Decode a v1 ``torch.save`` body with ``weights_only=True`` onto the CPU.

    Raises :class:`~arctic_rl.dssst1.WireError` for anything the restricted unpickler refuses
    (globals outside its allow-list such as ``os.system``) and for truncated or foreign bytes.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a v1 torch.save body is bytes-like, got {type(data).__name__}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - the unpickler raises many types; callers get one
        raise WireError(f"refusing v1 torch.save body: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """The specific cause out of torch's message, without its advice to retry with weights_only=False."""
    boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line.split("WeightsUnpickler error:")[-1].strip() for line in lines if not line.startswith(boilerplate)]
    return f"{type(exc).__name__}: {' '.join(line for line in lines if line)[:500] or 'no detail'}"


def torch_save_bytes(obj: Any) -> bytes:
    """Encode ``obj`` as a v1 ``torch.save`` body (what the reference server answers v1 clients)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
