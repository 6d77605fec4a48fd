"""DSSST1: the tensor wire format of Arctic RL v2, encoded and decoded without pickle.

A frame is one safetensors blob, byte-compatible with what Arctic-Platform's own encoder emits::

    [ u64 little-endian header_len | JSON header, space-padded to 8 bytes | tensor bytes ]

The header's ``__metadata__`` holds two JSON *strings*: ``dss`` = ``{"v": "DSSST1", "tree": node}``,
the skeleton of the encoded object, and optionally ``op``, operation metadata (router replay, chunk
descriptors). Skeleton nodes: ``["d", [[key, node], ...]]`` dict, ``["l", [node, ...]]`` list,
``["u", [node, ...]]`` tuple, ``["j", value]`` JSON value, ``["t", name]`` tensor (a 0-dim tensor
is stored with shape ``[1]`` and the node ``["t", name, {"scalar": true}]``). Tensors are named by
their dotted path and laid out the way safetensors does it (descending dtype, then name), so the
frames reproduce the vendor's bytes. A frame without tensors carries a 1-byte ``__dss_empty__``.

This module is the whole codec and nothing else: no HTTP, no torch.save (v1 bodies live in
:mod:`arctic_rl.v1compat`). It is simpler than safetensors-plus-glue because it never builds an
intermediate dict of tensors: :func:`dumps` computes the header first and copies each tensor once
into one ``bytearray`` allocated at its final size; :func:`loads` returns views over the received
buffer.

Aliasing -- read this before mutating decoded tensors:
    * ``loads(bytearray | writable memoryview)`` is zero-copy: the tensors share memory with the
      buffer (writes show through both ways) and keep it alive; the bytearray cannot be resized
      while any of them lives (``BufferError``).
    * ``loads(bytes)`` copies the tensor section once (``bytes`` are immutable, and torch has no
      read-only tensors), so the tensors are ordinary writable memory. ``copy=False`` skips that
      copy and hands out views over the immutable bytes: then never write to them.
    * Tensors whose offset is misaligned for their dtype (not produced by any safetensors encoder,
      but legal) are copied individually.

Errors: every decoding problem raises :class:`WireError` (a ``ValueError``) naming what is wrong;
a frame is validated before any tensor is built (header length capped at ``MAX_HEADER_BYTES``,
offsets must tile the data section exactly, byte counts must match shape x dtype), and pickle or
``torch.save`` payloads are refused outright. Encoding problems (a type JSON cannot carry, a dtype
safetensors cannot name) raise :class:`WireError` too.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import sys
import threading
import uuid
import warnings
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import torch

__all__ = [
    "MAX_HEADER_BYTES",
    "MEDIA_TYPE",
    "WIRE_VERSION",
    "WireError",
    "decode_byte_chunks",
    "dumps",
    "encode_byte_chunks",
    "loads",
    "loads_with_metadata",
    "read_byte_chunk_metadata",
    "read_metadata",
]

WIRE_VERSION: Final = "DSSST1"
MEDIA_TYPE: Final = "application/octet-stream"
MAX_HEADER_BYTES: Final = 100_000_000  # the bound safetensors itself enforces

Buffer = bytes | bytearray | memoryview

_PLACEHOLDER: Final = "__dss_empty__"
_ROOT: Final = "__root__"
_CHUNK_KEYS: Final = {"request": "request_chunk", "result": "result_chunk"}
_CHUNK_PAYLOAD: Final = "payload"
_MAX_NDIM: Final = 64
_MAX_DIM: Final = 2**63 - 1

# safetensors dtype names in the order of its Rust ``Dtype`` enum: frames sort tensors by this
# rank, descending, then by name. Torch dtypes missing from this build are skipped.
_ST_ORDER: Final = (
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E8M0", "float8_e8m0fnu"), ("I16", "int16"),
    ("U16", "uint16"), ("F16", "float16"), ("BF16", "bfloat16"), ("I32", "int32"),
    ("U32", "uint32"), ("F32", "float32"), ("C64", "complex64"), ("F64", "float64"),
    ("I64", "int64"), ("U64", "uint64"),
)  # fmt: skip
_ST_RANK: Final = {name: rank for rank, (name, _) in enumerate(_ST_ORDER)}
_ST_TO_TORCH: Final = {n: getattr(torch, t) for n, t in _ST_ORDER if hasattr(torch, t)}
_TORCH_TO_ST: Final = {dtype: name for name, dtype in _ST_TO_TORCH.items()}
_JSON_SCALARS: Final = (type(None), bool, int, float, str)
_json_str = json.JSONEncoder(ensure_ascii=False).encode  # escapes exactly like serde_json


def _uninitialized_allocator() -> Any:
    """``n -> bytearray`` whose bytes are NOT initialized, backed by huge pages when large.

    A fresh 80 MB ``bytearray(n)`` costs more than the copy into it: ``n`` zero bytes written over
    ~20k freshly faulted 4 KiB pages. Our frames overwrite every byte anyway, so on CPython/Linux
    an empty bytearray is grown with the C API ``PyByteArray_Resize`` (no zero-fill) and advised
    ``MADV_HUGEPAGE`` before its first touch (numpy does the same for its arrays): encoding gets
    about 3-4x faster. Elsewhere it falls back to ``bytearray(n)``.
    """
    try:
        if sys.implementation.name != "cpython" or not hasattr(mmap, "MADV_HUGEPAGE"):
            raise OSError("not CPython on Linux")
        resize = ctypes.pythonapi.PyByteArray_Resize
        resize.restype, resize.argtypes = ctypes.c_int, (ctypes.py_object, ctypes.c_ssize_t)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.restype, madvise.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return bytearray
    page = mmap.PAGESIZE

    def allocate(n: int) -> bytearray:
        buf = bytearray()
        if n:
            resize(buf, n)  # raises MemoryError on failure
        if n >= _LARGE:  # advice is a hint: failure only costs speed
            start = ctypes.addressof((ctypes.c_char * n).from_buffer(buf))
            first, last = -(-start // page) * page, (start + n) // page * page
            madvise(first, last - first, mmap.MADV_HUGEPAGE)
        return buf

    return allocate


class _ReusedBuffers:
    """``n -> bytearray`` that hands a thread its previous large buffer again once nobody holds it.

    Fresh large buffers are what makes a round trip slow now and then: their pages are new to the
    process, and faulting them in (huge pages, or memory the kernel or hypervisor must first find
    and clear) took 140-250 ms per 84 MB frame in bursts, while rewriting memory the process
    already has takes ~20 ms. So each thread keeps its last buffer of at least ``_LARGE`` bytes;
    the next request reuses it (resized in place) when its only reference is this cache -- the
    caller dropped the frame, and no decoded tensor or memoryview still exports it. Otherwise a
    fresh buffer is made and cached instead, so a thread holds at most one idle buffer, of the
    size it last asked for. The "only reference" test is a reference count compared with one
    measured here for a buffer known to be unshared, so it does not depend on how the interpreter
    counts its own temporaries; without a GIL (free-threaded builds) nothing is reused.
    """

    def __init__(self, fresh: Any) -> None:
        self._fresh = fresh
        self._local = threading.local()
        self._resize = None
        gil = getattr(sys, "_is_gil_enabled", lambda: True)()
        if sys.implementation.name == "cpython" and gil and fresh is not bytearray:
            self._resize = ctypes.pythonapi.PyByteArray_Resize
            self._local.buf = bytearray(1)
            self._unshared = self._references()  # the count of a buffer only this cache holds
            self._local.buf = None

    def _references(self) -> int:
        return sys.getrefcount(self._local.buf)

    def __call__(self, n: int) -> bytearray:
        if n < _LARGE or self._resize is None:
            return self._fresh(n)
        if getattr(self._local, "buf", None) is not None and self._references() == self._unshared:
            buf = self._local.buf
            try:
                self._resize(buf, n)  # in place below the allocation; realloc (pages kept) above it
                return buf
            except (MemoryError, BufferError):
                pass
        self._local.buf = None  # let go of the idle buffer before making a new one
        buf = self._fresh(n)
        self._local.buf = buf
        return buf


_LARGE: Final = 4 << 20
# callers must overwrite every byte before exposing it
_new_buffer = _ReusedBuffers(_uninitialized_allocator())


class WireError(ValueError):
    """A DSSST1 frame (or chunk set) is malformed, hostile or of another protocol; or an object
    cannot be encoded. Plain ``ValueError`` subclass, picklable, message says what is wrong."""


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


class _Blob(NamedTuple):
    name: str
    st_dtype: str
    shape: list[int]
    nbytes: int
    source: torch.Tensor | memoryview


_EXACT_SCALARS: Final = frozenset(_JSON_SCALARS)


def _plain_json(obj: dict | list) -> bool:
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
            elif not isinstance(item, _JSON_SCALARS):
                return False
    return True


class _Encoder:
    def __init__(self) -> None:
        self.blobs: list[_Blob] = []
        self.names: set[str] = {_PLACEHOLDER}

    def node(self, obj: Any, path: str) -> list:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, _JSON_SCALARS):
            return ["j", obj]
        if isinstance(obj, tuple):  # tuples always structural: JSON would turn them into lists
            return ["u", [self.node(v, _join(path, str(i))) for i, v in enumerate(obj)]]
        if isinstance(obj, list):
            if _plain_json(obj):
                return ["j", obj]
            return ["l", [self.node(v, _join(path, str(i))) for i, v in enumerate(obj)]]
        if isinstance(obj, dict):
            for key in obj:
                if not isinstance(key, str):
                    raise WireError(f"dict keys must be str; got {type(key).__name__} {key!r} at {path or '<root>'}")
            if _plain_json(obj):
                return ["j", obj]
            return ["d", [[key, self.node(value, _join(path, key))] for key, value in obj.items()]]
        raise WireError(
            f"cannot encode {type(obj).__module__}.{type(obj).__qualname__} at {path or '<root>'}: DSSST1 carries "
            "torch tensors, dict/list/tuple and JSON scalars (None, bool, int, float, str)"
        )

    def tensor(self, t: torch.Tensor, path: str) -> list:
        where = path or "<root>"
        if t.layout != torch.strided:
            raise WireError(f"tensor at {where} has layout {t.layout}; only dense (strided) tensors are encodable")
        st_dtype = _TORCH_TO_ST.get(t.dtype)
        if st_dtype is None:
            raise WireError(f"tensor at {where} has dtype {t.dtype}, which safetensors cannot name")
        t = t.detach().resolve_conj().resolve_neg()
        name = path or _ROOT
        if name in self.names:  # "a.b" the key vs a -> b the path: keep names unique
            suffix = 1
            while f"{name}#{suffix}" in self.names:
                suffix += 1
            name = f"{name}#{suffix}"
        self.names.add(name)
        self.blobs.append(_Blob(name, st_dtype, list(t.shape) or [1], t.numel() * t.element_size(), t))
        return ["t", name, {"scalar": True}] if t.dim() == 0 else ["t", name]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _header_bytes(metadata: dict[str, str], layout: list[tuple[_Blob, int]]) -> bytes:
    parts = ['{"__metadata__":{', ",".join(f"{_json_str(k)}:{_json_str(v)}" for k, v in metadata.items()), "}"]
    for blob, start in layout:
        shape = ",".join(map(str, blob.shape))
        parts.append(
            f',{_json_str(blob.name)}:{{"dtype":"{blob.st_dtype}","shape":[{shape}],'
            f'"data_offsets":[{start},{start + blob.nbytes}]}}'
        )
    parts.append("}")
    try:
        raw = "".join(parts).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise WireError(f"a dict key or tensor name is not encodable as UTF-8: {exc}") from None
    return raw + b" " * (-len(raw) % 8)


def _layout(blobs: list[_Blob]) -> tuple[list[tuple[_Blob, int]], int]:
    if not blobs:
        blobs = [_Blob(_PLACEHOLDER, "U8", [1], 1, memoryview(b"\x00"))]
    layout, offset = [], 0
    for blob in sorted(blobs, key=lambda b: (-_ST_RANK[b.st_dtype], b.name)):
        layout.append((blob, offset))
        offset += blob.nbytes
    return layout, offset


def _copy_into(out: memoryview, pos: int, blob: _Blob) -> None:
    src = blob.source
    if isinstance(src, memoryview):
        out[pos : pos + blob.nbytes] = src
    elif src.device.type == "cpu" and src.is_contiguous():  # one memcpy
        out[pos : pos + blob.nbytes] = src.reshape(-1).view(torch.uint8).numpy()
    else:  # strided or on an accelerator: torch writes it into place (contiguous) in one pass
        dst = torch.frombuffer(out, dtype=src.dtype, count=src.numel(), offset=pos)
        dst.view(src.shape).copy_(src)


def _write_frame(tree: list, blobs: list[_Blob], op: dict | None) -> bytearray:
    try:
        metadata = {"dss": json.dumps({"v": WIRE_VERSION, "tree": tree})}
        if op:
            metadata["op"] = json.dumps(op)
    except (TypeError, ValueError, RecursionError) as exc:
        raise WireError(f"metadata or JSON values are not JSON-serializable: {exc}") from None
    layout, data_len = _layout(blobs)
    header = _header_bytes(metadata, layout)
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"header would be {len(header)} bytes, above MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    start = 8 + len(header)
    frame = _new_buffer(start + data_len)  # uninitialized: the layout tiles it, every byte is written
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
    return _write_frame(tree, encoder.blobs, metadata)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


class _Frame(NamedTuple):
    metadata: dict[str, str]
    entries: dict[str, tuple[str, list[int], int, int]]  # name -> (dtype, shape, start, end)
    data_start: int


def _as_view(data: Any) -> memoryview:
    if isinstance(data, str):
        raise WireError("a DSSST1 frame is bytes, got str")
    try:
        view = memoryview(data)
    except TypeError:
        raise WireError(f"a DSSST1 frame is bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise WireError("frame buffer is not C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise WireError(f"header JSON repeats the key {key!r}"[:300])
            seen.add(key)
    return result


def _json(text: str | bytes, what: str, **kwargs: Any) -> Any:
    try:
        return json.loads(text, **kwargs)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"{what} is not valid JSON: {str(exc)[:200]}") from None


def _int(value: Any, what: str, limit: int) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise WireError(f"{what} must be an integer in [0, {limit}], got {value!r}"[:300])
    return value


def _parse_header(view: memoryview) -> _Frame:
    size = len(view)
    if size < 8:
        raise WireError(f"frame is {size} bytes, shorter than the 8-byte header length prefix")
    header_len = int.from_bytes(view[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise WireError(f"header length {header_len} exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    if header_len > size - 8:
        raise WireError(f"header length {header_len} exceeds the {size - 8} bytes after the prefix (truncated frame?)")
    try:
        text = bytes(view[8 : 8 + header_len]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"header is not UTF-8: {exc}") from None
    header = _json(text, "header", object_pairs_hook=_no_duplicates)
    if not isinstance(header, dict):
        raise WireError(f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError("header __metadata__ must map strings to strings")
    data_len = size - 8 - header_len
    entries: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise WireError(f"tensor {name!r}: header entry must be an object")
        st_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(st_dtype, str) or st_dtype not in _ST_TO_TORCH:
            raise WireError(f"tensor {name!r}: unknown or unsupported dtype {st_dtype!r}"[:300])
        if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
            raise WireError(f"tensor {name!r}: shape must be a list of at most {_MAX_NDIM} dims")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise WireError(f"tensor {name!r}: data_offsets must be [start, end]")
        numel = 1
        for dim in shape:
            numel *= _int(dim, f"tensor {name!r}: shape entry", _MAX_DIM)
        start, end = (_int(o, f"tensor {name!r}: data offset", _MAX_DIM) for o in offsets)
        if end > data_len:
            raise WireError(
                f"tensor {name!r}: data_offsets [{start}, {end}] run past the {data_len} bytes of tensor data "
                "(truncated frame?)"
            )
        nbytes = numel * _ST_TO_TORCH[st_dtype].itemsize
        if end - start != nbytes:
            raise WireError(
                f"tensor {name!r}: {st_dtype}{shape} needs {nbytes} bytes but data_offsets [{start}, {end}] "
                f"span {end - start}"[:400]
            )
        entries[name] = (st_dtype, shape, start, end)
    cursor = 0  # like safetensors: sorted by offset, the tensors tile the data section exactly
    for name, (_, _, start, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if start != cursor:
            problem = "overlaps the previous tensor" if start < cursor else f"leaves a gap at byte {cursor}"
            raise WireError(f"tensor {name!r}: data_offsets [{start}, {end}] {problem}")
        cursor = end
    if cursor != data_len:
        raise WireError(f"tensors cover {cursor} bytes but the frame carries {data_len} bytes of tensor data")
    return _Frame(metadata, entries, 8 + header_len)


def _parse_frame(view: memoryview) -> _Frame:
    try:
        return _parse_header(view)
    except WireError:
        if view[:1] == b"\x80":
            raise WireError(
                "refusing a pickle payload (starts with the pickle protocol marker 0x80): DSSST1 never unpickles; "
                "the peer must send DSSST1 safetensors frames"
            ) from None
        if view[:4] == b"PK\x03\x04":
            raise WireError(
                "refusing a zip payload (torch.save format): DSSST1 never unpickles; the peer must send DSSST1 "
                "safetensors frames (v1 bodies: arctic_rl.v1compat.torch_load_safe)"
            ) from None
        raise


def _tree(metadata: dict[str, str]) -> Any:
    raw = metadata.get("dss")
    if raw is None:
        raise WireError("header __metadata__ has no 'dss' entry: a safetensors blob, but not a DSSST1 frame")
    info = _json(raw, "__metadata__['dss']")
    if not isinstance(info, dict) or "tree" not in info:
        raise WireError("__metadata__['dss'] must be an object with 'v' and 'tree'")
    if info.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported wire version {info.get('v')!r}; this codec speaks {WIRE_VERSION!r}"[:300])
    return info["tree"]


def _op(metadata: dict[str, str]) -> dict[str, Any]:
    raw = metadata.get("op")
    if raw is None:
        return {}
    op = _json(raw, "__metadata__['op']")
    if not isinstance(op, dict):
        raise WireError(f"__metadata__['op'] must be a JSON object, got {type(op).__name__}")
    return op


def _tensor_view(section: memoryview, name: str, entry: tuple[str, list[int], int, int]) -> torch.Tensor:
    st_dtype, shape, start, end = entry
    dtype = _ST_TO_TORCH[st_dtype]
    if end == start:
        try:
            return torch.empty(shape, dtype=dtype)
        except RuntimeError as exc:  # e.g. [0, 2**62, 2**62]: no bytes, but strides overflow int64
            raise WireError(f"tensor {name!r}: empty shape {shape} is not representable: {exc}"[:300]) from None
    raw = torch.frombuffer(section, dtype=torch.uint8, count=end - start, offset=start)
    if dtype == torch.bool and bool((raw > 1).any()):
        raise WireError(f"tensor {name!r}: BOOL data holds bytes other than 0 and 1")
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # misaligned for its dtype: copy this tensor only
    return raw.view(dtype).view(shape)


class _Builder:
    """Builds the decoded object from the skeleton tree, each tensor a view of ``section``.

    A class rather than nested functions: a recursive closure refers to itself, a reference
    cycle that would keep ``section`` -- and with it the whole received frame -- alive until the
    garbage collector runs, long after the caller dropped the decoded tensors."""

    def __init__(self, frame: _Frame, section: memoryview) -> None:
        self.frame = frame
        self.section = section
        self.cache: dict[str, torch.Tensor] = {}

    def tensor(self, node: list, path: str) -> torch.Tensor:
        name = node[1] if len(node) in (2, 3) else None
        options = node[2] if len(node) == 3 else {}
        if not isinstance(name, str) or not isinstance(options, dict):
            raise WireError(f"malformed tensor node at {path or '<root>'}: expected ['t', name, {{options}}?]")
        if name not in self.cache:
            if name not in self.frame.entries:
                raise WireError(f"tree references tensor {name!r} (at {path or '<root>'}), absent from the header")
            self.cache[name] = _tensor_view(self.section, name, self.frame.entries[name])
        t = self.cache[name]
        if options.get("scalar"):
            if t.numel() != 1:
                raise WireError(f"tensor {name!r} is marked scalar but has shape {list(t.shape)}")
            return t.view(())
        return t

    def build(self, node: Any, path: str) -> Any:
        if not isinstance(node, list) or len(node) < 2 or not isinstance(node[0], str):
            raise WireError(f"malformed tree node at {path or '<root>'}: expected [tag, payload]")
        tag, payload = node[0], node[1]
        if tag == "j" and len(node) == 2:
            return payload
        if tag == "t":
            return self.tensor(node, path)
        if tag in ("l", "u") and len(node) == 2 and isinstance(payload, list):
            items = [self.build(child, _join(path, str(i))) for i, child in enumerate(payload)]
            return items if tag == "l" else tuple(items)
        if tag == "d" and len(node) == 2 and isinstance(payload, list):
            result: dict[str, Any] = {}
            for pair in payload:
                if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                    raise WireError(f"malformed dict entry at {path or '<root>'}: expected [str key, node]")
                if pair[0] in result:
                    raise WireError(f"dict at {path or '<root>'} repeats the key {pair[0]!r}")
                result[pair[0]] = self.build(pair[1], _join(path, pair[0]))
            return result
        if tag not in ("j", "t", "l", "u", "d"):
            raise WireError(f"unknown structure tag {tag!r} at {path or '<root>'}"[:300])
        raise WireError(f"malformed {tag!r} node at {path or '<root>'}")


def _materialize(frame: _Frame, section: memoryview, tree: Any) -> Any:
    builder = _Builder(frame, section)
    try:
        if section.readonly:  # copy=False over bytes: torch warns about non-writable memory; see module doc
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return builder.build(tree, "")
        return builder.build(tree, "")
    except RecursionError:
        raise WireError("structure tree is nested too deeply") from None


def loads_with_metadata(data: Buffer, *, copy: bool | None = None) -> tuple[Any, dict[str, Any]]:
    """Decode a frame into ``(object, op metadata)``; ``{}`` when the frame has no ``op``.

    ``copy=None`` (default): zero-copy views for writable buffers (bytearray, writable memoryview,
    mmap), one copy of the tensor section for read-only ones (``bytes``). ``copy=True``: always
    copy once, so the result never aliases ``data``. ``copy=False``: never copy (views over
    read-only memory must then not be written to). See the module docstring on aliasing.
    """
    view = _as_view(data)
    frame = _parse_frame(view)
    tree, op = _tree(frame.metadata), _op(frame.metadata)
    if copy is None:
        copy = view.readonly
    section = view[frame.data_start :]
    if copy:
        owned = _new_buffer(len(section))
        section = memoryview(owned)
        section[:] = view[frame.data_start :]
    return _materialize(frame, section, tree), op


def loads(data: Buffer, *, copy: bool | None = None) -> Any:
    """Decode a frame made by :func:`dumps` (or the vendor's encoder); see :func:`loads_with_metadata`."""
    return loads_with_metadata(data, copy=copy)[0]


def read_metadata(data: Buffer) -> dict[str, Any]:
    """The frame's ``op`` metadata (``{}`` if none), from a validated header; no tensor is built.

    Strict, unlike the vendor's lenient peek: bytes that are not a DSSST1 frame raise WireError.
    """
    frame = _parse_frame(_as_view(data))
    _tree(frame.metadata)
    return _op(frame.metadata)


# ---------------------------------------------------------------------------------------------
# Byte chunking: one oversized frame <-> several self-describing chunk frames
# ---------------------------------------------------------------------------------------------


def _chunk_key(kind: str) -> str:
    if kind not in _CHUNK_KEYS:
        raise WireError(f"chunk kind must be one of {sorted(_CHUNK_KEYS)}, got {kind!r}")
    return _CHUNK_KEYS[kind]


def _chunk_frame(view: memoryview, start: int, end: int, key: str, desc: dict[str, Any]) -> bytearray:
    payload = _Blob(_CHUNK_PAYLOAD, "U8", [end - start], end - start, view[start:end])
    tree = ["d", [[_CHUNK_PAYLOAD, ["t", _CHUNK_PAYLOAD]]]]
    return _write_frame(tree, [payload], {key: desc})


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
    view = _as_view(frame)
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
        blob = _Blob(_CHUNK_PAYLOAD, "U8", [payload], payload, memoryview(b""))
        tree = ["d", [[_CHUNK_PAYLOAD, ["t", _CHUNK_PAYLOAD]]]]
        meta = {"dss": json.dumps({"v": WIRE_VERSION, "tree": tree}), "op": json.dumps({key: probe})}
        return total, 8 + len(_header_bytes(meta, [(blob, 0)]))

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
    op = _op(metadata)
    kinds = [kind for kind, key in _CHUNK_KEYS.items() if key in op]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise WireError("frame carries both request_chunk and result_chunk metadata")
    desc = op[_CHUNK_KEYS[kinds[0]]]
    if not isinstance(desc, dict):
        raise WireError(f"{_CHUNK_KEYS[kinds[0]]} metadata must be an object")
    desc = dict(desc, kind=kinds[0])
    _int(desc.get("total_chunks"), "total_chunks", 2**31)
    _int(desc.get("chunk_idx"), "chunk_idx", 2**31)
    _int(desc.get("frame_size_bytes"), "frame_size_bytes", 2**62)
    sha = desc.get("frame_sha256")
    if not isinstance(sha, str) or len(sha) != 64 or sha.strip("0123456789abcdef"):
        raise WireError(f"frame_sha256 must be 64 lowercase hex digits, got {sha!r}"[:200])
    for field in ("chunk_group_id", "operation"):
        if desc.get(field) is not None and not isinstance(desc[field], str):
            raise WireError(f"{field} must be a string, got {desc[field]!r}"[:200])
    return desc


def read_byte_chunk_metadata(frame: Buffer) -> dict[str, Any] | None:
    """The chunk descriptor of a chunk frame (with ``kind`` added), or ``None`` for a plain frame."""
    parsed = _parse_frame(_as_view(frame))
    _tree(parsed.metadata)
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
    views = [_as_view(chunk) for chunk in chunks]
    descs = [_chunk_descriptor(_parse_frame(view).metadata) for view in views]
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
        payload = obj.get(_CHUNK_PAYLOAD) if isinstance(obj, dict) and len(obj) == 1 else None
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise WireError(f"chunk {idx} must decode to {{'payload': 1-D uint8 tensor}}")
        by_idx[idx] = payload
    if len(by_idx) != total:  # distinct and in range, so one of 0..len(by_idx) is missing
        missing = [i for i in range(min(total, len(by_idx) + 10)) if i not in by_idx]
        raise WireError(f"missing chunk_idx {missing} (got {len(by_idx)} of total_chunks={total})")
    got = sum(p.numel() for p in by_idx.values())
    if got != size:
        raise WireError(f"chunk payloads add up to {got} bytes, frame_size_bytes says {size}")
    out, pos = _new_buffer(size), 0  # the payloads add up to size: every byte is written
    with memoryview(out) as dst:  # (a bytearray slice refuses numpy arrays; a memoryview takes them)
        for idx in range(total):
            n = by_idx[idx].numel()
            dst[pos : pos + n] = by_idx[idx].numpy()
            pos += n
    if hashlib.sha256(out).hexdigest() != first["frame_sha256"]:
        raise WireError("reassembled frame does not match frame_sha256 (corrupted or foreign chunk)")
    return out
