"""DSSST1 decoding: a frame -> the nested object, validated before any tensor is built; zero-copy where it can be."""

from __future__ import annotations

import json
import warnings
from typing import Any, NamedTuple

import torch

from .buffers import new_buffer
from .encode import join_path
from .format import MAX_DIM, MAX_HEADER_BYTES, MAX_NDIM, ST_TO_TORCH, WIRE_VERSION, Buffer, WireError


class _Frame(NamedTuple):
    metadata: dict[str, str]
    entries: dict[str, tuple[str, list[int], int, int]]  # name -> (dtype, shape, start, end)
    data_start: int


def as_view(data: Any) -> memoryview:
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


def check_int(value: Any, what: str, limit: int) -> int:
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
        if not isinstance(st_dtype, str) or st_dtype not in ST_TO_TORCH:
            raise WireError(f"tensor {name!r}: unknown or unsupported dtype {st_dtype!r}"[:300])
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise WireError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} dims")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise WireError(f"tensor {name!r}: data_offsets must be [start, end]")
        numel = 1
        for dim in shape:
            numel *= check_int(dim, f"tensor {name!r}: shape entry", MAX_DIM)
        start, end = (check_int(o, f"tensor {name!r}: data offset", MAX_DIM) for o in offsets)
        if end > data_len:
            raise WireError(
                f"tensor {name!r}: data_offsets [{start}, {end}] run past the {data_len} bytes of tensor data "
                "(truncated frame?)"
            )
        nbytes = numel * ST_TO_TORCH[st_dtype].itemsize
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


def parse_frame(view: memoryview) -> _Frame:
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


def frame_tree(metadata: dict[str, str]) -> Any:
    raw = metadata.get("dss")
    if raw is None:
        raise WireError("header __metadata__ has no 'dss' entry: a safetensors blob, but not a DSSST1 frame")
    info = _json(raw, "__metadata__['dss']")
    if not isinstance(info, dict) or "tree" not in info:
        raise WireError("__metadata__['dss'] must be an object with 'v' and 'tree'")
    if info.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported wire version {info.get('v')!r}; this codec speaks {WIRE_VERSION!r}"[:300])
    return info["tree"]


def frame_op(metadata: dict[str, str]) -> dict[str, Any]:
    raw = metadata.get("op")
    if raw is None:
        return {}
    op = _json(raw, "__metadata__['op']")
    if not isinstance(op, dict):
        raise WireError(f"__metadata__['op'] must be a JSON object, got {type(op).__name__}")
    return op


def _tensor_view(section: memoryview, name: str, entry: tuple[str, list[int], int, int]) -> torch.Tensor:
    st_dtype, shape, start, end = entry
    dtype = ST_TO_TORCH[st_dtype]
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
            items = [self.build(child, join_path(path, str(i))) for i, child in enumerate(payload)]
            return items if tag == "l" else tuple(items)
        if tag == "d" and len(node) == 2 and isinstance(payload, list):
            result: dict[str, Any] = {}
            for pair in payload:
                if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                    raise WireError(f"malformed dict entry at {path or '<root>'}: expected [str key, node]")
                if pair[0] in result:
                    raise WireError(f"dict at {path or '<root>'} repeats the key {pair[0]!r}")
                result[pair[0]] = self.build(pair[1], join_path(path, pair[0]))
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
    view = as_view(data)
    frame = parse_frame(view)
    tree, op = frame_tree(frame.metadata), frame_op(frame.metadata)
    if copy is None:
        copy = view.readonly
    section = view[frame.data_start :]
    if copy:
        owned = new_buffer(len(section))
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
    frame = parse_frame(as_view(data))
    frame_tree(frame.metadata)
    return frame_op(frame.metadata)

