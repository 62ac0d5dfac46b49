"""docs/benchmarks.md and its raw output: every link resolves, every raw file is cited by a row, compressed, and
the whole stays under 1 MiB; the README's headline numbers are rows of the document."""

from __future__ import annotations

import lzma
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "benchmarks.md"
RAW = REPO / "docs" / "benchmarks"


def _links() -> set[Path]:
    return {(DOC.parent / m).resolve() for m in re.findall(r"\]\(([^)#]+)\)", DOC.read_text())}


def test_every_link_resolves():
    missing = sorted(str(p.relative_to(REPO)) for p in _links() if not p.exists())
    assert not missing, missing


def test_raw_output_is_cited_compressed_and_small():
    links = _links()
    files = [p for p in RAW.rglob("*") if p.is_file()]
    assert files
    uncited = [p for p in files if p.resolve() not in links and not any(d in p.resolve().parents for d in links)]
    assert not uncited, uncited
    assert all(p.suffix == ".xz" for p in files), [p for p in files if p.suffix != ".xz"]
    for p in files:
        lzma.decompress(p.read_bytes())                       # each one is whole
    assert sum(p.stat().st_size for p in files) < 1 << 20


def test_readme_headline_numbers_are_rows():
    head = (REPO / "README.md").read_text().split("## Quick start")[0]
    doc = DOC.read_text()
    for ratio in re.findall(r"(\d+\.\d+)(?:–(\d+\.\d+))?x", head):
        for r in filter(None, ratio):
            assert r in doc, f"README says {r}x; docs/benchmarks.md has no such number"
