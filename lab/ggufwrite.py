"""A minimal GGUF v3 writer (standard library only) for calibration models that llama.cpp loads for real.

Tensor data is left as a hole in a sparse file: every weight reads as zero, so a 20 GB model is written in a
second and takes no disk until something writes to it. Zero weights are valid for every type used here (a
zero F16/F32 is 0.0; a zero Q4_0/Q8_0/MXFP4 block has scale 0), so llama-server loads the model and decodes a
batch with it -- which is all memory calibration needs. The file is written under a temporary name and renamed.

``orchestrator synth-model`` (the ``synth`` branch) makes realistic models for the product; this writer exists
so that ``calibrate.py`` runs on a machine whose ``python3`` has no ``gguf`` package.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from orchestrator.fsutil import write_atomic
from orchestrator.model.ggml_types import ggml_type

ALIGN = 32


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]   # ggml order: shape[0] is the row length
    type: str = "F32"

    @property
    def nbytes(self) -> int:
        return ggml_type(self.type).tensor_bytes(self.shape)


class I32(list):
    """A list written as an int32 array (``tokenizer.ggml.token_type``)."""


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v: Any) -> bytes:
    """Encode a metadata value with its GGUF type: bool, int (uint32, or int64/uint64 when needed), float
    (float32), str, list of one of those (array), or a ``(type_id, value)`` pair to force a type."""
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int) and not isinstance(v[0], bool):
        t, x = v
        fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}[t]
        return struct.pack("<I", t) + struct.pack(fmt, x)
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        if 0 <= v < 1 << 32:
            return struct.pack("<II", 4, v)
        if v < 0 and v >= -(1 << 31):
            return struct.pack("<Ii", 5, v)
        return struct.pack("<Iq", 11, v) if v < 0 else struct.pack("<IQ", 10, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _str(v)
    if isinstance(v, I32):
        return struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)
    if isinstance(v, (list, tuple)):
        items = list(v)
        if not items:
            return struct.pack("<IIQ", 9, 4, 0)
        x0 = items[0]
        if isinstance(x0, str):
            return struct.pack("<IIQ", 9, 8, len(items)) + b"".join(_str(x) for x in items)
        if isinstance(x0, bool):
            return struct.pack("<IIQ", 9, 7, len(items)) + struct.pack(f"<{len(items)}?", *items)
        if isinstance(x0, int):
            if all(isinstance(x, int) and x >= 0 for x in items) and max(items) < 1 << 32:
                return struct.pack("<IIQ", 9, 4, len(items)) + struct.pack(f"<{len(items)}I", *items)
            return struct.pack("<IIQ", 9, 5, len(items)) + struct.pack(f"<{len(items)}i", *items)
        if isinstance(x0, float):
            return struct.pack("<IIQ", 9, 6, len(items)) + struct.pack(f"<{len(items)}f", *items)
    raise TypeError(f"cannot encode {type(v).__name__} as GGUF metadata")


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: Iterable[TensorSpec]) -> int:
    """Write a GGUF v3 file with zero (sparse) tensor data; returns the file size. Atomic (temp + rename)."""
    path = os.fspath(path)
    tensors = list(tensors)
    head = bytearray(b"GGUF")
    head += struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for k, v in metadata.items():
        head += _str(k) + _value(v)
    offset = 0
    for t in tensors:
        head += _str(t.name) + struct.pack("<I", len(t.shape))
        head += struct.pack(f"<{len(t.shape)}Q", *t.shape)
        head += struct.pack("<IQ", ggml_type(t.type).id, offset)
        offset += (t.nbytes + ALIGN - 1) // ALIGN * ALIGN
    pad = (-len(head)) % ALIGN
    head += b"\0" * pad
    total = len(head) + offset
    write_atomic(path, bytes(head), size=total)
    return total


def spm_vocab(n_vocab: int) -> dict[str, Any]:
    """A SentencePiece-style ("llama") vocabulary of ``n_vocab`` tokens that llama.cpp accepts: <unk>, <s>,
    </s>, the 256 byte tokens, then filler pieces."""
    if n_vocab < 300:
        raise ValueError("n_vocab must be at least 300")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        a, b = divmod(i, 26)
        piece = "\u2581" + letters[b] if a == 0 else f"\u2581{letters[b]}{a}"
        tokens.append(piece)
        types.append(1)
        i += 1
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(j) for j in range(n_vocab - 259)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": I32(types),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }


def write_gguf_split(prefix: str | os.PathLike, metadata: dict[str, Any], tensors: Iterable[TensorSpec],
                     n_shards: int) -> list[str]:
    """Write a split model like ``gguf-split``: ``PREFIX-0000K-of-0000N.gguf``, the metadata in the first shard,
    ``split.no``/``split.count``/``split.tensors.count`` in every shard, tensors spread evenly."""
    tensors = list(tensors)
    if not 1 <= n_shards <= len(tensors):
        raise ValueError("n_shards must be between 1 and the number of tensors")
    per = -(-len(tensors) // n_shards)
    paths = []
    for i in range(n_shards):
        part = tensors[i * per:(i + 1) * per]
        split = {"split.no": (2, i), "split.count": (2, n_shards), "split.tensors.count": (5, len(tensors))}
        md = {**metadata, **split} if i == 0 else {"general.architecture": metadata["general.architecture"], **split}
        path = f"{os.fspath(prefix)}-{i + 1:05d}-of-{n_shards:05d}.gguf"
        write_gguf(path, md, part)
        paths.append(path)
    return paths
