"""Read a GGUF model's header -- metadata and tensor index, never tensor data -- into a :class:`ModelInfo`.

Why our own parser rather than ``gguf.GGUFReader``: the reader memory-maps the file and builds numpy views for
every metadata value and tensor (a 150k-entry vocabulary becomes 300k small arrays), which costs seconds on a
large header, and on a malformed file it fails with numpy/struct errors or tries to allocate from an unchecked
count. The format is small (a header, typed key/values, a tensor index, aligned data), so we parse it with the
standard library, check every count against the bytes that are left before using it, skip the big arrays
(vocabulary, merges) after validating them, and keep only their length. The type table lives in
:mod:`orchestrator.model.ggml_types` (tested against ``gguf.GGML_QUANT_SIZES``); no third-party import, so this
also runs under the bare ``python3`` of the GPU machine.

Sharded models (``NAME-00001-of-00004.gguf`` with ``split.*`` keys) are read as one: pass any shard; every
shard must exist and agree on ``split.count``, its ``split.no`` and the total tensor count.

The parser reads through a :class:`ByteSource`: a local file is memory-mapped whole (the page cache does the
rest); a remote file (:mod:`orchestrator.model.remote`) is read as a growing prefix of range requests, so only
the header and tensor index ever travel, never tensor data.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from orchestrator.errors import ModelError
from orchestrator.model.classes import TensorClass, classify
from orchestrator.model.ggml_types import GGML_TYPES
from orchestrator.model.info import MLAParams, ModelInfo, TensorInfo

log = logging.getLogger("orchestrator.model")

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
MAX_LAYERS = 4096
# arrays up to this many elements keep their values (per-layer hparams); longer ones (the vocabulary) only
# their length
KEEP_ARRAY_MAX = 65536

# GGUF value types
_T_UINT8, _T_INT8, _T_UINT16, _T_INT16, _T_UINT32, _T_INT32, _T_FLOAT32, _T_BOOL, _T_STRING, _T_ARRAY, \
    _T_UINT64, _T_INT64, _T_FLOAT64 = range(13)
_SCALAR_FMT = {
    _T_UINT8: "<B", _T_INT8: "<b", _T_UINT16: "<H", _T_INT16: "<h", _T_UINT32: "<I", _T_INT32: "<i",
    _T_FLOAT32: "<f", _T_BOOL: "<?", _T_UINT64: "<Q", _T_INT64: "<q", _T_FLOAT64: "<d",
}
_SCALAR_SIZE = {t: struct.calcsize(f) for t, f in _SCALAR_FMT.items()}
_TYPE_NAMES = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
               "uint64", "int64", "float64"]

_SHARD_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array too long to keep (the vocabulary, the merges): its element type and length."""

    type: str
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class RawTensor:
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int          # relative to the data section
    n_elements: int
    nbytes: int


@dataclass(frozen=True)
class GgufFile:
    """One GGUF file's header."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[RawTensor, ...]
    alignment: int
    data_offset: int     # absolute offset of the data section
    file_size: int


class MissingFile(ModelError):
    """The file (or URL) does not exist: lets :func:`read_shards` say which shard of a split model is missing."""


class ByteSource(Protocol):
    """Bytes of one file read from the front: ``name`` (for messages), ``size`` (the whole file's), and
    ``read(offset, n)`` returning exactly ``n`` bytes. The parser asks only for a growing prefix, in order."""

    name: str
    size: int

    def read(self, offset: int, n: int) -> bytes: ...


# A source without a memory map is read in requests that double the prefix, from FIRST_READ up, and that go at
# most MAX_READAHEAD past what the parser asked for: few round trips for a large vocabulary, little over-read.
FIRST_READ = 1 << 20
MAX_READAHEAD = 16 << 20


class _Prefix:
    """The front of a :class:`ByteSource`, extended on demand; ``grow(upto)`` returns a buffer of at least
    ``upto`` bytes."""

    def __init__(self, source: ByteSource) -> None:
        self.source = source
        self.data = bytearray()

    def grow(self, upto: int) -> bytearray:
        have = len(self.data)
        want = min(self.source.size, max(upto, FIRST_READ, min(2 * have, upto + MAX_READAHEAD)))
        chunk = self.source.read(have, want - have)
        if len(chunk) != want - have:
            raise ModelError(f"{self.source.name}: short read: asked for {want - have} bytes at offset {have}, "
                             f"got {len(chunk)}")
        self.data += chunk
        return self.data


class _Cursor:
    """Bounds-checked little-endian reads over a buffer that holds the file's first ``avail`` bytes (all of it
    for a memory map; a growing prefix for a remote file, extended by ``grow``). Every read names the section
    it is in, so a truncated file says where it ends."""

    __slots__ = ("buf", "pos", "end", "avail", "grow", "path", "section")

    def __init__(self, buf, path: str, end: int, grow: Callable[[int], Any] | None = None) -> None:
        self.buf = buf
        self.pos = 0
        self.end = end
        self.avail = end if grow is None else len(buf)
        self.grow = grow
        self.path = path
        self.section = "header"

    def fail(self, what: str) -> ModelError:
        return ModelError(f"{self.path}: {what}")

    def short(self, what: str, claimed: int, at: int) -> ModelError:
        """``what`` at offset ``at`` needs ``claimed`` bytes and the file ends first: a file cut short (a copy
        or download that stopped) when the claim is one a real file could make, else a corrupt count."""
        return _short(self.path, self.end, self.section, what, claimed, at)

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise self.short("the next value", n, self.pos)
        if self.pos + n > self.avail:
            self.buf = self.grow(self.pos + n)
            self.avail = len(self.buf)

    def u32(self) -> int:
        self.need(4)
        v = struct.unpack_from("<I", self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self) -> int:
        self.need(8)
        v = struct.unpack_from("<Q", self.buf, self.pos)[0]
        self.pos += 8
        return v

    def scalar(self, t: int) -> Any:
        n = _SCALAR_SIZE[t]
        self.need(n)
        v = struct.unpack_from(_SCALAR_FMT[t], self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.u64()
        if n > self.end - self.pos:
            raise self.short(what, n, self.pos)
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"corrupt GGUF: {what} at offset {self.pos - n} is not UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        buf, pos, end, avail = self.buf, self.pos, self.end, self.avail
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > avail:
                self.pos = pos
                self.need(8)
                buf, avail = self.buf, self.avail
            n = unpack(buf, pos)[0]
            pos += 8
            if n > end - pos:
                raise self.short(f"element {i} of {what}", n, pos)
            pos += n
        self.pos = pos


# The most a length or count in a real GGUF can ask for: a claim beyond it is corruption, not a file cut short
# (the largest models are under 1 TiB).
PLAUSIBLE_BYTES = 1 << 42


def _short(path: str, size: int, section: str, what: str, claimed: int, at: int) -> ModelError:
    if 0 <= claimed <= PLAUSIBLE_BYTES:
        return ModelError(f"{path}: truncated GGUF: the file ends at byte {size}, inside the {section}: {what} "
                          f"needs {claimed} bytes from offset {at} (a copy or download cut short?)")
    return ModelError(f"{path}: corrupt GGUF: {what} claims {claimed} bytes at offset {at}, more than the "
                      f"file's {size}")


def _open_map(path: str):
    """Open ``path`` for header reading: returns (file object, buffer, size). Errors name the path."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise MissingFile(f"{path}: no such file") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None
    if p.is_dir():
        raise ModelError(f"{path}: is a directory, expected a .gguf file")
    size = st.st_size
    if size == 0:
        raise ModelError(f"{path}: empty file, expected a GGUF model")
    try:
        f = open(p, "rb")
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        # not mappable (a pipe, a special file): read what a header can need, bounded
        data = f.read(min(size, 256 << 20))
        return f, data, len(data)
    return f, buf, size


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """Parse one local GGUF file's header and tensor index, validating every count and offset."""
    path = str(path)
    f, buf, size = _open_map(path)
    try:
        return _parse(_Cursor(buf, path, size))
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
        f.close()


def read_gguf_source(source: ByteSource) -> GgufFile:
    """Parse one GGUF file's header and tensor index from ``source``, reading only the prefix they occupy."""
    prefix = _Prefix(source)
    return _parse(_Cursor(prefix.data, source.name, source.size, grow=prefix.grow))


def _parse(c: _Cursor) -> GgufFile:
    path, size = c.path, c.end
    if size < 4:
        raise ModelError(f"{path}: not a GGUF file ({size} bytes, too short for the 'GGUF' magic)")
    c.need(4)
    magic = bytes(c.buf[0:4])
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    c.pos = 4
    version = c.u32()
    if version not in SUPPORTED_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in SUPPORTED_VERSIONS:
            raise ModelError(f"{path}: big-endian GGUF (version {swapped}) is not supported")
        raise ModelError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors = c.u64()
    n_kv = c.u64()
    # every key/value takes at least 8 (key length) + 1 (key) + 4 (type) + 1 (value) bytes; every tensor info
    # at least 8 + 1 + 4 + 8 + 4 + 8: a count that no real file could hold is corrupt, not a reason to allocate;
    # one that a real file could hold is left to the reads below, which find where a file cut short ends
    if n_kv * 14 > PLAUSIBLE_BYTES:
        raise _short(path, size, "header", f"a metadata count of {n_kv}", n_kv * 14, c.pos)
    if n_tensors * 33 > PLAUSIBLE_BYTES:
        raise _short(path, size, "header", f"a tensor count of {n_tensors}", n_tensors * 33, c.pos)

    c.section = "metadata"
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}")
        if key in metadata:
            raise ModelError(f"{path}: corrupt GGUF: duplicate metadata key {key!r}")
        t = c.u32()
        metadata[key] = _read_value(c, t, key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise ModelError(f"{path}: general.alignment must be a power of two, got {alignment!r}")

    c.section = "tensor index"
    raw: list[RawTensor] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = c.string(f"tensor name #{i}")
        if name in seen:
            raise ModelError(f"{path}: corrupt GGUF: duplicate tensor {name!r}")
        seen.add(name)
        n_dims = c.u32()
        if n_dims == 0 or n_dims > GGML_MAX_DIMS:
            raise ModelError(f"{path}: tensor {name!r} has {n_dims} dimensions (expected 1..{GGML_MAX_DIMS})")
        shape = tuple(c.u64() for _ in range(n_dims))
        type_id = c.u32()
        offset = c.u64()
        gt = GGML_TYPES.get(type_id)
        if gt is None:
            raise ModelError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}")
        n_el = 1
        for d in shape:
            if d <= 0:
                raise ModelError(f"{path}: tensor {name!r} has a zero or negative dimension {list(shape)}")
            n_el *= d
        if n_el >= 1 << 62:
            raise ModelError(f"{path}: tensor {name!r} has an absurd shape {list(shape)}")
        if shape[0] % gt.block:
            raise ModelError(f"{path}: tensor {name!r} of type {gt.name} has a row of {shape[0]} elements, "
                             f"not a multiple of the block size {gt.block}")
        if offset % alignment:
            raise ModelError(f"{path}: tensor {name!r} data offset {offset} is not aligned to {alignment}")
        raw.append(RawTensor(name, shape, type_id, offset, n_el, gt.tensor_bytes(shape)))

    data_offset = (c.pos + alignment - 1) // alignment * alignment
    data_size = size - data_offset
    # tensors must lie inside the data section without overlapping
    prev_end, prev_name = 0, None
    for t in sorted(raw, key=lambda t: t.offset):
        if t.offset < prev_end:
            raise ModelError(f"{path}: corrupt GGUF: tensor {t.name!r} overlaps {prev_name!r}")
        end = t.offset + t.nbytes
        if end > data_size:
            raise ModelError(f"{path}: truncated GGUF: the file ends at byte {size}, inside the tensor data: "
                             f"tensor {t.name!r} data ends at byte {data_offset + end} (a copy or download cut "
                             f"short?)")
        prev_end, prev_name = end, t.name
    return GgufFile(path, version, metadata, tuple(raw), alignment, data_offset, size)


def _read_value(c: _Cursor, t: int, key: str) -> Any:
    if t in _SCALAR_FMT:
        return c.scalar(t)
    if t == _T_STRING:
        return c.string(f"value of {key!r}")
    if t == _T_ARRAY:
        et = c.u32()
        n = c.u64()
        if et == _T_ARRAY:
            raise c.fail(f"unsupported GGUF: metadata {key!r} is an array of arrays")
        if et == _T_STRING:
            if n > (c.end - c.pos) // 8:
                raise c.short(f"array {key!r} of {n} strings", n * 8, c.pos)
            if n > KEEP_ARRAY_MAX:
                c.skip_strings(n, f"array {key!r}")
                return ArrayInfo("string", n)
            return [c.string(f"element {i} of {key!r}") for i in range(n)]
        if et not in _SCALAR_FMT:
            raise c.fail(f"corrupt GGUF: array {key!r} has unknown element type {et}")
        es = _SCALAR_SIZE[et]
        if n > (c.end - c.pos) // es:
            raise c.short(f"array {key!r} of {n} elements of {es} bytes", n * es, c.pos)
        if n > KEEP_ARRAY_MAX:
            c.pos += n * es
            return ArrayInfo(_TYPE_NAMES[et], n)
        c.need(n * es)
        vals = list(struct.unpack_from(f"<{n}{_SCALAR_FMT[et][1]}", c.buf, c.pos))
        c.pos += n * es
        return vals
    raise c.fail(f"corrupt GGUF: metadata {key!r} has unknown value type {t}")


# ---- shards ---------------------------------------------------------------------------------------------

def shard_paths(path: str | os.PathLike) -> list[str]:
    """All shard paths of a split model, given any one of them (a single-file model: ``[path]``)."""
    path = str(path)
    m = _SHARD_RE.match(path)
    if not m:
        return [path]
    count = int(m.group("count"))
    if count < 1:
        raise ModelError(f"{path}: shard name says '-of-{m.group('count')}'")
    return [f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def read_shards(path: str | os.PathLike, read: Callable[[str], GgufFile] = read_gguf) -> list[GgufFile]:
    """The headers of every shard of the model ``path`` names. ``read`` parses one shard by name (a local path,
    or a URL through :mod:`orchestrator.model.remote`); shards are named alike either way."""
    path = str(path)
    first = read(path)
    split_count = first.metadata.get("split.count")
    named = shard_paths(path)
    if split_count is None:
        if len(named) > 1:
            raise ModelError(f"{path}: named as shard of {len(named)} but has no split.count metadata")
        return [first]
    if not isinstance(split_count, int) or split_count < 1 or split_count > 10000:
        raise ModelError(f"{path}: split.count must be a positive integer, got {split_count!r}")
    if len(named) != split_count:
        if split_count == 1:
            named = [path]
        else:
            raise ModelError(f"{path}: split.count is {split_count} but the file name does not follow "
                             f"NAME-0000K-of-{split_count:05d}.gguf")
    files: list[GgufFile] = []
    for i, p in enumerate(named):
        if p == path:
            g = first
        else:
            try:
                g = read(p)
            except MissingFile:
                raise MissingFile(f"{p}: missing shard {i + 1} of {split_count} (of {named[0]})") from None
        no = g.metadata.get("split.no")
        cnt = g.metadata.get("split.count")
        if cnt != split_count or no != i:
            raise ModelError(f"{p}: mismatched shard: split.no={no} split.count={cnt}, expected "
                             f"split.no={i} split.count={split_count}")
        files.append(g)
    expect = files[0].metadata.get("split.tensors.count")
    got = sum(len(g.tensors) for g in files)
    if isinstance(expect, int) and expect != got:
        raise ModelError(f"{named[0]}: split.tensors.count is {expect} but the {split_count} shards hold {got}")
    names: set[str] = set()
    for g in files:
        for t in g.tensors:
            if t.name in names:
                raise ModelError(f"{g.path}: tensor {t.name!r} appears in more than one shard")
            names.add(t.name)
    return files


# ---- hyper-parameters ------------------------------------------------------------------------------------

# arch -> (default SWA pattern, dense_first, needs attention.sliding_window > 0): llama.cpp's
# load_swa_pattern() calls in src/models/*.cpp. Layer il is SWA when (il % n < n - 1), or with dense_first
# when (il % n != 0); n == 0 makes every layer SWA.
_SWA_ARCHS: dict[str, tuple[int, bool, bool]] = {
    "gpt-oss": (2, False, False),
    "gemma2": (2, False, False),
    "gemma3": (6, False, True),
    "gemma3n": (5, False, False),
    "gemma-embedding": (6, False, False),
    "cohere2": (4, False, False),
    "cohere2moe": (4, True, False),
    "exaone4": (4, False, True),
    "exaone-moe": (4, False, False),
    "olmo2": (4, False, True),
    "afmoe": (4, False, True),
    "smallthinker": (4, True, True),
    "mellum": (4, False, True),
    "plamo3": (8, False, True),
    "muse-glimmer": (4, False, False),
    "laguna": (4, True, True),
    "llama4": (4, False, False),
    "step35": (0, False, False),
    "mimo2": (0, False, False),
}


class _Meta:
    def __init__(self, path: str, md: dict[str, Any], arch: str, n_layers: int) -> None:
        self.path, self.md, self.arch, self.n_layers = path, md, arch, n_layers

    def get(self, key: str, default: Any = None) -> Any:
        return self.md.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: int | None = None, *, required: bool = False) -> int | None:
        full = f"{self.arch}.{key}"
        v = self.md.get(full)
        if v is None:
            if required:
                raise ModelError(f"{self.path}: missing metadata {full}")
            return default
        if isinstance(v, list):
            v = max(v) if v else 0
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelError(f"{self.path}: metadata {full} must be a non-negative integer, got {v!r}")
        return v

    def per_layer(self, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
        full = f"{self.arch}.{key}"
        v = self.md.get(full)
        if v is None:
            return default
        if isinstance(v, list):
            if len(v) != self.n_layers:
                raise ModelError(f"{self.path}: metadata {full} has {len(v)} values, expected one per layer "
                                 f"({self.n_layers})")
            if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
                raise ModelError(f"{self.path}: metadata {full} must hold non-negative integers")
            return tuple(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelError(f"{self.path}: metadata {full} must be a non-negative integer, got {v!r}")
        return (v,) * self.n_layers


def _swa_layers(m: _Meta, n_trunk: int) -> tuple[tuple[int, ...], int | None, bool]:
    window = m.int("attention.sliding_window", 0) or 0
    pattern = m.get("attention.sliding_window_pattern")
    arch = m.arch
    chunked = False
    if arch == "llama4":
        found = m.get("attention.sliding_window") is not None
        if found and window == 0:
            return (), None, False
        window, chunked = 8192, True
    if isinstance(pattern, list):
        flags = [bool(x) for x in pattern][:n_trunk]
        layers = tuple(i for i, f in enumerate(flags) if f)
        return (layers, window or None, chunked) if window and layers else ((), None, False)
    spec = _SWA_ARCHS.get(arch)
    if spec is None:
        if not window or pattern is None:
            return (), None, False
        spec = (int(pattern), False, True)
    n, dense_first, _needs_window = spec
    if isinstance(pattern, int) and not isinstance(pattern, bool):
        n = pattern
    if not window:
        return (), None, False
    if dense_first:
        layers = tuple(i for i in range(n_trunk) if n == 0 or i % n != 0)
    else:
        layers = tuple(i for i in range(n_trunk) if n == 0 or i % n < n - 1)
    return layers, window, chunked


def _vocab_size(md: dict[str, Any], m: _Meta, tensors: list[TensorInfo]) -> int:
    v = m.int("vocab_size")
    if v:
        return v
    tok = md.get("tokenizer.ggml.tokens")
    if tok is not None:
        return len(tok)
    for t in tensors:
        if t.name in ("token_embd.weight", "output.weight") and len(t.shape) >= 2:
            return t.shape[1]
    return 0


def read_model(path: str | os.PathLike, read: Callable[[str], GgufFile] = read_gguf) -> ModelInfo:
    """Read a model's metadata and tensor index (all shards) -- never its tensor data. ``read``: see
    :func:`read_shards`."""
    files = read_shards(path, read)
    first = files[0]
    p = first.path
    md = first.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{p}: missing metadata general.architecture (not a model GGUF?)")
    bc = md.get(f"{arch}.block_count")
    if bc is None:
        raise ModelError(f"{p}: missing metadata {arch}.block_count")
    if isinstance(bc, bool) or not isinstance(bc, int) or not 0 < bc <= MAX_LAYERS:
        raise ModelError(f"{p}: metadata {arch}.block_count must be 1..{MAX_LAYERS}, got {bc!r}")
    n_layers = bc
    m = _Meta(p, md, arch, n_layers)
    warnings: list[str] = []

    n_nextn = m.int("nextn_predict_layers", 0) or 0
    if n_nextn >= n_layers:
        raise ModelError(f"{p}: {arch}.nextn_predict_layers ({n_nextn}) must be below block_count ({n_layers})")
    n_trunk = n_layers - n_nextn

    tensors: list[TensorInfo] = []
    for shard, g in enumerate(files):
        for r in g.tensors:
            cls, layer = classify(r.name, nextn_from=n_trunk if n_nextn else None)
            if layer is not None and layer >= n_layers:
                raise ModelError(f"{g.path}: tensor {r.name!r} is in layer {layer} but {arch}.block_count "
                                 f"is {n_layers}")
            tensors.append(TensorInfo(r.name, cls, layer, r.nbytes, GGML_TYPES[r.type_id].name, r.shape,
                                      r.n_elements, shard, g.data_offset + r.offset))

    n_embd = m.int("embedding_length", required=True)
    if n_embd == 0:
        raise ModelError(f"{p}: metadata {arch}.embedding_length is 0")
    n_head_layers = m.per_layer("attention.head_count", (0,) * n_layers)
    n_head = max(n_head_layers) if n_head_layers else 0
    n_head_kv_layers = m.per_layer("attention.head_count_kv", n_head_layers)
    n_head_kv = max(n_head_kv_layers) if n_head_kv_layers else 0
    head_dim_k = m.int("attention.key_length") or (n_embd // n_head if n_head else 0)
    head_dim_v = m.int("attention.value_length") or (n_embd // n_head if n_head else 0)
    n_ff = m.int("feed_forward_length") or None

    # experts
    n_expert = m.int("expert_count", 0) or 0
    n_expert_used = m.int("expert_used_count", 0) or 0
    routed = [t for t in tensors if t.cls is TensorClass.ROUTED_EXPERT]
    if routed and n_expert == 0:
        inferred = _infer_experts(routed)
        if inferred is None:
            raise ModelError(f"{p}: {arch}.expert_count is missing and the expert tensors' shapes disagree")
        n_expert = inferred[0]
        msg = (f"{p}: {arch}.expert_count is missing or 0 but expert tensors exist; inferred {n_expert} "
               f"experts from {inferred[1]}")
        warnings.append(msg)
        log.warning(msg)
    if n_expert_used > n_expert:
        raise ModelError(f"{p}: {arch}.expert_used_count ({n_expert_used}) is larger than "
                         f"{arch}.expert_count ({n_expert})")
    if routed and n_expert_used == 0:
        raise ModelError(f"{p}: {arch}.expert_used_count is missing or 0 but the model has routed experts")
    n_expert_shared = m.int("expert_shared_count", 0) or 0
    n_ff_exp = m.int("expert_feed_forward_length") or None
    if n_ff_exp is None and routed:
        n_ff_exp = _infer_ff_exp(routed, n_embd)
    moe_layers = sorted({t.layer for t in routed if t.layer is not None})
    n_dense_lead = m.int("leading_dense_block_count")
    if n_dense_lead is None:
        n_dense_lead = moe_layers[0] if moe_layers else 0

    # MLA: llama.cpp treats the model as MLA when the decompressed head sizes are in the metadata
    mla = None
    kv_lora = m.int("attention.kv_lora_rank")
    k_mla = m.int("attention.key_length_mla")
    v_mla = m.int("attention.value_length_mla")
    if kv_lora and k_mla and v_mla:
        rope = m.int("rope.dimension_count") or max(head_dim_k - kv_lora, 0)
        mla = MLAParams(kv_lora_rank=kv_lora, q_lora_rank=m.int("attention.q_lora_rank", 0) or 0,
                        qk_rope_head_dim=rope, qk_nope_head_dim=k_mla - rope, k_head_dim=k_mla, v_head_dim=v_mla)

    swa_layers, window, chunked = _swa_layers(m, n_trunk)
    n_vocab = _vocab_size(md, m, tensors)
    name = md.get("general.name")
    return ModelInfo(
        paths=tuple(g.path for g in files), arch=arch, name=name if isinstance(name, str) else None,
        n_layers=n_layers, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k,
        head_dim_v=head_dim_v, n_ff=n_ff, n_expert=n_expert, n_expert_used=n_expert_used,
        n_expert_shared=n_expert_shared, n_ff_exp=n_ff_exp, n_dense_lead=n_dense_lead, n_vocab=n_vocab,
        n_ctx_train=m.int("context_length", 0) or 0, mla=mla, sliding_window=window, swa_layers=swa_layers,
        n_nextn_layers=n_nextn, tensors=tuple(tensors), file_bytes=sum(g.file_size for g in files),
        n_head_kv_layers=n_head_kv_layers, n_head_layers=n_head_layers, swa_chunked=chunked,
        warnings=tuple(warnings),
    )


def _infer_experts(routed: list[TensorInfo]) -> tuple[int, str] | None:
    """The expert count is the last dimension of every 3-D expert weight (and of 2-D expert biases)."""
    counts: dict[int, str] = {}
    for t in routed:
        if len(t.shape) == 3:
            counts.setdefault(t.shape[2], t.name)
    if len(counts) != 1:
        return None
    n, name = next(iter(counts.items()))
    return n, f"the shape of {name}"


def _infer_ff_exp(routed: list[TensorInfo], n_embd: int) -> int | None:
    for t in routed:
        if len(t.shape) == 3 and "down" in t.name:
            return t.shape[0]
    for t in routed:
        if len(t.shape) == 3 and t.shape[0] == n_embd:
            return t.shape[1]
    return None
