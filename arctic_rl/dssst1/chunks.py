"""DSSST1 byte chunking: one oversized frame <-> several self-describing chunk frames (the vendor's
``request_chunk`` / ``result_chunk`` metadata), each within a byte limit."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from .buffers import new_buffer
from .decode import as_view, check_int, frame_op, frame_tree, loads, parse_frame
from .encode import Blob, header_bytes, write_frame
from .format import CHUNK_KEYS, CHUNK_PAYLOAD, WIRE_VERSION, Buffer, WireError


def _chunk_key(kind: str) -> str:
    if kind not in CHUNK_KEYS:
        raise WireError(f"chunk kind must be one of {sorted(CHUNK_KEYS)}, got {kind!r}")
    return CHUNK_KEYS[kind]


def _chunk_frame(view: memoryview, start: int, end: int, key: str, desc: dict[str, Any]) -> bytearray:
    payload = Blob(CHUNK_PAYLOAD, "U8", [end - start], end - start, view[start:end])
    tree = ["d", [[CHUNK_PAYLOAD, ["t", CHUNK_PAYLOAD]]]]
    return write_frame(tree, [payload], {key: desc})


def encode_byte_chunks(
    frame: Buffer,
    *,
    kind: str,
    operation: str | None = None,
    max_bytes: int,
    chunk_group_id: str | None = None,
) -> list[bytes | bytearray]:
    """Split ``frame`` into DSSST1 chunk frames of at most ``max_bytes`` bytes each.

    Returns ``[frame]`` unchanged when it already fits (or ``max_bytes <= 0``). Each chunk is a
    frame ``{"payload": uint8[n]}`` whose ``op`` holds ``{"<kind>_chunk": {chunk_idx, total_chunks,
    frame_sha256, frame_size_bytes, chunk_group_id?, operation?}}``; ``kind="request"`` chunks always
    carry a group id (a fresh uuid4 unless given), the server's idempotency key.
    """
    key = _chunk_key(kind)
    for field, value in (("operation", operation), ("chunk_group_id", chunk_group_id)):
        if value is not None and not isinstance(value, str):
            raise WireError(f"{field} must be a string, got {type(value).__name__}")
    view = as_view(frame)
    size = len(view)
    if max_bytes <= 0 or size <= max_bytes:
        return [frame if isinstance(frame, (bytes, bytearray)) else bytes(view)]
    if kind == "request" and chunk_group_id is None:
        chunk_group_id = str(uuid.uuid4())
    desc: dict[str, Any] = {"chunk_idx": 0, "total_chunks": 0, "frame_sha256": hashlib.sha256(view).hexdigest()}
    desc["frame_size_bytes"] = size
    if chunk_group_id is not None:
        desc["chunk_group_id"] = chunk_group_id
    if operation is not None:
        desc["operation"] = operation

    def overhead(payload: int) -> tuple[int, int]:  # (total chunks, worst-case bytes around a payload)
        total = -(-size // payload)
        probe = dict(desc, chunk_idx=total - 1, total_chunks=total)
        blob = Blob(CHUNK_PAYLOAD, "U8", [payload], payload, memoryview(b""))
        tree = ["d", [[CHUNK_PAYLOAD, ["t", CHUNK_PAYLOAD]]]]
        meta = {"dss": json.dumps({"v": WIRE_VERSION, "tree": tree}), "op": json.dumps({key: probe})}
        return total, 8 + len(header_bytes(meta, [(blob, 0)]))

    payload = size
    for _ in range(64):  # payload shrinks monotonically to the largest that fits with its header
        total, extra = overhead(payload)
        if payload + extra <= max_bytes:
            break
        if max_bytes - extra < 1:
            raise WireError(f"max_bytes={max_bytes} cannot hold a chunk: its header alone takes {extra} bytes")
        payload = min(payload - 1, max_bytes - extra)
    else:
        raise WireError(f"could not size chunks for max_bytes={max_bytes}")
    return [
        _chunk_frame(view, start, min(start + payload, size), key, dict(desc, chunk_idx=idx, total_chunks=total))
        for idx, start in enumerate(range(0, size, payload))
    ]


def _chunk_descriptor(metadata: dict[str, str]) -> dict[str, Any] | None:
    op = frame_op(metadata)
    kinds = [kind for kind, key in CHUNK_KEYS.items() if key in op]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise WireError("frame carries both request_chunk and result_chunk metadata")
    desc = op[CHUNK_KEYS[kinds[0]]]
    if not isinstance(desc, dict):
        raise WireError(f"{CHUNK_KEYS[kinds[0]]} metadata must be an object")
    desc = dict(desc, kind=kinds[0])
    check_int(desc.get("total_chunks"), "total_chunks", 2**31)
    check_int(desc.get("chunk_idx"), "chunk_idx", 2**31)
    check_int(desc.get("frame_size_bytes"), "frame_size_bytes", 2**62)
    sha = desc.get("frame_sha256")
    if not isinstance(sha, str) or len(sha) != 64 or sha.strip("0123456789abcdef"):
        raise WireError(f"frame_sha256 must be 64 lowercase hex digits, got {sha!r}"[:200])
    for field in ("chunk_group_id", "operation"):
        if desc.get(field) is not None and not isinstance(desc[field], str):
            raise WireError(f"{field} must be a string, got {desc[field]!r}"[:200])
    return desc


def read_byte_chunk_metadata(frame: Buffer) -> dict[str, Any] | None:
    """The chunk descriptor of a chunk frame (with ``kind`` added), or ``None`` for a plain frame."""
    parsed = parse_frame(as_view(frame))
    frame_tree(parsed.metadata)
    return _chunk_descriptor(parsed.metadata)


def decode_byte_chunks(
    chunks: Sequence[Buffer], *, kind: str | None = None, max_frame_bytes: int | None = None
) -> bytes | bytearray:
    """Reassemble chunk frames (any order) into the original frame, verifying everything.

    A single plain (non-chunk) frame is returned as is. Otherwise the chunks must agree on kind
    (and match ``kind`` if given), total, size, sha256, group id and operation; indices must be
    unique and complete; the payloads must add up to ``frame_size_bytes`` (at most
    ``max_frame_bytes`` if given) and hash to ``frame_sha256``. Returns a fresh ``bytearray``.
    """
    if kind is not None:
        _chunk_key(kind)
    if isinstance(chunks, (bytes, bytearray, memoryview)) or not chunks:
        raise WireError("decode_byte_chunks needs a non-empty list of frames")
    views = [as_view(chunk) for chunk in chunks]
    descs = [_chunk_descriptor(parse_frame(view).metadata) for view in views]
    if len(chunks) == 1 and descs[0] is None:
        return chunks[0] if isinstance(chunks[0], (bytes, bytearray)) else bytes(views[0])
    first = descs[0]
    if first is None or None in descs:
        raise WireError(f"frame {descs.index(None)} of {len(chunks)} is not a chunk frame (no *_chunk metadata)")
    if kind is not None and first["kind"] != kind:
        raise WireError(f"expected {kind} chunks, got {first['kind']} chunks")
    for i, desc in enumerate(descs):
        for field in ("kind", "total_chunks", "frame_sha256", "frame_size_bytes", "chunk_group_id", "operation"):
            if desc.get(field) != first.get(field):
                raise WireError(f"chunk {i}: {field}={desc.get(field)!r} differs from chunk 0's {first.get(field)!r}")
    total, size = first["total_chunks"], first["frame_size_bytes"]
    if max_frame_bytes is not None and size > max_frame_bytes:
        raise WireError(f"chunked frame declares {size} bytes, above max_frame_bytes={max_frame_bytes}")
    by_idx: dict[int, torch.Tensor] = {}
    for view, desc in zip(views, descs):
        idx = desc["chunk_idx"]
        if idx >= total:
            raise WireError(f"chunk_idx {idx} is out of range for total_chunks={total}")
        if idx in by_idx:
            raise WireError(f"duplicate chunk_idx {idx}")
        obj = loads(view, copy=False)
        payload = obj.get(CHUNK_PAYLOAD) if isinstance(obj, dict) and len(obj) == 1 else None
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise WireError(f"chunk {idx} must decode to {{'payload': 1-D uint8 tensor}}")
        by_idx[idx] = payload
    if len(by_idx) != total:  # distinct and in range, so one of 0..len(by_idx) is missing
        missing = [i for i in range(min(total, len(by_idx) + 10)) if i not in by_idx]
        raise WireError(f"missing chunk_idx {missing} (got {len(by_idx)} of total_chunks={total})")
    got = sum(p.numel() for p in by_idx.values())
    if got != size:
        raise WireError(f"chunk payloads add up to {got} bytes, frame_size_bytes says {size}")
    out, pos = new_buffer(size), 0  # the payloads add up to size: every byte is written
    with memoryview(out) as dst:  # (a bytearray slice refuses numpy arrays; a memoryview takes them)
        for idx in range(total):
            n = by_idx[idx].numel()
            dst[pos : pos + n] = by_idx[idx].numpy()
            pos += n
    if hashlib.sha256(out).hexdigest() != first["frame_sha256"]:
        raise WireError("reassembled frame does not match frame_sha256 (corrupted or foreign chunk)")
    return out

