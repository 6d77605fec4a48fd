"""Which Arctic wire generation a server speaks, and how bodies are encoded for it.

* v2 (Arctic-Platform main): tensor bodies are DSSST1 frames (:mod:`arctic_rl.dssst1`).
* v1 (PyPI ``arctic-platform`` 0.1.2): tensor bodies are ``torch.save`` archives; responses are
  read only through :func:`arctic_rl.v1compat.torch_load_safe` (``weights_only=True``), never
  with a full unpickler.

:func:`detect_protocol` asks the server's ``/openapi.json`` (FastAPI): v2-only paths mean v2,
v1-only paths mean v1. Responses are decoded by their ``Content-Type`` (JSON or octet-stream).
:func:`encode_body` / :func:`decode_response` are the codecs of :mod:`.dialect` under the version's number.
What is not here: the HTTP session (:mod:`.http`) or the request shapes (:mod:`.dialect`, the role modules).
"""

from __future__ import annotations

import logging
from typing import Any

import requests

from arctic_rl.protocol import V1_ONLY_PATHS, V2_ONLY_PATHS, Paths, ProtocolVersion
from verl.remote_backend.errors import RemoteBackendConfigError, RemoteProtocolError, RemoteServerError

from .dialect import dialect_for
from .http import ArcticHttp

__all__ = ["decode_response", "detect_protocol", "encode_body"]

logger = logging.getLogger(__name__)


def detect_protocol(http: ArcticHttp, configured: str = "auto") -> ProtocolVersion:
    """The wire generation to speak: the configured one, or what the server's OpenAPI lists."""
    if configured in ("v1", "v2"):
        return ProtocolVersion(int(configured[1]))
    if configured != "auto":
        raise RemoteBackendConfigError("remote_backend.server.protocol", "unknown wire generation",
                                       allowed=["auto", "v1", "v2"], received=configured)
    try:
        spec = http.get_json(Paths.OPENAPI)
    except RemoteServerError as exc:
        raise RemoteProtocolError(
            f"GET {Paths.OPENAPI}", f"cannot detect the protocol generation (HTTP {exc.status}: "
            f"{exc.server_message}); set remote_backend.server.protocol to v1 or v2") from None
    paths = set((spec or {}).get("paths", {}) if isinstance(spec, dict) else ())
    if paths & set(V2_ONLY_PATHS):
        return ProtocolVersion.V2
    if paths & set(V1_ONLY_PATHS):
        return ProtocolVersion.V1
    raise RemoteProtocolError(
        f"GET {Paths.OPENAPI}", f"lists none of the v2 paths {list(V2_ONLY_PATHS)} nor the v1 paths "
        f"{list(V1_ONLY_PATHS)}; set remote_backend.server.protocol to v1 or v2")


def encode_body(version: ProtocolVersion, obj: Any) -> bytes | bytearray:
    """A tensor body for ``version`` (DSSST1 frame or ``torch.save`` bytes), sent as octet-stream."""
    return dialect_for(version).encode_tensors(obj)


def decode_response(version: ProtocolVersion, resp: requests.Response, endpoint: str) -> Any:
    """A JSON or octet-stream answer decoded safely; undecodable answers are protocol errors."""
    return dialect_for(version).decode(resp, endpoint)
