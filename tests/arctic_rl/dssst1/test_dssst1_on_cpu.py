"""DSSST1 codec tests (CPU, seconds): vendor golden frames, round-trips, hostile frames, v1 pickles.

Golden frames were produced by Arctic-Platform's own encoder; ``expected.json`` holds the decoded
objects with every dict as ``{"__dict__": ...}``, list ``{"__list__": ...}``, tuple
``{"__tuple__": ...}`` and tensor ``{"__tensor__": true, "dtype", "shape", "values"}`` (values
flattened, row-major, as JSON numbers or bools).
"""

from __future__ import annotations

import collections
import ctypes
import enum
import gc
import hashlib
import json
import math
import os
import pickle
import random
import struct
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from arctic_rl import dssst1
from arctic_rl.dssst1 import WireError
from arctic_rl.dssst1.encode import plain_json
from arctic_rl.v1compat import torch_load_safe, torch_save_bytes

torch.set_num_threads(1)

# Shared project material lives next to the checkout (tests/conftest.py reads the same variable).
SHARED = Path(os.environ.get("VERL_REMOTE_BACKEND_SHARED", Path(__file__).resolve().parents[4] / "shared"))
GOLDEN = SHARED / "conformance" / "dssst1"
FRAMES = ["fwd_bwd_request", "forward_response", "fwd_bwd_response", "dtypes", "nested", "with_metadata", "json_only"]
N_CHUNKS = 5

needs_golden = pytest.mark.skipif(not (GOLDEN / "manifest.json").exists(), reason=f"no golden frames at {GOLDEN}")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def from_expected(node: Any) -> Any:
    """Rebuild the Python object an ``expected.json`` entry describes."""
    if isinstance(node, dict):
        if node.get("__tensor__"):
            dtype = getattr(torch, node["dtype"])
            values = torch.tensor(node["values"], dtype=torch.bool if dtype == torch.bool else torch.float64)
            return values.to(dtype).reshape(node["shape"])
        (tag, payload), *rest = node.items()
        assert not rest, f"unexpected expected.json node {node!r}"
        if tag == "__dict__":
            return {key: from_expected(value) for key, value in payload.items()}
        if tag == "__list__":
            return [from_expected(value) for value in payload]
        if tag == "__tuple__":
            return tuple(from_expected(value) for value in payload)
        raise AssertionError(f"unknown expected.json tag {tag!r}")
    return node


def assert_same(actual: Any, expected: Any, path: str = "<root>") -> None:
    """Exact equality: container types, dict order, JSON scalar types, tensor dtype/shape/bytes."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert raw_bytes(actual) == raw_bytes(expected), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}.{i}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def canonical(frame: bytes | bytearray) -> tuple[dict, bytes]:
    """Header with its metadata strings parsed, plus the tensor bytes: order- and padding-free."""
    (header_len,) = struct.unpack("<Q", frame[:8])
    header = json.loads(bytes(frame[8 : 8 + header_len]))
    header["__metadata__"] = {key: json.loads(value) for key, value in header.get("__metadata__", {}).items()}
    return header, bytes(frame[8 + header_len :])


def make_frame(header: Any, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    """A frame with an arbitrary (possibly hostile) header, padded like safetensors does."""
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def dss(tree: Any, version: str = "DSSST1") -> dict[str, str]:
    return {"dss": json.dumps({"v": version, "tree": tree})}


def entry(dtype: str, shape: list[int], start: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((GOLDEN / "manifest.json").read_text())


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((GOLDEN / "expected.json").read_text())


def golden(name: str) -> bytes:
    return (GOLDEN / f"{name}.dssst1").read_bytes()


def golden_chunks() -> list[bytes]:
    return [golden(f"chunked_request.{i}") for i in range(N_CHUNKS)]


# ---------------------------------------------------------------------------------------------
# public surface
# ---------------------------------------------------------------------------------------------


def test_public_surface_is_pinned() -> None:
    assert sorted(dssst1.__all__) == [
        "MAX_HEADER_BYTES", "MEDIA_TYPE", "WIRE_VERSION", "WireError", "decode_byte_chunks", "dumps",
        "encode_byte_chunks", "loads", "loads_with_metadata", "read_byte_chunk_metadata", "read_metadata",
    ]  # fmt: skip
    assert dssst1.MEDIA_TYPE == "application/octet-stream"
    assert issubclass(WireError, ValueError)
    err = pickle.loads(pickle.dumps(WireError("boom")))
    assert isinstance(err, WireError) and str(err) == "boom"


# ---------------------------------------------------------------------------------------------
# vendor golden frames
# ---------------------------------------------------------------------------------------------


@needs_golden
@pytest.mark.parametrize("name", FRAMES)
def test_golden_frame_decodes_to_expected(name: str, manifest: dict, expected: dict) -> None:
    obj, op = dssst1.loads_with_metadata(golden(name))
    assert_same(obj, from_expected(expected[name]))
    assert op == (manifest[name]["metadata"] or {})
    assert dssst1.read_metadata(golden(name)) == op


@needs_golden
@pytest.mark.parametrize("name", FRAMES)
def test_encoding_expected_reproduces_golden_sha256(name: str, manifest: dict, expected: dict) -> None:
    frame = dssst1.dumps(from_expected(expected[name]), metadata=manifest[name]["metadata"])
    assert len(frame) == manifest[name]["bytes"]
    # with_metadata has both "dss" and "op"; the vendor's hash-map order happened to be ours here.
    assert hashlib.sha256(frame).hexdigest() == manifest[name]["sha256"]
    assert canonical(frame) == canonical(golden(name))


@needs_golden
def test_noncontiguous_source_encodes_to_the_golden_bytes(manifest: dict, expected: dict) -> None:
    obj = from_expected(expected["dtypes"])
    obj["noncontig"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not obj["noncontig"].is_contiguous()
    assert hashlib.sha256(dssst1.dumps(obj)).hexdigest() == manifest["dtypes"]["sha256"]


@needs_golden
def test_golden_chunked_request_reassembles(manifest: dict, expected: dict) -> None:
    chunks = golden_chunks()
    for chunk, meta in zip(chunks, manifest["chunked_request"]["chunk_metadata"]):
        assert dssst1.read_byte_chunk_metadata(chunk) == meta
    whole = dssst1.decode_byte_chunks(list(reversed(chunks)), kind="request")
    assert hashlib.sha256(whole).hexdigest() == manifest["chunked_request"]["whole_sha256"]
    assert_same(dssst1.loads(whole), from_expected(expected["chunked_request(reassembled)"]))


@needs_golden
def test_encode_byte_chunks_reproduces_golden_chunks() -> None:
    chunks = golden_chunks()
    whole = dssst1.decode_byte_chunks(chunks)
    ours = dssst1.encode_byte_chunks(
        whole, kind="request", operation="forward_backward", max_bytes=len(chunks[0]), chunk_group_id="golden-group-1"
    )
    # The vendor's metadata order varies run to run (chunks 1-3 have "op" first): compare canonically.
    assert [canonical(c) for c in ours] == [canonical(c) for c in chunks]
    assert bytes(ours[0]) == chunks[0]


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.uint16, torch.uint32, torch.uint64,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n)]  # fmt: skip


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 4).abs().to(dtype)  # abs: e8m0 has no sign
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4), (7,)], ids=["2d", "scalar", "empty", "1d"])
def test_roundtrip_every_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    obj = {"t": sample(dtype, shape), "tail": [sample(dtype, shape, seed=1)]}
    out = dssst1.loads(dssst1.dumps(obj))
    assert_same(out, obj)
    assert out["t"].dim() == len(shape)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),  # transposed
        lambda: torch.arange(40).reshape(5, 8)[1:4, ::3],  # sliced, storage offset, step
        lambda: torch.arange(3, dtype=torch.int32).expand(4, 3),  # stride 0
        lambda: torch.randn(2, 3, dtype=torch.complex64).conj(),  # lazy conjugate bit
        lambda: torch.randn(4, 4, requires_grad=True)[:, 1],  # autograd, non-contiguous
        lambda: torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(),  # no numpy dtype
        lambda: torch.tensor([True, False, True, True]).reshape(2, 2).t(),
    ],
    ids=["transposed", "sliced", "expanded", "conj", "requires_grad", "bf16_t", "bool_t"],
)
def test_roundtrip_noncontiguous(make: Any) -> None:
    t = make()
    out = dssst1.loads(dssst1.dumps({"x": t}))["x"]
    assert out.is_contiguous() and out.dtype == t.dtype and out.shape == t.shape
    assert raw_bytes(out) == raw_bytes(t.detach().resolve_conj())


def test_roundtrip_nested_structure_and_metadata() -> None:
    shared = torch.arange(4)
    obj = {
        "batch": {"input_ids": torch.arange(12).reshape(3, 4), "mask": torch.ones(3, 4, dtype=torch.bool)},
        "meta": {"rollout_n": 2, "temperature": 1.0, "names": ["a", "b"], "none": None, "nan": float("nan")},
        "pair": (torch.tensor(1.5), "tag", (1, [2, 3])),
        "list": [shared, {"again": shared}, [], {}],
        "loss.sum": torch.tensor([1.0]),
        "loss": {"sum": torch.tensor([2.0])},  # tensor path "loss.sum" collides with the key above
        "only_json_tuple": {"t": (1, 2)},  # tuples survive even without tensors
        "": torch.tensor([7]),
        "unicode ключ\n": torch.tensor([8]),
    }
    metadata = {"request_id": "r-1", "router_replay": {"enabled": True}}
    out, op = dssst1.loads_with_metadata(dssst1.dumps(obj, metadata=metadata))
    nan = out["meta"].pop("nan")
    assert math.isnan(nan)
    del obj["meta"]["nan"]
    assert_same(out, obj)
    assert op == metadata


@pytest.mark.parametrize(
    "obj",
    [None, 3, "s", [1, 2.5, None, True, "x"], {"a": {"b": []}}, (), torch.tensor(3), torch.zeros(0)],
    ids=["none", "int", "str", "list", "dict", "empty_tuple", "root_scalar", "root_empty"],
)
def test_roundtrip_roots(obj: Any) -> None:
    assert_same(dssst1.loads(dssst1.dumps(obj)), obj)


class _Flag(enum.IntEnum):
    ON = 1


class _Name(str):
    pass


@pytest.mark.parametrize(
    ("obj", "one_json_node"),
    [
        ({"a": [1, 2.5, None, True, "s", {"b": []}]}, True),
        ([{"7": {"logprob": -0.5, "rank": 1}}] * 3, True),  # a /generate answer's per-token entries
        ({"nan": float("nan"), "inf": [float("-inf")]}, True),  # JSON scalars as Python's json writes them
        ({"flag": _Flag.ON, _Name("key"): collections.OrderedDict(x=1)}, True),  # subclasses of the JSON types
        ({"deep": [[{"t": (1, 2)}]]}, False),  # a tuple anywhere stays a tuple: structural nodes
        ({"a": {1: "int key"}}, False),
        ([[0], {"b": torch.zeros(1)}], False),
        ({"a": [object()]}, False),
    ],
    ids=["nested", "answer_entries", "non_finite", "subclasses", "tuple", "int_key", "tensor", "object"],
)
def test_tensor_free_json_subtrees_become_one_node_and_nothing_else_does(obj: Any, one_json_node: bool) -> None:
    assert plain_json(obj) is one_json_node
    if one_json_node:  # what the vendor's encoder writes for a tensor-free subtree: one "j" node
        frame = dssst1.dumps(obj)
        header = json.loads(bytes(frame[8 : 8 + int.from_bytes(frame[:8], "little")]))
        assert json.loads(header["__metadata__"]["dss"])["tree"][0] == "j"
        if "nan" not in obj:
            assert dssst1.loads(frame) == obj
    elif "deep" in obj:
        assert dssst1.loads(dssst1.dumps(obj)) == obj  # the tuple comes back a tuple


def test_frame_layout_is_safetensors() -> None:
    """Our frames are byte-identical to safetensors' own for the same tensors and metadata."""
    st = pytest.importorskip("safetensors.torch")
    unnamed = getattr(torch, "float8_e8m0fnu", None)  # safetensors' Python side has no torch mapping for it
    tensors = {f"t{i}": sample(dtype, (3, 2), seed=i) for i, dtype in enumerate(DTYPES) if dtype != unnamed}
    frame = dssst1.dumps(tensors)
    header, _ = canonical(frame)
    reference = st.save(tensors, metadata={"dss": json.dumps(header["__metadata__"]["dss"])})
    assert bytes(frame) == reference
    loaded = st.load(bytes(frame))
    for name, t in tensors.items():
        assert raw_bytes(loaded[name]) == raw_bytes(t)


def test_dumps_returns_one_aligned_bytearray() -> None:
    frame = dssst1.dumps({"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.float64)})
    assert isinstance(frame, bytearray)
    header_len = struct.unpack("<Q", frame[:8])[0]
    assert header_len % 8 == 0
    frame.append(0)  # not locked by a lingering buffer export


# ---------------------------------------------------------------------------------------------
# zero-copy and aliasing
# ---------------------------------------------------------------------------------------------


def test_loads_bytearray_is_zero_copy_and_locks_the_buffer() -> None:
    frame = dssst1.dumps({"x": torch.arange(8, dtype=torch.float32)})
    x = dssst1.loads(frame)["x"]
    base = torch.frombuffer(frame, dtype=torch.uint8).data_ptr()
    assert base <= x.data_ptr() < base + len(frame)
    x[0] = 42.0  # writes show through to the buffer ...
    assert dssst1.loads(frame)["x"][0].item() == 42.0
    with pytest.raises(BufferError):  # ... and the buffer cannot move under the tensor
        frame.extend(b"\0")
    del x


def test_loads_bytes_copies_once_and_never_warns() -> None:
    frame = bytes(dssst1.dumps({"x": torch.arange(8, dtype=torch.float32)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = dssst1.loads(frame)["x"]
        x += 1  # ordinary writable memory, independent of the immutable bytes
        y = dssst1.loads(frame, copy=False)["x"]  # views over the bytes: read-only by contract
    assert torch.equal(y + 1, x)
    assert dssst1.loads(frame)["x"][0].item() == 0.0


def test_loads_copy_true_detaches_from_a_writable_buffer() -> None:
    frame = dssst1.dumps({"x": torch.zeros(4)})
    x = dssst1.loads(frame, copy=True)["x"]
    x += 5
    assert dssst1.loads(frame)["x"].sum().item() == 0.0


def test_misaligned_buffer_copies_only_misaligned_tensors() -> None:
    frame = dssst1.dumps({"f64": torch.arange(5, dtype=torch.float64), "u8": torch.arange(3, dtype=torch.uint8)})
    shifted = bytearray(len(frame) + 1)
    shifted[1:] = frame
    view = memoryview(shifted)[1:]
    out = dssst1.loads(view)
    assert out["f64"].data_ptr() % 8 == 0 and torch.equal(out["f64"], torch.arange(5, dtype=torch.float64))
    base = torch.frombuffer(shifted, dtype=torch.uint8).data_ptr()
    assert base <= out["u8"].data_ptr() < base + len(shifted)  # 1-byte dtype: still a view


# ---------------------------------------------------------------------------------------------
# hostile frames: always WireError, with a message that says what is wrong
# ---------------------------------------------------------------------------------------------

GOOD_TREE = ["d", [["x", ["t", "x"]]]]
ONE_BYTE = entry("U8", [1], 0, 1)


def hostile(data: bytes = b"", tree: Any = GOOD_TREE, version: str = "DSSST1", **tensors: Any) -> bytes:
    return make_frame({"__metadata__": dss(tree, version), **tensors}, data)


HOSTILE = [
    pytest.param(b"", "shorter than the 8-byte", id="empty"),
    pytest.param(struct.pack("<Q", 2**64 - 1) + b"{}", "exceeds MAX_HEADER_BYTES", id="header_len_2**64-1"),
    pytest.param(struct.pack("<Q", dssst1.MAX_HEADER_BYTES + 1) + b"{}", "exceeds MAX_HEADER", id="header_over_cap"),
    pytest.param(struct.pack("<Q", 4096) + b"{}      ", "truncated", id="header_len_past_end"),
    pytest.param(make_frame(None, raw_header=b'{"__metadata__": {"dss": '), "not valid JSON", id="json_cut"),
    pytest.param(make_frame(None, raw_header=b"\xff\xfe{}"), "not UTF-8", id="not_utf8"),
    pytest.param(make_frame(None, raw_header=b"[" * 100_000), "not valid JSON", id="json_too_deep"),
    pytest.param(make_frame([1, 2]), "must be a JSON object", id="header_is_list"),
    pytest.param(make_frame("x"), "must be a JSON object", id="header_is_string"),
    pytest.param(make_frame(None, raw_header=b'{"a": 1, "a": 2}'), "repeats the key 'a'", id="duplicate_json_key"),
    pytest.param(make_frame({"__metadata__": {"dss": 5}}), "strings to strings", id="metadata_not_strings"),
    pytest.param(hostile(x=5), "must be an object", id="entry_not_object"),
    pytest.param(hostile(bytes(16), x=entry("F128", [1], 0, 16)), "unknown", id="unknown_dtype"),
    pytest.param(hostile(bytes(8), x=entry(["F32"], [2], 0, 8)), "unknown", id="dtype_not_string"),
    pytest.param(hostile(bytes(8), x=entry("F32", [3], 0, 8)), "needs 12 bytes", id="shape_bytes_mismatch"),
    pytest.param(hostile(bytes(8), x=entry("F32", [-2], 0, 8)), "shape entry", id="negative_dim"),
    pytest.param(hostile(bytes(8), x=entry("F32", [2.0], 0, 8)), "shape entry", id="float_dim"),
    pytest.param(hostile(bytes(4), x=entry("F32", [True], 0, 4)), "shape entry", id="bool_dim"),
    pytest.param(hostile(bytes(4), x=entry("F32", [1] * 65, 0, 4)), "at most 64", id="65_dims"),
    pytest.param(hostile(bytes(4), x={"dtype": "F32", "shape": [1]}), "data_offsets", id="no_offsets"),
    pytest.param(hostile(bytes(8), x=entry("F32", [2], 4, 12)), "run past the 8 bytes", id="offset_past_end"),
    pytest.param(hostile(bytes(8), x=entry("F32", [2], -4, 4)), "data offset", id="negative_offset"),
    pytest.param(hostile(bytes(8), x=entry("F32", [0], 8, 4)), "needs 0 bytes", id="reversed_offsets"),
    pytest.param(hostile(x=ONE_BYTE), "truncated frame", id="no_data_at_all"),
    pytest.param(hostile(bytes(12), x=entry("F32", [2], 0, 8)), "cover 8 bytes", id="trailing_bytes"),
    pytest.param(hostile(bytes(12), x=entry("F32", [2], 4, 12)), "gap at byte 0", id="gap"),
    pytest.param(hostile(bytes(12), x=entry("F32", [2], 0, 8), y=entry("F32", [2], 4, 12)), "overlaps", id="overlap"),
    pytest.param(make_frame({"__metadata__": {}, "x": ONE_BYTE}, b"\0"), "no 'dss' entry", id="no_dss"),
    pytest.param(hostile(b"\0", version="DSSST2", x=ONE_BYTE), "version 'DSSST2'", id="version_mismatch"),
    pytest.param(make_frame({"__metadata__": {"dss": "{"}, "x": ONE_BYTE}, b"\0"), "not valid JSON", id="dss_cut"),
    pytest.param(make_frame({"__metadata__": {"dss": "[]"}, "x": ONE_BYTE}, b"\0"), "'v' and 'tree'", id="dss_list"),
    pytest.param(hostile(b"\0", ["q", 1], x=ONE_BYTE), "unknown structure tag 'q'", id="unknown_tag"),
    pytest.param(hostile(b"\0", ["d", [["a", ["z", 1]]]], x=ONE_BYTE), "tag 'z' at a", id="unknown_nested_tag"),
    pytest.param(hostile(b"\0", ["d", {"a": 1}], x=ONE_BYTE), "malformed 'd'", id="dict_payload_not_list"),
    pytest.param(hostile(b"\0", ["d", [["a"]]], x=ONE_BYTE), "dict entry", id="dict_pair_malformed"),
    pytest.param(hostile(b"\0", ["d", [["a", ["j", 1]], ["a", ["j", 2]]]], x=ONE_BYTE), "repeats", id="dict_dup_key"),
    pytest.param(hostile(b"\0", ["l", [["j"]]], x=ONE_BYTE), "malformed tree node at 0", id="short_node"),
    pytest.param(hostile(b"\0", ["t", "missing"], x=ONE_BYTE), "'missing'", id="missing_tensor"),
    pytest.param(hostile(b"\0", ["t", 5], x=ONE_BYTE), "malformed tensor node", id="tensor_name_not_str"),
    pytest.param(hostile(bytes(2), ["t", "x", {"scalar": True}], x=entry("U8", [2], 0, 2)), "scalar", id="fat_scalar"),
    pytest.param(hostile(b"\1\2", ["t", "x"], x=entry("BOOL", [2], 0, 2)), "BOOL", id="bool_byte_2"),
    pytest.param(hostile(b"", ["t", "x"], x=entry("U8", [0, 2**62, 2**62], 0, 0)), "representable", id="overflow"),
    pytest.param(make_frame({"__metadata__": {**dss(["j", 1]), "op": "[1]"}}), "must be a JSON object", id="op_list"),
]


@pytest.mark.parametrize(("frame", "match"), HOSTILE)
def test_hostile_frame_raises_wire_error(frame: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        dssst1.loads(frame)


def test_deep_tree_raises_wire_error() -> None:
    depth = 5000  # json.dumps itself cannot write this: build the text by hand
    tree = '["l", [' * depth + '["j", 1]' + "]]" * depth
    frame = make_frame({"__metadata__": {"dss": '{"v": "DSSST1", "tree": ' + tree + "}"}})
    with pytest.raises(WireError):
        dssst1.loads(frame)


def test_pickle_and_zip_payloads_are_refused_without_unpickling() -> None:
    with pytest.raises(WireError, match="pickle"):
        dssst1.loads(pickle.dumps({"a": 1}))
    with pytest.raises(WireError, match="zip payload"):
        dssst1.loads(torch_save_bytes({"a": torch.arange(3)}))
    with pytest.raises(WireError, match="pickle"):
        dssst1.read_metadata(pickle.dumps([1], protocol=2))


def test_a_valid_frame_may_start_with_0x80() -> None:
    """header_len 384 (0x180) puts 0x80 first: only an *invalid* frame is blamed on pickle."""
    text = next(t for t in ("x" * n for n in range(400)) if dssst1.dumps(t)[:8] == struct.pack("<Q", 384))
    frame = bytes(dssst1.dumps(text))
    assert frame[0] == 0x80
    assert dssst1.loads(frame) == text


@pytest.mark.parametrize("data", ["text", 12, None, [1, 2]], ids=["str", "int", "none", "list"])
def test_non_bytes_input_raises_wire_error(data: Any) -> None:
    with pytest.raises(WireError, match="bytes"):
        dssst1.loads(data)


@needs_golden
@pytest.mark.parametrize("name", ["json_only", "dtypes", "nested"])
def test_every_truncation_raises_wire_error(name: str) -> None:
    frame = golden(name)
    for cut in range(len(frame)):
        with pytest.raises(WireError):
            dssst1.loads(frame[:cut])
        with pytest.raises(WireError):
            dssst1.read_metadata(bytearray(frame[:cut]))


@needs_golden
def test_fuzzed_golden_frames_give_wire_error_or_a_result() -> None:
    rng = random.Random(1234)
    frames = [golden(name) for name in FRAMES] + golden_chunks()
    outcomes = {"ok": 0, "WireError": 0}
    for _ in range(3000):
        frame = bytearray(rng.choice(frames))
        header_end = 8 + struct.unpack("<Q", frame[:8])[0]
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(header_end) if rng.random() < 0.8 else rng.randrange(len(frame))
            frame[pos] = rng.randrange(256) if rng.random() < 0.7 else frame[pos] ^ (1 << rng.randrange(8))
        if rng.random() < 0.1:
            del frame[rng.randrange(len(frame)) :]
        try:
            dssst1.loads(bytes(frame))
            dssst1.read_metadata(frame)
            outcomes["ok"] += 1
        except WireError:
            outcomes["WireError"] += 1
    assert outcomes["WireError"] > 1000 and outcomes["ok"] > 0, outcomes


# ---------------------------------------------------------------------------------------------
# encoding errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({1: torch.zeros(1)}, "dict keys must be str"),
        ({"a": {2: "x"}}, "dict keys must be str"),
        ({"a": [object()]}, r"object at a\.0"),
        ({"a": b"bytes"}, "builtins.bytes at a"),
        ({"q": torch.zeros(2, dtype=torch.complex128)}, "complex128"),
        ({"s": torch.zeros(3).to_sparse()}, "layout"),
    ],
)
def test_unencodable_objects_raise_wire_error(obj: Any, match: str) -> None:
    with pytest.raises(WireError, match=match):
        dssst1.dumps(obj)


def test_cyclic_object_and_bad_metadata_raise_wire_error() -> None:
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(WireError, match="nested too deeply"):
        dssst1.dumps(cyclic)
    with pytest.raises(WireError, match="metadata must be a dict"):
        dssst1.dumps({}, metadata=["x"])  # type: ignore[arg-type]
    with pytest.raises(WireError, match="JSON-serializable"):
        dssst1.dumps({}, metadata={"x": object()})


# ---------------------------------------------------------------------------------------------
# byte chunking
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def big_frame() -> bytearray:
    return dssst1.dumps({"x": torch.arange(3000, dtype=torch.int64)}, metadata={"request_id": "r"})


@pytest.mark.parametrize("max_bytes", [2000, 4096, 5000, 7000])
def test_chunks_respect_max_bytes_and_roundtrip(big_frame: bytearray, max_bytes: int) -> None:
    chunks = dssst1.encode_byte_chunks(big_frame, kind="request", operation="forward_backward", max_bytes=max_bytes)
    assert len(chunks) > 1 and all(len(c) <= max_bytes for c in chunks)
    assert max(len(c) for c in chunks) > max_bytes - 16  # sized tightly, not with a fixed margin
    descs = [dssst1.read_byte_chunk_metadata(c) for c in chunks]
    assert len({d["chunk_group_id"] for d in descs}) == 1 and descs[0]["chunk_group_id"]
    shuffled = list(chunks)
    random.Random(0).shuffle(shuffled)
    assert dssst1.decode_byte_chunks(shuffled, kind="request") == big_frame


def test_small_frames_are_not_chunked(big_frame: bytearray) -> None:
    assert dssst1.encode_byte_chunks(big_frame, kind="request", max_bytes=len(big_frame)) == [big_frame]
    assert dssst1.encode_byte_chunks(big_frame, kind="result", max_bytes=0) == [big_frame]
    assert dssst1.decode_byte_chunks([big_frame]) is big_frame
    assert dssst1.read_byte_chunk_metadata(big_frame) is None


def test_result_chunks_carry_no_group_id(big_frame: bytearray) -> None:
    chunks = dssst1.encode_byte_chunks(big_frame, kind="result", max_bytes=3000)
    assert "chunk_group_id" not in dssst1.read_byte_chunk_metadata(chunks[0])
    assert dssst1.decode_byte_chunks(chunks, kind="result") == big_frame


def test_max_bytes_too_small_is_refused(big_frame: bytearray) -> None:
    with pytest.raises(WireError, match="cannot hold a chunk"):
        dssst1.encode_byte_chunks(big_frame, kind="request", max_bytes=100)
    with pytest.raises(WireError, match="chunk kind"):
        dssst1.encode_byte_chunks(big_frame, kind="reply", max_bytes=3000)


def chunk_with(desc_changes: dict[str, Any], payload: bytes, kind: str = "request") -> bytearray:
    """A chunk frame whose descriptor we forge (what a buggy or hostile peer could send)."""
    desc = {"chunk_idx": 0, "total_chunks": 1, "frame_sha256": hashlib.sha256(payload).hexdigest()}
    desc.update(frame_size_bytes=len(payload), chunk_group_id="g", operation="op")
    desc.update(desc_changes)
    desc = {k: v for k, v in desc.items() if v is not None}
    tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return dssst1.dumps({"payload": tensor}, metadata={f"{kind}_chunk": desc})


def test_chunk_set_errors(big_frame: bytearray) -> None:
    chunks = dssst1.encode_byte_chunks(big_frame, kind="request", max_bytes=3000, chunk_group_id="g1")
    others = dssst1.encode_byte_chunks(big_frame, kind="request", max_bytes=3000, chunk_group_id="g2")
    results = dssst1.encode_byte_chunks(big_frame, kind="result", max_bytes=3000)
    cases = [
        ([], "non-empty"),
        (chunks[:-1], rf"missing chunk_idx \[{len(chunks) - 1}\]"),
        (chunks[:1] + chunks[2:], r"missing chunk_idx \[1\]"),
        (chunks + chunks[:1], "duplicate chunk_idx 0"),
        (chunks[:1] + others[1:], "chunk_group_id"),
        (chunks[:1] + results[1:], "kind"),
        (chunks + [big_frame], "not a chunk frame"),
        ([big_frame] + chunks, "not a chunk frame"),
    ]
    for chunk_set, match in cases:
        with pytest.raises(WireError, match=match):
            dssst1.decode_byte_chunks(chunk_set)
    with pytest.raises(WireError, match="expected result chunks, got request"):
        dssst1.decode_byte_chunks(chunks, kind="result")
    with pytest.raises(WireError, match="max_frame_bytes"):
        dssst1.decode_byte_chunks(chunks, max_frame_bytes=100)
    with pytest.raises(WireError, match="needs a non-empty list"):
        dssst1.decode_byte_chunks(chunks[0])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"frame_sha256": "0" * 64}, "does not match frame_sha256"),
        ({"frame_sha256": "xyz"}, "64 lowercase hex"),
        ({"frame_size_bytes": 5}, "add up to 3 bytes"),
        ({"chunk_idx": 3}, "out of range"),
        ({"chunk_idx": -1}, "chunk_idx must be an integer"),
        ({"total_chunks": "1"}, "total_chunks must be an integer"),
        ({"chunk_group_id": 7}, "chunk_group_id must be a string"),
        ({"total_chunks": 2**31}, r"missing chunk_idx \[1, 2, .*got 1 of total_chunks=2147483648"),
    ],
)
def test_forged_chunk_descriptors(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(WireError, match=match):
        dssst1.decode_byte_chunks([chunk_with(changes, b"abc")])


def test_chunk_payload_must_be_a_uint8_vector() -> None:
    desc = {"chunk_idx": 0, "total_chunks": 1, "frame_sha256": "0" * 64, "frame_size_bytes": 4}
    frame = dssst1.dumps({"payload": torch.zeros(2, dtype=torch.int16)}, metadata={"request_chunk": desc})
    with pytest.raises(WireError, match="1-D uint8"):
        dssst1.decode_byte_chunks([frame])
    assert dssst1.decode_byte_chunks([chunk_with({}, b"abc")]) == b"abc"


# ---------------------------------------------------------------------------------------------
# v1 (torch.save) bodies
# ---------------------------------------------------------------------------------------------


class _RunsAShell:
    marker = "/tmp/arctic_rl_v1compat_pwned"

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize(
    "body",
    [
        lambda: pickle.dumps(_RunsAShell(), protocol=2),
        lambda: pickle.dumps(_RunsAShell()),
        lambda: torch_save_bytes({"tensor": torch.ones(2), "evil": _RunsAShell()}),
    ],
    ids=["raw_pickle_p2", "raw_pickle_default", "torch_save_zip"],
)
def test_v1_malicious_pickle_is_refused_without_running(body: Any) -> None:
    marker = Path(_RunsAShell.marker)
    marker.unlink(missing_ok=True)
    with pytest.raises(WireError, match="refusing v1 torch.save body"):
        torch_load_safe(body())
    assert not marker.exists()


def test_v1_roundtrip_and_garbage() -> None:
    obj = {"batch": {"x": torch.arange(6).reshape(2, 3)}, "meta": [1, "a"], "pair": (torch.tensor(1.5).bfloat16(),)}
    assert_same(torch_load_safe(torch_save_bytes(obj)), obj)
    assert_same(torch_load_safe(bytearray(torch_save_bytes(obj))), obj)
    for garbage in (b"", b"not a pickle", torch_save_bytes(obj)[:50]):
        with pytest.raises(WireError):
            torch_load_safe(garbage)
    with pytest.raises(WireError, match="bytes-like"):
        torch_load_safe("text")  # type: ignore[arg-type]


def test_large_frames_use_every_byte_of_their_uninitialized_buffer() -> None:
    """Frames above 4 MiB take the no-zero-fill, huge-page allocation path: it must not leak junk."""
    st = pytest.importorskip("safetensors.torch")
    tensors = {"a": torch.arange(700_000, dtype=torch.int64), "b": torch.ones(3, 5).t(), "c": torch.zeros(0)}
    frame = dssst1.dumps(tensors)
    assert len(frame) > 4 << 20
    header, _ = canonical(frame)
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    assert bytes(frame) == st.save(contiguous, metadata={"dss": json.dumps(header["__metadata__"]["dss"])})
    assert_same(dssst1.loads(bytes(frame)), contiguous)
    chunks = dssst1.encode_byte_chunks(frame, kind="result", max_bytes=5 << 20)
    assert bytes(dssst1.decode_byte_chunks(chunks)) == bytes(frame)


def _large(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 1 << 40, (600_000,), generator=gen), "x": torch.randn(1000, 300, generator=gen)}


def test_a_dropped_large_frame_buffer_is_reused_and_fully_rewritten() -> None:
    """Large frames reuse the thread's previous buffer once nobody holds it (no fresh pages to fault in)."""
    first = dssst1.dumps(_large(1))
    address = ctypes.addressof(ctypes.c_char.from_buffer(first))
    del first
    second_obj = _large(2)
    second = dssst1.dumps(second_obj)
    assert ctypes.addressof(ctypes.c_char.from_buffer(second)) == address  # the same memory, rewritten
    assert_same(dssst1.loads(second), second_obj)
    smaller = {"ids": second_obj["ids"][:500_000].clone()}
    del second
    assert_same(dssst1.loads(dssst1.dumps(smaller)), smaller)  # resized in place, still exact


def test_a_frame_still_held_or_exported_is_never_reused() -> None:
    obj1, obj2, obj3 = _large(1), _large(2), _large(3)
    held = dssst1.dumps(obj1)  # the caller keeps the frame
    decoded = dssst1.loads(dssst1.dumps(obj2))  # the caller keeps only zero-copy tensors over a frame
    view = memoryview(dssst1.dumps(obj3))  # the caller keeps only a memoryview of a frame
    for seed in (4, 5, 6):
        assert_same(dssst1.loads(dssst1.dumps(_large(seed))), _large(seed))
    assert_same(dssst1.loads(held), obj1)
    assert_same(decoded, obj2)
    assert_same(dssst1.loads(view), obj3)


def test_decoded_tensors_release_their_frame_without_the_garbage_collector() -> None:
    frame = dssst1.dumps(_large(1))
    baseline = sys.getrefcount(frame)
    gc.disable()
    try:
        decoded = dssst1.loads(frame)
        assert sys.getrefcount(frame) > baseline
        del decoded
        assert sys.getrefcount(frame) == baseline  # no reference cycle keeps the buffer alive
    finally:
        gc.enable()


def test_threads_never_share_a_buffer() -> None:
    errors: list[str] = []

    def work(seed: int) -> None:
        for round_ in range(5):
            obj = _large(seed * 10 + round_)
            frame = dssst1.dumps(obj)
            decoded = dssst1.loads(frame)
            del frame
            if not all(torch.equal(decoded[k], v) for k, v in obj.items()):
                errors.append(f"thread {seed} round {round_}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
