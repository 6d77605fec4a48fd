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

This package is the whole codec and nothing else: no HTTP, no torch.save (v1 bodies live in
:mod:`arctic_rl.v1compat`). Modules by role: :mod:`.format` (constants, dtype names, :class:`WireError`),
:mod:`.encode` (:func:`dumps`), :mod:`.decode` (:func:`loads` and friends), :mod:`.chunks` (byte chunking of
oversized frames) and :mod:`.buffers` (the output buffers' allocator); import the names below from here. It is simpler than safetensors-plus-glue because it never builds an
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

from .chunks import decode_byte_chunks, encode_byte_chunks, read_byte_chunk_metadata
from .decode import loads, loads_with_metadata, read_metadata
from .encode import dumps
from .format import MAX_HEADER_BYTES, MEDIA_TYPE, WIRE_VERSION, WireError

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
