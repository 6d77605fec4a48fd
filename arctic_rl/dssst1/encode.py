"""DSSST1 encoding: a nested object of tensors and JSON values -> one frame, each tensor copied once."""

from __future__ import annotations

import json
import sys
from typing import Any, Final, NamedTuple

import torch

from .buffers import new_buffer
from .format import (
    JSON_SCALARS,
    MAX_HEADER_BYTES,
    PLACEHOLDER,
    ROOT,
    ST_RANK,
    TORCH_TO_ST,
    WIRE_VERSION,
    WireError,
    json_str,
)


class Blob(NamedTuple):
    name: str
    st_dtype: str
    shape: list[int]
    nbytes: int
    source: torch.Tensor | memoryview


_EXACT_SCALARS: Final = frozenset(JSON_SCALARS)


def plain_json(obj: dict | list) -> bool:
    """True if ``obj`` is made only of str-keyed dicts, lists and JSON scalars (-> one "j" node).

    An explicit stack and exact-type checks first (subclasses take the ``isinstance`` path): a ``/generate``
    answer with log-probs is two small dicts per generated token, so this walk meets ~260k containers at
    256 samples x 512 tokens and is most of what encoding such a frame costs. Nesting deeper than the
    interpreter's recursion limit (a cyclic object: ever deeper) raises ``RecursionError``, as the recursive
    encoder does, which :func:`dumps` reports as nested too deeply."""
    stack: list[tuple[dict | list, int]] = [(obj, 0)]
    scalars, containers, limit = _EXACT_SCALARS, (dict, list), sys.getrecursionlimit()
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise RecursionError("DSSST1: a dict/list nested deeper than the recursion limit (a cycle?)")
        if isinstance(node, dict):
            for key in node:
                if type(key) is not str and not isinstance(key, str):
                    return False
            items = node.values()
        else:
            items = node
        for item in items:
            kind = type(item)
            if kind in scalars:
                continue
            if kind is dict or kind is list or isinstance(item, containers):
                stack.append((item, depth + 1))
            elif not isinstance(item, JSON_SCALARS):
                return False
    return True


class _Encoder:
    def __init__(self) -> None:
        self.blobs: list[Blob] = []
        self.names: set[str] = {PLACEHOLDER}

    def node(self, obj: Any, path: str) -> list:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, JSON_SCALARS):
            return ["j", obj]
        if isinstance(obj, tuple):  # tuples always structural: JSON would turn them into lists
            return ["u", [self.node(v, join_path(path, str(i))) for i, v in enumerate(obj)]]
        if isinstance(obj, list):
            if plain_json(obj):
                return ["j", obj]
            return ["l", [self.node(v, join_path(path, str(i))) for i, v in enumerate(obj)]]
        if isinstance(obj, dict):
            for key in obj:
                if not isinstance(key, str):
                    raise WireError(f"dict keys must be str; got {type(key).__name__} {key!r} at {path or '<root>'}")
            if plain_json(obj):
                return ["j", obj]
            return ["d", [[key, self.node(value, join_path(path, key))] for key, value in obj.items()]]
        raise WireError(
            f"cannot encode {type(obj).__module__}.{type(obj).__qualname__} at {path or '<root>'}: DSSST1 carries "
            "torch tensors, dict/list/tuple and JSON scalars (None, bool, int, float, str)"
        )

    def tensor(self, t: torch.Tensor, path: str) -> list:
        where = path or "<root>"
        if t.layout != torch.strided:
            raise WireError(f"tensor at {where} has layout {t.layout}; only dense (strided) tensors are encodable")
        st_dtype = TORCH_TO_ST.get(t.dtype)
        if st_dtype is None:
            raise WireError(f"tensor at {where} has dtype {t.dtype}, which safetensors cannot name")
        t = t.detach().resolve_conj().resolve_neg()
        name = path or ROOT
        if name in self.names:  # "a.b" the key vs a -> b the path: keep names unique
            suffix = 1
            while f"{name}#{suffix}" in self.names:
                suffix += 1
            name = f"{name}#{suffix}"
        self.names.add(name)
        self.blobs.append(Blob(name, st_dtype, list(t.shape) or [1], t.numel() * t.element_size(), t))
        return ["t", name, {"scalar": True}] if t.dim() == 0 else ["t", name]


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def header_bytes(metadata: dict[str, str], layout: list[tuple[Blob, int]]) -> bytes:
    parts = ['{"__metadata__":{', ",".join(f"{json_str(k)}:{json_str(v)}" for k, v in metadata.items()), "}"]
    for blob, start in layout:
        shape = ",".join(map(str, blob.shape))
        parts.append(
            f',{json_str(blob.name)}:{{"dtype":"{blob.st_dtype}","shape":[{shape}],'
            f'"data_offsets":[{start},{start + blob.nbytes}]}}'
        )
    parts.append("}")
    try:
        raw = "".join(parts).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise WireError(f"a dict key or tensor name is not encodable as UTF-8: {exc}") from None
    return raw + b" " * (-len(raw) % 8)


def _layout(blobs: list[Blob]) -> tuple[list[tuple[Blob, int]], int]:
    if not blobs:
        blobs = [Blob(PLACEHOLDER, "U8", [1], 1, memoryview(b"\x00"))]
    layout, offset = [], 0
    for blob in sorted(blobs, key=lambda b: (-ST_RANK[b.st_dtype], b.name)):
        layout.append((blob, offset))
        offset += blob.nbytes
    return layout, offset


def _copy_into(out: memoryview, pos: int, blob: Blob) -> None:
    src = blob.source
    if isinstance(src, memoryview):
        out[pos : pos + blob.nbytes] = src
    elif src.device.type == "cpu" and src.is_contiguous():  # one memcpy
        out[pos : pos + blob.nbytes] = src.reshape(-1).view(torch.uint8).numpy()
    else:  # strided or on an accelerator: torch writes it into place (contiguous) in one pass
        dst = torch.frombuffer(out, dtype=src.dtype, count=src.numel(), offset=pos)
        dst.view(src.shape).copy_(src)


def write_frame(tree: list, blobs: list[Blob], op: dict | None) -> bytearray:
    try:
        metadata = {"dss": json.dumps({"v": WIRE_VERSION, "tree": tree})}
        if op:
            metadata["op"] = json.dumps(op)
    except (TypeError, ValueError, RecursionError) as exc:
        raise WireError(f"metadata or JSON values are not JSON-serializable: {exc}") from None
    layout, data_len = _layout(blobs)
    header = header_bytes(metadata, layout)
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"header would be {len(header)} bytes, above MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    start = 8 + len(header)
    frame = new_buffer(start + data_len)  # uninitialized: the layout tiles it, every byte is written
    with memoryview(frame) as out:
        out[:8] = len(header).to_bytes(8, "little")
        out[8:start] = header
        for blob, offset in layout:
            if blob.nbytes:
                _copy_into(out, start + offset, blob)
    return frame


def dumps(obj: Any, *, metadata: dict[str, Any] | None = None) -> bytearray:
    """Encode ``obj`` (nested dict/list/tuple of tensors and JSON scalars) as one DSSST1 frame.

    ``metadata`` (a JSON object) becomes the frame's ``op`` entry. Tensors may be non-contiguous
    or on an accelerator; each is copied exactly once, straight into the returned ``bytearray``.
    ``requests`` sends a bytearray body as is; ``httpx``'s ``content=`` iterates anything but
    ``bytes``, so give it ``content=[frame]`` plus a ``Content-Length`` header (or ``bytes(frame)``,
    one copy).
    """
    if metadata is not None and not isinstance(metadata, dict):
        raise WireError(f"metadata must be a dict, got {type(metadata).__name__}")
    encoder = _Encoder()
    try:
        tree = encoder.node(obj, "")
    except RecursionError:
        raise WireError("object is nested too deeply (or contains itself)") from None
    return write_frame(tree, encoder.blobs, metadata)

