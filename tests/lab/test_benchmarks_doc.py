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


def _current_sections(doc: str) -> str:
    """docs/benchmarks.md without the sections it marks stale (a heading whose text opens with "Stale")."""
    parts = re.split(r"(?m)^(?=#{2,3} )", doc)
    return "".join(p for p in parts if not re.match(r"#{2,3} [^\n]*\n+\**Stale", p))


def test_readme_headline_numbers_are_current_rows():
    """Every ratio on the README's first screen (up to its commands) is a number of a section of
    docs/benchmarks.md that the document does not mark stale."""
    head = (REPO / "README.md").read_text().split("## Commands")[0]
    doc = DOC.read_text()
    current = _current_sections(doc)
    assert len(current) < len(doc)                   # some sections are marked stale, and are left out
    found = re.findall(r"(\d+\.\d+)(?:–(\d+\.\d+))?x", head)
    assert found
    for ratio in found:
        for r in filter(None, ratio):
            assert re.search(rf"(?<![\d.]){re.escape(r)}(?!\d)", current), \
                f"README says {r}x; no current section of docs/benchmarks.md has that number"
