"""One GGUF writer and one table of model shapes, shared by the product, the lab and the tests.

The writer is :mod:`orchestrator.model.writer`; the shapes are :class:`orchestrator.model.shapes.ModelShape`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

from lab import calibmodels
from orchestrator.model import shapes as S

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("orchestrator", "lab", "tests", "scripts")
WRITER = "orchestrator/model/writer.py"
# Files that write deliberately malformed GGUF bytes which the writer cannot express (it writes valid files only):
# a big-endian header, counts and lengths that claim 2^60 items. They build the valid parts with the writer's
# encoders and pack only the broken field themselves.
MALFORMED = {
    "tests/model/test_bad_input.py": "big-endian header, absurd string and array lengths",
    "lab/modelbench.py": "an absurd array length, to time its rejection",
}
# GGUF's counts, lengths and offsets are uint64: a struct format with a Q packs part of the container
_PACKS_GGUF = re.compile(r"struct\.pack\(\s*f?[\"'][<>=!@]?[^\"']*Q")
_REFERENCE_WRITER = "GGUF" + "Writer"          # the gguf package's writer class


def _python_files() -> list[tuple[str, str]]:
    out = []
    for top in SCANNED:
        for p in sorted((REPO / top).rglob("*.py")):
            out.append((p.relative_to(REPO).as_posix(), p.read_text(encoding="utf-8")))
    return out


def test_nothing_else_packs_the_gguf_container():
    files = _python_files()
    assert any(rel == WRITER for rel, _ in files)
    packers = {rel for rel, text in files if _PACKS_GGUF.search(text)} - {WRITER}
    assert packers <= set(MALFORMED), f"GGUF bytes packed outside {WRITER}: {sorted(packers - set(MALFORMED))}"
    for rel in MALFORMED:     # each exception still exists and still needs to be one
        assert _PACKS_GGUF.search((REPO / rel).read_text(encoding="utf-8")), f"{rel} no longer packs GGUF bytes"


def test_the_reference_writer_is_not_used():
    users = [rel for rel, text in _python_files() if _REFERENCE_WRITER in text]
    assert users == [], f"files that use gguf's own writer: {users}"


def test_product_lab_and_tests_write_with_the_writer():
    users = ("orchestrator/model/synth.py", "lab/calibmodels.py", "tests/tiny_llama.py", "tests/bench/conftest.py",
             "tests/model/conftest.py")
    for rel in users:
        tree = ast.parse((REPO / rel).read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert "orchestrator.model.writer" in imported, rel


def test_shape_fields_are_declared_once():
    """Model hyper-parameters are declared by ModelShape (the shapes models are made of) and ModelInfo (what the
    reader finds in a file), nowhere else."""
    declaring = set()
    for rel, text in _python_files():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                fields = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign)
                          and isinstance(t.target, ast.Name)}
                if {"n_embd", "n_head_kv"} <= fields:
                    declaring.add(f"{rel}:{node.name}")
    assert declaring == {"orchestrator/model/shapes.py:ModelShape", "orchestrator/model/info.py:ModelInfo"}


def test_calibration_presets_are_the_products_shapes():
    for like, shape in calibmodels.PRESETS.items():
        assert isinstance(shape, S.ModelShape)
        if like in S.SHAPES:
            real = S.SHAPES[like]
            # gpt-oss has no dense FFN: its calibration files leave feed_forward_length out
            assert shape == (real if like != "gpt-oss-120b" else replace(real, n_ff=0)), like
