"""The GGUF writer against the reference reader (gguf.GGUFReader): every value type, streamed and sparse data,
split files; a stream of the wrong size is named and leaves nothing behind."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from orchestrator.model import read_model
from orchestrator.model.writer import TensorInfo, Typed, infer_kind, padding, write_gguf, write_gguf_split

VT = gguf.GGUFValueType


def _fields(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_every_value_type_reads_back_with_its_type(tmp_path):
    md = {
        "general.architecture": "llama", "u": 7, "neg": -3, "big": 1 << 40, "bigneg": -(1 << 40), "f": 0.5,
        "b": True, "s": "héllo", "strs": ["a", "bc"], "ints": [1, 2], "negs": [1, -2], "floats": [0.25, 1.5],
        "bools": [True, False], "empty": [], "u16": Typed("u16", 9), "i8": Typed("i8", -1),
        "f64": Typed("f64", 0.1), "u64s": Typed("u64[]", [1 << 50]),
    }
    want = {"u": VT.UINT32, "neg": VT.INT32, "big": VT.UINT64, "bigneg": VT.INT64, "f": VT.FLOAT32, "b": VT.BOOL,
            "s": VT.STRING, "u16": VT.UINT16, "i8": VT.INT8, "f64": VT.FLOAT64}
    arrays = {"strs": VT.STRING, "ints": VT.UINT32, "negs": VT.INT32, "floats": VT.FLOAT32, "bools": VT.BOOL,
              "empty": VT.UINT32, "u64s": VT.UINT64}
    write_gguf(tmp_path / "kv.gguf", md, [TensorInfo("a", (8,))])
    f = _fields(tmp_path / "kv.gguf")
    for key, t in want.items():
        assert f[key].types == [t], key
    for key, t in arrays.items():
        assert f[key].types[0] == VT.ARRAY and (len(f[key].types) == 1 or f[key].types[1] == t), key
    assert f["big"].contents() == 1 << 40 and f["bigneg"].contents() == -(1 << 40)
    assert f["s"].contents() == "héllo" and f["strs"].contents() == ["a", "bc"]
    assert f["negs"].contents() == [1, -2] and f["floats"].contents() == [0.25, 1.5]
    assert f["f64"].contents() == 0.1 and f["u64s"].contents() == [1 << 50]


def test_an_unencodable_value_is_a_type_error():
    with pytest.raises(TypeError, match="dict"):
        infer_kind({"a": 1})


def test_streamed_data_reads_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)          # ne (5, 3): 60 bytes, padded to 64
    b = rng.standard_normal((4, 32)).astype(np.float16)
    q = rng.integers(0, 256, (2, 34), dtype=np.uint8)           # two Q8_0 blocks: ne (64, 1)
    tensors = [TensorInfo("a", (5, 3), "f32"), TensorInfo("b", (32, 4), "F16"), TensorInfo("q", (64,), "q8_0")]
    # a tensor's data may come in any number of pieces
    data = [[a[:1], a[1:]], [b], (q[i] for i in range(2))]
    seen = []
    size = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, tensors, data,
                      progress=lambda done, total: seen.append((done, total)))
    assert size == (tmp_path / "m.gguf").stat().st_size
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    got = {t.name: t for t in r.tensors}
    assert np.array_equal(got["a"].data, a) and np.array_equal(got["b"].data, b)
    assert bytes(got["q"].data.tobytes()) == q.tobytes()
    assert [t.data_offset for t in r.tensors] == sorted(t.data_offset for t in r.tensors)
    assert all(t.data_offset % 32 == 0 for t in r.tensors)
    total = 60 + padding(60) + 256 + 68 + padding(68)
    assert seen == [(64, total), (320, total), (total, total)]


@pytest.mark.parametrize("data,msg", [
    ([[b"\0" * 32]], "t: 32 bytes of data, its type and shape take 64"),
    ([], "t: no data"),
    ([[b"\0" * 64], [b""]], "more data streams than the 1 tensors"),
])
def test_a_stream_of_the_wrong_size_is_named_and_leaves_nothing(tmp_path, data, msg):
    with pytest.raises(ValueError) as e:
        write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, [TensorInfo("t", (16,))], data)
    assert msg in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_write_leaves_nothing_and_an_old_file_alone(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")

    def stream():
        yield b"\0" * 32
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_gguf(out, {"general.architecture": "llama"}, [TensorInfo("t", (16,))], [stream()])
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_without_data_the_file_is_sparse_zeros(tmp_path):
    big = TensorInfo("blk.0.ffn_up_exps.weight", (4096, 4096, 64), "q4_0")     # 576 MiB
    size = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama", "llama.block_count": 1}, [big])
    st = (tmp_path / "m.gguf").stat()
    assert st.st_size == size > 576 << 20
    assert st.st_blocks * 512 < 1 << 20          # no disk behind the data
    with open(tmp_path / "m.gguf", "rb") as f:
        f.seek(size - 4096)
        assert f.read() == bytes(4096)


def test_split_files_read_as_one_model(tmp_path):
    md = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 32}
    tensors = [TensorInfo(f"blk.{i}.attn_q.weight", (32, 32)) for i in range(2)]
    tensors.append(TensorInfo("output_norm.weight", (32,)))
    paths = write_gguf_split(tmp_path / "m", md, tensors, 2)
    assert [p.name for p in paths] == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    f0, f1 = _fields(paths[0]), _fields(paths[1])
    assert f1["split.no"].contents() == 1 and f1["split.count"].contents() == 2
    assert f1["split.no"].types == [VT.UINT16] and f0["split.tensors.count"].types == [VT.INT32]
    assert "llama.block_count" in f0 and "llama.block_count" not in f1
    m = read_model(paths[1])
    assert [t.name for t in m.tensors] == [t.name for t in tensors] and len(m.paths) == 2
    with pytest.raises(ValueError, match="4 shards of 3 tensors"):
        write_gguf_split(tmp_path / "x", md, tensors, 4)
