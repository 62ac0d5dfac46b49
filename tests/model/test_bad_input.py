"""Bad input: every malformed file is one ModelError line naming the file and what is wrong; counts are checked
before anything is allocated from them; the CLI prints the line and exits 2."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import ModelError
from orchestrator.model import read_model
from lab.calibmodels import build
from orchestrator.model.writer import TensorInfo, encode_kv, encode_preamble, encode_str, encode_tensor_info, write_gguf

REPO = Path(__file__).resolve().parents[2]


# The malformed files are made of the writer's own encoders with wrong counts, lengths, types or offsets; the
# writer itself never writes such a file.
header = encode_preamble
kv = encode_kv


def tensor_info(name: str, shape, type_id: int = 0, offset: int = 0) -> bytes:
    return encode_tensor_info(name, shape, type_id, offset)


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(ModelError) as e:
        read_model(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(path) in msg
    for f in fragments:
        assert f in msg, msg
    return msg


@pytest.fixture()
def valid(tmp_path, tiny_specs) -> Path:
    path = tmp_path / "valid.gguf"
    write_gguf(path, *build(tiny_specs["qwen3moe"]))
    read_model(path)
    return path


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    expect_error(p, "empty file")


def test_too_short_for_magic(tmp_path):
    p = tmp_path / "short.gguf"
    p.write_bytes(b"GG")
    expect_error(p, "not a GGUF file")


def test_text_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("this is a text file, not a model\n" * 10)
    expect_error(p, "not a GGUF file", "b'this'")


def test_wrong_magic(tmp_path):
    p = tmp_path / "ggml.bin"
    p.write_bytes(b"ggjt" + b"\0" * 100)
    expect_error(p, "not a GGUF file", "expected b'GGUF'")


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(tmp_path, version):
    p = tmp_path / "v.gguf"
    p.write_bytes(header(0, 0, version))
    expect_error(p, f"unsupported GGUF version {version}")


def test_big_endian(tmp_path):
    p = tmp_path / "be.gguf"
    p.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    expect_error(p, "big-endian")


def test_directory(tmp_path):
    expect_error(tmp_path, "is a directory")


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")


def test_absurd_tensor_count(tmp_path):
    p = tmp_path / "n.gguf"
    p.write_bytes(header(1 << 60, 0))
    expect_error(p, "corrupt GGUF", "tensor count", "claims")


def test_absurd_metadata_count(tmp_path):
    p = tmp_path / "n.gguf"
    p.write_bytes(header(0, 1 << 60))
    expect_error(p, "corrupt GGUF", "metadata count", "claims")


def test_absurd_string_length(tmp_path):
    p = tmp_path / "s.gguf"
    p.write_bytes(header(0, 1) + struct.pack("<Q", 1 << 60) + b"general.architecture")
    expect_error(p, "claims", "bytes")


def test_absurd_array_length(tmp_path):
    p = tmp_path / "a.gguf"
    p.write_bytes(header(0, 1) + encode_str("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 1 << 60) + b"\0" * 64)
    expect_error(p, "tokenizer.ggml.scores", "claims")


def test_absurd_string_array_length(tmp_path):
    p = tmp_path / "a.gguf"
    p.write_bytes(header(0, 1) + encode_str("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 60) + b"\0" * 64)
    expect_error(p, "tokenizer.ggml.tokens", "claims")


def test_truncated_in_header(valid):
    valid.write_bytes(valid.read_bytes()[:20])
    expect_error(valid, "truncated", "header")


def test_truncated_in_metadata(valid):
    valid.write_bytes(valid.read_bytes()[:300])
    expect_error(valid, "truncated", "metadata")


def test_truncated_in_tensor_index(valid):
    data = valid.read_bytes()
    cut = data.index(b"blk.1.attn_q.weight") + 25
    valid.write_bytes(data[:cut])
    expect_error(valid, "truncated", "tensor index")


def test_a_file_cut_anywhere_says_it_is_truncated_and_where(valid):
    """Cut at any byte past the magic, the file is named truncated, with the byte it ends at and the section the
    cut is in; inside a string array (the vocabulary) too, where a count still claims the whole array."""
    data = valid.read_bytes()
    tokens = data.index(b"tokenizer.ggml.tokens")
    index = data.index(b"blk.0.")                      # the first tensor name: the tensor index
    cuts = sorted({*range(4, len(data), max(1, len(data) // 97)), tokens + 40, tokens + 400, len(data) - 1})
    for cut in cuts:
        valid.write_bytes(data[:cut])
        msg = expect_error(valid, "truncated GGUF", f"the file ends at byte {cut}, inside the ")
        section = ("header" if cut < 24 else "metadata" if cut < index else
                   "tensor index" if "tensor index" in msg else "tensor data")
        assert f"inside the {section}" in msg, (cut, msg)
        if tokens + 40 <= cut <= tokens + 400:
            assert "'tokenizer.ggml.tokens'" in msg and "corrupt" not in msg, msg


def test_truncated_in_data(valid):
    data = valid.read_bytes()
    valid.write_bytes(data[:-100])
    expect_error(valid, "truncated", "blk.2.ffn_down_exps.weight", "data ends at byte")


def _model_file(tmp_path: Path, tensors: bytes, n_tensors: int, extra_kv: bytes = b"", n_extra: int = 0,
                data: int = 4096) -> Path:
    p = tmp_path / "m.gguf"
    body = header(n_tensors, 2 + n_extra) + kv("general.architecture", "llama") + kv("llama.block_count", 1) \
        + extra_kv + tensors
    body += b"\0" * ((-len(body)) % 32) + b"\0" * data
    p.write_bytes(body)
    return p


def test_unknown_tensor_type(tmp_path):
    p = _model_file(tmp_path, tensor_info("blk.0.attn_q.weight", (32, 4), type_id=77), 1)
    expect_error(p, "blk.0.attn_q.weight", "unknown ggml type id 77")


@pytest.mark.parametrize("dims", [(), (1, 1, 1, 1, 1, 1, 1)])
def test_bad_dimension_count(tmp_path, dims):
    p = _model_file(tmp_path, tensor_info("blk.0.attn_q.weight", dims), 1)
    expect_error(p, "blk.0.attn_q.weight", "dimensions")


def test_zero_dimension(tmp_path):
    p = _model_file(tmp_path, tensor_info("blk.0.attn_q.weight", (32, 0)), 1)
    expect_error(p, "blk.0.attn_q.weight", "zero")


def test_absurd_shape(tmp_path):
    p = _model_file(tmp_path, tensor_info("blk.0.attn_q.weight", (1 << 40, 1 << 40)), 1)
    expect_error(p, "blk.0.attn_q.weight", "absurd shape")


def test_row_not_multiple_of_block(tmp_path):
    p = _model_file(tmp_path, tensor_info("blk.0.attn_q.weight", (33, 2), type_id=8), 1)
    expect_error(p, "blk.0.attn_q.weight", "block size 32")


def test_duplicate_tensor(tmp_path):
    t = tensor_info("blk.0.attn_q.weight", (8,))
    p = _model_file(tmp_path, t + t, 2)
    expect_error(p, "duplicate tensor 'blk.0.attn_q.weight'")


def test_misaligned_offset(tmp_path):
    p = _model_file(tmp_path, tensor_info("blk.0.attn_q.weight", (8,), offset=3), 1)
    expect_error(p, "not aligned")


def test_overlapping_tensors(tmp_path):
    t = tensor_info("blk.0.attn_q.weight", (64,), offset=0) + tensor_info("blk.0.attn_k.weight", (64,), offset=128)
    p = _model_file(tmp_path, t, 2)
    expect_error(p, "overlaps")


def test_missing_architecture(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(p, {"general.name": "x"}, [TensorInfo("a", (8,))])
    expect_error(p, "general.architecture")


def test_missing_block_count(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(p, {"general.architecture": "llama", "llama.embedding_length": 8}, [TensorInfo("a", (8,))])
    expect_error(p, "llama.block_count")


def test_layer_beyond_block_count(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(p, {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 8},
               [TensorInfo("blk.5.attn_q.weight", (8, 8))])
    expect_error(p, "blk.5.attn_q.weight", "layer 5")


def test_per_layer_array_of_wrong_length(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(p, {"general.architecture": "llama", "llama.block_count": 3, "llama.embedding_length": 8,
                   "llama.attention.head_count_kv": [1, 2]}, [TensorInfo("a", (8,))])
    expect_error(p, "head_count_kv", "one per layer")


@pytest.mark.parametrize("make", ["empty", "text", "dir", "missing", "truncated"])
def test_cli_one_line_exit_2(tmp_path, valid, make):
    target = {"empty": tmp_path / "e.gguf", "text": tmp_path / "t.txt", "dir": tmp_path,
              "missing": tmp_path / "missing.gguf", "truncated": valid}[make]
    if make == "empty":
        target.write_bytes(b"")
    elif make == "text":
        target.write_text("hello\n")
    elif make == "truncated":
        valid.write_bytes(valid.read_bytes()[:1000])
    res = subprocess.run([sys.executable, "-m", "orchestrator", "model", str(target)], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orchestrator model: error: ") and str(target) in lines[0]
