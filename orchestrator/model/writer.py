"""The GGUF v3 writer: header, metadata, tensor index, then the tensor data streamed tensor by tensor.

The one writer of GGUF files in the project: ``orchestrator synth-model`` writes its models with it, the lab its
calibration models and the tests their tiny ones. Standard library only (the GPU machine's python has no
``gguf`` and no numpy), like :mod:`orchestrator.model.reader`, which reads what this writes.

The layout (ggml/include/gguf.h): ``GGUF``, version, tensor count, metadata count; the key/values; one index
entry per tensor (name, dimensions, ggml type id, offset into the data section); padding to the alignment; the
tensors' data, each padded to the alignment.

* Metadata is a mapping of key to value. A plain value gets the GGUF type :func:`infer_kind` names (an int is a
  uint32, a float a float32, a list an array of its first element's type); :class:`Typed` spells the type out
  (``Typed("i32[]", ids)``, ``Typed("u16", 0)``).
* A tensor is anything with ``name``, ``ne`` (ggml's order: the row length first) and ``type`` (a ggml type name,
  any case); its size comes from :mod:`orchestrator.model.ggml_types`.
* Data is streamed: one iterable of buffers (bytes, memoryviews, numpy arrays) per tensor, written with
  ``os.writev`` as it comes, so a file of any size is written in constant memory; each tensor's byte count is
  checked against its type and shape. Without data the tensors are a hole in a sparse file: every weight reads
  as zero (a valid value for every float and block type) and takes no disk.
* The file is written as ``PATH.part`` and renamed when complete; a failure, Ctrl-C included, removes it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from orchestrator.model.ggml_types import ggml_type

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32  # GGUF's default general.alignment

# gguf_type (ggml/include/gguf.h): id and struct format of each scalar; 9 is the array
_SCALARS = {"u8": (0, "B"), "i8": (1, "b"), "u16": (2, "H"), "i16": (3, "h"), "u32": (4, "I"), "i32": (5, "i"),
            "f32": (6, "f"), "bool": (7, "?"), "str": (8, ""), "u64": (10, "Q"), "i64": (11, "q"),
            "f64": (12, "d")}
_ARRAY = 9
# writev takes at most IOV_MAX buffers; a batch is flushed at this many buffers or bytes
_BATCH_BUFFERS = 256
_BATCH_BYTES = 16 << 20


class Tensor(Protocol):
    name: str
    ne: tuple[int, ...]
    type: str


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the index: ``ne`` in ggml's order (row length first), ``type`` a ggml type name."""

    name: str
    ne: tuple[int, ...]
    type: str = "f32"


@dataclass(frozen=True)
class Typed:
    """A metadata value with its GGUF type spelled out: ``u8`` ... ``f64``, ``bool``, ``str``, or an array of one
    of those (``i32[]``)."""

    kind: str
    value: Any


def infer_kind(value: Any) -> str:
    """The GGUF type a plain value is written as: bool; int as uint32 (int32 when negative, 64-bit when it does
    not fit); float as float32; str; a list as an array of its first element's type (uint32 while every int
    fits, else int32; an empty list is an empty uint32 array)."""
    if isinstance(value, Typed):
        return value.kind
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        if 0 <= value < 1 << 32:
            return "u32"
        if -(1 << 31) <= value < 0:
            return "i32"
        return "i64" if value < 0 else "u64"
    if isinstance(value, float):
        return "f32"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        if not value:
            return "u32[]"
        first = value[0]
        if isinstance(first, str):
            return "str[]"
        if isinstance(first, bool):
            return "bool[]"
        if isinstance(first, int):
            fits = all(isinstance(x, int) and 0 <= x < 1 << 32 for x in value)
            return "u32[]" if fits else "i32[]"
        if isinstance(first, float):
            return "f32[]"
    raise TypeError(f"cannot encode {type(value).__name__} as GGUF metadata")


def encode_str(s: str) -> bytes:
    """A GGUF string: uint64 length, then the UTF-8 bytes."""
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def encode_value(value: Any) -> bytes:
    """A metadata value: its uint32 type id, then the value (see :func:`infer_kind` and :class:`Typed`)."""
    kind = infer_kind(value)
    if isinstance(value, Typed):
        value = value.value
    if kind.endswith("[]"):
        sub = kind[:-2]
        if sub not in _SCALARS:
            raise ValueError(f"unknown GGUF array type {kind!r}")
        items = list(value)
        head = struct.pack("<IIQ", _ARRAY, _SCALARS[sub][0], len(items))
        if sub == "str":
            return head + b"".join(encode_str(x) for x in items)
        return head + struct.pack(f"<{len(items)}{_SCALARS[sub][1]}", *items)
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF type {kind!r}")
    type_id, fmt = _SCALARS[kind]
    if kind == "str":
        return struct.pack("<I", type_id) + encode_str(str(value))
    return struct.pack("<I" + fmt, type_id, value)


def encode_kv(key: str, value: Any) -> bytes:
    return encode_str(key) + encode_value(value)


def encode_tensor_info(name: str, ne: Sequence[int], type_id: int, offset: int) -> bytes:
    """One entry of the tensor index: name, dimension count, dimensions, ggml type id, data offset."""
    return (encode_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", type_id, offset))


def encode_preamble(n_tensors: int, n_kv: int, version: int = VERSION) -> bytes:
    """Magic, version, tensor count, metadata count."""
    return MAGIC + struct.pack("<IQQ", version, n_tensors, n_kv)


def tensor_nbytes(t: Tensor) -> int:
    return ggml_type(t.type).tensor_bytes(tuple(t.ne))


def padding(n: int, alignment: int = ALIGNMENT) -> int:
    return (-n) % alignment


def data_size(tensors: Iterable[Tensor], alignment: int = ALIGNMENT) -> int:
    """Bytes of the data section: every tensor padded to the alignment."""
    return sum(n + padding(n, alignment) for n in map(tensor_nbytes, tensors))


def header(metadata: Mapping[str, Any], tensors: Sequence[Tensor], alignment: int = ALIGNMENT) -> bytes:
    """Everything before the tensor data, padded to the alignment."""
    parts = [encode_preamble(len(tensors), len(metadata))]
    parts += [encode_kv(k, v) for k, v in metadata.items()]
    offset = 0
    for t in tensors:
        parts.append(encode_tensor_info(t.name, t.ne, ggml_type(t.type).id, offset))
        n = tensor_nbytes(t)
        offset += n + padding(n, alignment)
    head = b"".join(parts)
    return head + bytes(padding(len(head), alignment))


def write_all(fd: int, bufs: Sequence) -> int:
    """``os.writev`` everything in ``bufs``, through short writes and the IOV_MAX limit; returns the bytes."""
    total = 0
    views = [v for v in (memoryview(b).cast("B") for b in bufs) if len(v)]
    while views:
        batch = views[:512]
        n = os.writev(fd, batch)
        total += n
        i = 0      # drop the views written whole, trim a partial one
        while i < len(batch) and n >= len(batch[i]):
            n -= len(batch[i])
            i += 1
        views = views[i:]
        if n:
            views[0] = views[0][n:]
    return total


def write_tensor_data(fd: int, tensors: Sequence[Tensor], data: Iterable[Iterable[Any]], *,
                      alignment: int = ALIGNMENT, progress: Callable[[int, int], None] | None = None) -> int:
    """Write each tensor's buffers (``data``: one iterable of buffers per tensor, in index order) and its
    padding; checks every tensor's byte count. ``progress(done, total)`` after each tensor. Returns the bytes."""
    total = data_size(tensors, alignment)
    done = 0
    chunks = iter(data)
    for t in tensors:
        try:
            bufs = next(chunks)
        except StopIteration:
            raise ValueError(f"{t.name}: no data (fewer data streams than tensors)") from None
        want = tensor_nbytes(t)
        written = 0
        batch: list = []
        batch_bytes = 0
        for b in bufs:
            mv = memoryview(b).cast("B")
            batch.append(mv)
            batch_bytes += len(mv)
            if len(batch) >= _BATCH_BUFFERS or batch_bytes >= _BATCH_BYTES:
                written += write_all(fd, batch)
                batch, batch_bytes = [], 0
        written += write_all(fd, batch)
        if written != want:
            raise ValueError(f"{t.name}: {written} bytes of data, its type and shape take {want}")
        done += written + write_all(fd, [bytes(padding(written, alignment))])
        if progress:
            progress(done, total)
    if next(chunks, None) is not None:
        raise ValueError(f"more data streams than the {len(tensors)} tensors")
    return done


class GGUFOut:
    """A GGUF file being written: :meth:`open` creates ``PATH.part``, :meth:`write_header` and
    :meth:`write_data` fill it, :meth:`commit` renames it to ``PATH``. Used as a context manager, leaving the
    block without a commit (an error, Ctrl-C) removes the part file::

        with GGUFOut(path, metadata, tensors) as out:
            out.open()
            out.write_header()
            out.write_data(per_tensor_buffers)
            out.commit()
    """

    def __init__(self, path: str | os.PathLike, metadata: Mapping[str, Any], tensors: Iterable[Tensor], *,
                 alignment: int = ALIGNMENT):
        self.path = Path(path)
        self.part = self.path.with_name(self.path.name + ".part")
        self.tensors = list(tensors)
        self.alignment = alignment
        self.header = header(metadata, self.tensors, alignment)
        self.data_bytes = data_size(self.tensors, alignment)
        self.fd = -1
        self._committed = False

    @property
    def size(self) -> int:
        """The size of the finished file."""
        return len(self.header) + self.data_bytes

    def open(self) -> "GGUFOut":
        self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        return self

    def write_header(self) -> None:
        write_all(self.fd, [self.header])

    def write_data(self, data: Iterable[Iterable[Any]] | None = None, *,
                   progress: Callable[[int, int], None] | None = None) -> None:
        """Stream the tensors' data (see :func:`write_tensor_data`); None leaves them a hole of zeros."""
        if data is None:
            os.ftruncate(self.fd, self.size)
            return
        write_tensor_data(self.fd, self.tensors, data, alignment=self.alignment, progress=progress)

    def commit(self, *, fsync: bool = False) -> Path:
        if fsync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        size = self.part.stat().st_size
        if size != self.size:  # pragma: no cover - a bug, not a user error
            raise RuntimeError(f"{self.part}: wrote {size} bytes, expected {self.size}")
        os.replace(self.part, self.path)
        self._committed = True
        return self.path

    def __enter__(self) -> "GGUFOut":
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self._committed:
            try:
                self.part.unlink()
            except OSError:
                pass


def write_gguf(path: str | os.PathLike, metadata: Mapping[str, Any], tensors: Iterable[Tensor],
               data: Iterable[Iterable[Any]] | None = None, *, alignment: int = ALIGNMENT, fsync: bool = False,
               progress: Callable[[int, int], None] | None = None) -> int:
    """Write a GGUF file (through ``PATH.part``); ``data`` as in :func:`write_tensor_data`, None for a sparse
    file of zeros. Returns the file size."""
    with GGUFOut(path, metadata, tensors, alignment=alignment) as out:
        out.open()
        out.write_header()
        out.write_data(data, progress=progress)
        out.commit(fsync=fsync)
    return out.size


def split_paths(prefix: str | os.PathLike, n_shards: int) -> list[Path]:
    """``PREFIX-00001-of-0000N.gguf`` ..., the names ``llama-gguf-split`` gives the shards."""
    return [Path(f"{os.fspath(prefix)}-{i + 1:05d}-of-{n_shards:05d}.gguf") for i in range(n_shards)]


def write_gguf_split(prefix: str | os.PathLike, metadata: Mapping[str, Any], tensors: Iterable[Tensor],
                     n_shards: int) -> list[Path]:
    """A sparse split model as ``llama-gguf-split`` writes it: the metadata in the first shard, the
    architecture and ``split.no`` (u16) / ``split.count`` (u16) / ``split.tensors.count`` (i32) in every
    shard, the tensors spread evenly in index order. Returns the shards' paths."""
    tensors = list(tensors)
    if not 1 <= n_shards <= len(tensors):
        raise ValueError(f"{n_shards} shards of {len(tensors)} tensors: expected 1 to {len(tensors)} shards")
    per = -(-len(tensors) // n_shards)
    paths = split_paths(prefix, n_shards)
    for i, path in enumerate(paths):
        split = {"split.no": Typed("u16", i), "split.count": Typed("u16", n_shards),
                 "split.tensors.count": Typed("i32", len(tensors))}
        first = dict(metadata) if i == 0 else {"general.architecture": metadata["general.architecture"]}
        write_gguf(path, {**first, **split}, tensors[i * per:(i + 1) * per])
    return paths
