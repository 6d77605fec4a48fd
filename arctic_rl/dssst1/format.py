"""DSSST1's constants: the format's name, the header bound, safetensors' dtype names and order, and the
error every encoding or decoding problem raises."""

from __future__ import annotations

import json
from typing import Final

import torch

WIRE_VERSION: Final = "DSSST1"
MEDIA_TYPE: Final = "application/octet-stream"
MAX_HEADER_BYTES: Final = 100_000_000  # the bound safetensors itself enforces

Buffer = bytes | bytearray | memoryview

PLACEHOLDER: Final = "__dss_empty__"
ROOT: Final = "__root__"
CHUNK_KEYS: Final = {"request": "request_chunk", "result": "result_chunk"}
CHUNK_PAYLOAD: Final = "payload"
MAX_NDIM: Final = 64
MAX_DIM: Final = 2**63 - 1

# safetensors dtype names in the order of its Rust ``Dtype`` enum: frames sort tensors by this
# rank, descending, then by name. Torch dtypes missing from this build are skipped.
_ST_ORDER: Final = (
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E8M0", "float8_e8m0fnu"), ("I16", "int16"),
    ("U16", "uint16"), ("F16", "float16"), ("BF16", "bfloat16"), ("I32", "int32"),
    ("U32", "uint32"), ("F32", "float32"), ("C64", "complex64"), ("F64", "float64"),
    ("I64", "int64"), ("U64", "uint64"),
)  # fmt: skip
ST_RANK: Final = {name: rank for rank, (name, _) in enumerate(_ST_ORDER)}
ST_TO_TORCH: Final = {n: getattr(torch, t) for n, t in _ST_ORDER if hasattr(torch, t)}
TORCH_TO_ST: Final = {dtype: name for name, dtype in ST_TO_TORCH.items()}
JSON_SCALARS: Final = (type(None), bool, int, float, str)
json_str = json.JSONEncoder(ensure_ascii=False).encode  # escapes exactly like serde_json


class WireError(ValueError):
    """A DSSST1 frame (or chunk set) is malformed, hostile or of another protocol; or an object
    cannot be encoded. Plain ``ValueError`` subclass, picklable, message says what is wrong."""

