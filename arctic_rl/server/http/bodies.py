"""Request bodies in and response bodies out, in the three encodings the server speaks.

* DSSST1 frames (v2 tensor bodies, :mod:`arctic_rl.dssst1`): read into one ``bytearray`` and
  decoded zero-copy (the tensors are views of the received buffer);
* ``torch.save`` archives (v1 tensor bodies): decoded only by
  :func:`arctic_rl.v1compat.torch_load_safe` (``weights_only=True``) -- never plain unpickling;
* JSON (control calls, v1 ``/generate``).

Bodies are read with a size cap (``--max-body-mb``): a larger one is a 413; and a time limit
(``--body-timeout-s``): a body still incomplete then is a 408 (a trickling client cannot hold a
request open). Decoding errors, JSON nested too deeply included, are 400s naming the body.
What is not here: what a body must contain (:mod:`.validation`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from arctic_rl import dssst1
from arctic_rl.protocol import JSON_MEDIA_TYPE, OCTET_STREAM
from arctic_rl.server.errors import BadRequest, PayloadTooLarge, RequestTimeout, from_validation_error

__all__ = [
    "decode_dssst1",
    "decode_json",
    "decode_model",
    "decode_v1",
    "dssst1_response",
    "is_json",
    "json_response",
    "read_body",
    "v1_response",
]

#: after the cap is hit, keep draining (and discarding) this much so the client can read the 413
_DRAIN_LIMIT = 1 << 30


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"body of {size} bytes exceeds the server's limit of {limit} bytes (--max-body-mb)",
        field="body",
        allowed=limit,
        received=size,
    )


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytearray:
    """The raw body as one ``bytearray`` (no extra copy); 413 above ``limit`` bytes, 408 when it is
    not complete within ``timeout_s`` seconds."""
    declared = request.headers.get("content-length")
    size_hint = int(declared) if declared and declared.isdigit() else None
    body = bytearray()
    seen = {"received": 0, "over": size_hint is not None and size_hint > limit}

    async def receive() -> None:
        async for chunk in request.stream():
            seen["received"] += len(chunk)
            if seen["over"] or seen["received"] > limit:
                seen["over"] = True
                if seen["received"] > _DRAIN_LIMIT:
                    return
                continue
            body.extend(chunk)

    try:  # one deadline for the whole body (not one timer per chunk)
        await (receive() if timeout_s is None else asyncio.wait_for(receive(), timeout_s))
    except TimeoutError:
        raise RequestTimeout(
            f"body: {seen['received']} of {size_hint if size_hint is not None else '?'} bytes received in "
            f"{timeout_s:g} s (--body-timeout-s)",
            field="body",
            allowed=timeout_s,
            received=seen["received"],
        ) from None
    if seen["over"]:
        raise _too_large(max(seen["received"], size_hint or 0), limit)
    return body


def is_json(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == JSON_MEDIA_TYPE


def decode_dssst1(body: bytearray) -> Any:
    if not body:
        raise BadRequest("body: expected a DSSST1 frame, got an empty body", field="body", received=0)
    try:
        return dssst1.loads(body)
    except dssst1.WireError as exc:
        raise BadRequest(f"body: malformed DSSST1 frame: {exc}", field="body") from None
    except RecursionError:
        raise BadRequest("body: malformed DSSST1 frame: nested too deeply", field="body") from None


def decode_v1(body: bytearray) -> Any:
    from arctic_rl.v1compat import torch_load_safe

    if not body:
        raise BadRequest("body: expected a torch.save archive, got an empty body", field="body", received=0)
    try:
        return torch_load_safe(body)
    except dssst1.WireError as exc:
        raise BadRequest(f"body: {exc}", field="body") from None


def decode_json(body: bytearray, *, required: bool = True) -> Any:
    """Parsed JSON; ``None`` for an empty body when not ``required``."""
    if not body.strip():
        if required:
            raise BadRequest("body: expected a JSON object, got an empty body", field="body")
        return None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"body: invalid JSON: {exc}", field="body") from None
    except RecursionError:
        raise BadRequest("body: invalid JSON: nested too deeply", field="body") from None


def decode_model(body: bytearray, model: type[BaseModel], *, required: bool = False) -> BaseModel:
    """A JSON body validated as ``model`` (an empty body is the model's defaults unless required)."""
    data = decode_json(body, required=required)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadRequest("body: expected a JSON object", field="body", received=type(data).__name__)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def dssst1_response(obj: Any) -> Response:
    return Response(content=memoryview(dssst1.dumps(obj)), media_type=OCTET_STREAM)


def v1_response(obj: Any) -> Response:
    from arctic_rl.v1compat import torch_save_bytes

    return Response(content=torch_save_bytes(obj), media_type=OCTET_STREAM)


def json_response(obj: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(content=obj, status_code=status_code)
