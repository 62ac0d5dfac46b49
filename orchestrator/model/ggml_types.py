"""GGML tensor types: id -> (name, elements per block, bytes per block, bytes of per-row metadata).

A plain table, so that reading a GGUF header needs nothing outside the standard library (the GPU machine's
python has no ``gguf``). ``tests/model/test_ggml_types.py`` checks every mainline entry against the ``gguf``
package's ``GGML_QUANT_SIZES``. The ids above 96 are ik_llama.cpp's own types (IQ2_K ... IQ1_KT and the
row-interleaved ``_R4``/``_R8`` variants); their block sizes were read from ik_llama.cpp's ``ggml-common.h``.
Some ik types carry a few bytes of metadata per row (a row scale) before the blocks: ``row_meta``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GgmlType:
    id: int
    name: str
    block: int        # elements per block
    size: int         # bytes per block
    row_meta: int = 0  # bytes per row before the blocks (ik_llama.cpp row-scaled types)

    def row_bytes(self, ne0: int) -> int:
        return self.row_meta + (ne0 // self.block) * self.size

    def tensor_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a contiguous tensor of this type (``ggml_nbytes``); ``shape[0]`` is the row length."""
        if not shape:
            shape = (1,)
        rows = 1
        for d in shape[1:]:
            rows *= d
        return self.row_bytes(shape[0]) * rows


_TABLE = [
    # mainline ggml (ggml/include/ggml.h)
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20), (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 40), (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210), (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74), (18, "IQ3_XXS", 256, 98), (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110), (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1), (25, "I16", 1, 2), (26, "I32", 1, 4), (27, "I64", 1, 8), (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56), (30, "BF16", 1, 2),
    (31, "Q4_0_4_4", 32, 18), (32, "Q4_0_4_8", 32, 18), (33, "Q4_0_8_8", 32, 18),  # removed from mainline files
    (34, "TQ1_0", 256, 54), (35, "TQ2_0", 256, 66), (36, "I2_S", 1, 1),
    (39, "MXFP4", 32, 17), (40, "NVFP4", 64, 36), (41, "Q1_0", 128, 18), (42, "Q2_0", 64, 18),
    # ik_llama.cpp
    (97, "Q8_0_X4", 32, 34), (98, "Q8_1_X4", 32, 40),
    (133, "Q6_0", 32, 26), (134, "IQ1_BN", 64, 13, 2), (135, "IQ2_BN", 64, 16, 4), (136, "Q8_K64", 64, 68),
    (137, "IQ2_K", 256, 76), (138, "IQ3_K", 256, 110), (139, "IQ4_K", 256, 144), (140, "IQ5_K", 256, 176),
    (141, "IQ6_K", 256, 212), (144, "IQ4_KS", 256, 136, 4), (145, "IQ2_KS", 256, 70, 2),
    (146, "IQ4_KSS", 256, 128, 4), (152, "IQ5_KS", 256, 168, 4), (153, "IQ2_KT", 256, 68, 4),
    (154, "IQ3_KT", 256, 100, 4), (155, "IQ4_KT", 256, 128, 4), (156, "IQ3_KS", 256, 102, 2),
    (157, "IQ2_KL", 256, 86, 2), (158, "IQ1_KT", 256, 56, 4),
    (202, "Q4_0_R8", 32, 18), (206, "Q5_0_R4", 32, 22), (208, "Q8_0_R8", 32, 34), (210, "Q2_K_R4", 256, 84),
    (211, "Q3_K_R4", 256, 110), (212, "Q4_K_R4", 256, 144), (213, "Q5_K_R4", 256, 176), (214, "Q6_K_R4", 256, 210),
    (216, "IQ2_XXS_R4", 256, 66), (217, "IQ2_XS_R4", 256, 74), (218, "IQ3_XXS_R4", 256, 98),
    (219, "IQ1_S_R4", 32, 6, 2), (220, "IQ4_NL_R4", 32, 18), (221, "IQ3_S_R4", 256, 110), (222, "IQ2_S_R4", 256, 82),
    (223, "IQ4_XS_R8", 256, 136), (229, "IQ1_M_R4", 32, 7, 2), (230, "BF16_R16", 1, 2), (233, "Q6_0_R4", 32, 26),
    (335, "IQ2_BN_R4", 64, 16, 4), (337, "IQ2_K_R4", 256, 76), (338, "IQ3_K_R4", 256, 110),
    (339, "IQ4_K_R4", 256, 144), (340, "IQ5_K_R4", 256, 176), (344, "IQ4_KS_R4", 256, 136, 4),
    (352, "IQ5_KS_R4", 256, 168, 4),
]

GGML_TYPES: dict[int, GgmlType] = {row[0]: GgmlType(*row) for row in _TABLE}
GGML_TYPES_BY_NAME: dict[str, GgmlType] = {t.name: t for t in GGML_TYPES.values()}


def ggml_type(name_or_id: str | int) -> GgmlType:
    """Look a type up by id or by name (case-insensitive: ``"q8_0"``, ``"Q8_0"``, ``"f16"``)."""
    if isinstance(name_or_id, int):
        return GGML_TYPES[name_or_id]
    try:
        return GGML_TYPES_BY_NAME[name_or_id.upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type {name_or_id!r}") from None


def row_bytes(type_name: str, ne0: int) -> int:
    """``ggml_row_size``: bytes of one row of ``ne0`` elements."""
    return ggml_type(type_name).row_bytes(ne0)
