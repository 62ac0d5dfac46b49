"""Our type table (standard library only, so the reader runs without the gguf package) against gguf's."""

import gguf
import pytest

from orchestrator.model.ggml_types import GGML_TYPES, ggml_type, row_bytes


@pytest.mark.parametrize("qt", list(gguf.GGMLQuantizationType), ids=lambda q: q.name)
def test_every_mainline_type_matches_gguf(qt):
    block, size = gguf.GGML_QUANT_SIZES[qt]
    ours = GGML_TYPES[qt.value]
    assert (ours.name, ours.block, ours.size, ours.row_meta) == (qt.name, block, size, 0)


def test_lookup_by_name_and_row_sizes():
    assert ggml_type("q8_0") is ggml_type(8)
    assert row_bytes("f16", 128) == 256
    assert row_bytes("q8_0", 576) == 576 // 32 * 34
    assert row_bytes("q4_0", 4096) == 4096 // 32 * 18
    # ik_llama.cpp row-scaled type: 4 bytes of row scale before the blocks
    assert row_bytes("IQ4_KS", 7168) == 4 + 7168 // 256 * 136
    with pytest.raises(ValueError):
        ggml_type("q3_z")


def test_tensor_bytes():
    assert ggml_type("MXFP4").tensor_bytes((2880, 2880, 128)) == 2880 // 32 * 17 * 2880 * 128
    assert ggml_type("F32").tensor_bytes((7,)) == 28
