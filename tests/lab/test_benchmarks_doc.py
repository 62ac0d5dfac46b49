"""docs/benchmarks.md and its raw output: every link resolves, every raw file is cited by a row, compressed, and
the whole stays under 1 MiB; no section is stale; the README's ratios are numbers of current rows, and the
README, the key reference and the command help cite the page by its current sections."""

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


# What "stale" means on docs/benchmarks.md (its opening says the same): a section runs from a "##" or "###" heading
# to the next one and is stale when the paragraph under its heading says "stale" or that its runs "predate"
# something; a table row is stale when its first cell says "stale"; a cell that says "stale" is stale alone.
STALE = re.compile(r"\bstale\b|\bpredat", re.I)
# A citation of the page by section: docs/benchmarks.md, "The opening words of a heading" (or 'single quotes').
CITATION = re.compile(r"docs/benchmarks\.md\]?(?:\([^)]*\))?,\s+(?:\"([^\"]+)\"|'([^']+)')")
RATIO = re.compile(r"(?<![\d.])(\d+\.\d+)(?:x?–(\d+\.\d+))?x\b")


def _sections(doc: str) -> list[tuple[str, str]]:
    """(heading text, the section's text below it) of every "##" and "###" heading."""
    parts = re.split(r"(?m)^(?=#{2,3} )", doc)[1:]
    return [(p.split("\n", 1)[0].lstrip("#").strip(), p.split("\n", 1)[1] if "\n" in p else "") for p in parts]


def _section_is_stale(body: str) -> bool:
    opening = body.strip().split("\n\n", 1)[0]
    return bool(STALE.search(opening))


def _current_cells(doc: str) -> list[str]:
    """The cells of every table row of the sections that are not stale, less stale rows and stale cells."""
    cells = []
    for _heading, body in _sections(doc):
        if _section_is_stale(body):
            continue
        for line in body.splitlines():
            if not line.startswith("|") or re.match(r"\|[-| ]+\|$", line):
                continue
            row = [c.strip() for c in line.strip().strip("|").split("|")]
            if STALE.search(row[0]):
                continue
            cells += [c for c in row if not STALE.search(c)]
    return cells


def _squash(text: str) -> str:
    return " ".join(text.split())


def _citations(text: str) -> list[str]:
    return [_squash(a or b) for a, b in CITATION.findall(text)]


def _specification() -> dict[str, str]:
    """The texts that specify the tool, by name: the README, the key reference generated from the schema, and the
    help of every command."""
    from orchestrator.cli import build_parser
    from orchestrator.config.reference import reference_markdown

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    texts = {"README.md": (REPO / "README.md").read_text(), "the key reference": reference_markdown()}
    texts |= {f"orchestrator {name} --help": p.format_help() for name, p in sub.choices.items()}
    return texts


def test_the_stale_rules_recognise_a_stale_section_row_and_cell():
    doc = ("# B\n\n## Old run\n\nThese plans predate staging.\n\n| a | b |\n|---|---|\n| x | 1.11 |\n\n"
           "## New run\n\nMeasured today.\n\n| a | b | c |\n|---|---|---|\n| y | 2.22 | 3.33 (stale†) |\n"
           "| z, stale | 4.44 | 5.55 |\n")
    assert [_section_is_stale(b) for _h, b in _sections(doc)] == [True, False]
    assert _current_cells(doc) == ["a", "b", "c", "y", "2.22"]


def test_no_section_is_marked_stale():
    """One current row per claim: a section the page marks stale is measured again or removed (its history is in
    git), never kept beside the current ones."""
    stale = [h for h, body in _sections(DOC.read_text()) if _section_is_stale(body)]
    assert not stale, f"docs/benchmarks.md keeps sections it marks stale: {stale}"


def test_readme_ratios_are_numbers_of_current_rows():
    """Every ratio the README gives (1.36x, or both ends of 1.05–1.36x) is a number in a current cell of
    docs/benchmarks.md: not in a stale section, a stale row or a cell marked stale."""
    readme = (REPO / "README.md").read_text()
    cells = " | ".join(_current_cells(DOC.read_text()))
    found = [r for pair in RATIO.findall(readme) for r in pair if r]
    assert len(found) >= 8, found                  # the results paragraph gives its ratios
    for r in found:
        assert re.search(rf"(?<![\d.]){re.escape(r)}(?!\d)", cells), \
            f"README says {r}x; no current row of docs/benchmarks.md has that number"


def test_citations_name_current_sections():
    """Where the README, the key reference or a command's help cites docs/benchmarks.md by section, the section
    exists (its heading opens with the cited words) and is not stale."""
    sections = [(_squash(h), _section_is_stale(body)) for h, body in _sections(DOC.read_text())]
    cited = {name: _citations(text) for name, text in _specification().items()}
    assert sum(map(len, cited.values())) >= 10, cited
    for name, names in cited.items():
        for c in names:
            hits = [stale for h, stale in sections if h.startswith(c)]
            assert hits, f"{name} cites docs/benchmarks.md, {c!r}: no section's heading opens with it"
            assert not any(hits), f"{name} cites docs/benchmarks.md, {c!r}, a section marked stale"


# A figure measured on one machine: a decimal ratio, a speed in tokens/s, a time in microseconds, or what happened
# "on the H200" (the example topology of that machine may be named).
MACHINE_FIGURE = re.compile(r"\bon (?:the|an?) H200\b|\d\.\d+x\b|\d\s*(?:t/s|tokens/s)|\d\s*µs")


def test_the_key_reference_and_the_help_carry_no_machine_figures():
    """The specification says what the tool does; what a machine measured lives in docs/benchmarks.md, which the
    specification cites by section."""
    spec = _specification()
    del spec["README.md"]
    found = {name: MACHINE_FIGURE.findall(text) for name, text in spec.items()}
    assert not any(found.values()), {k: v for k, v in found.items() if v}
