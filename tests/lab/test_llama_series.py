"""The maintainers' rebase workflow (``python -m lab.llama_series checkout|export``) on the real pinned source.

``checkout`` lays the pinned llama.cpp out as git branches (the pristine tree, the series as commits), ``export``
writes the commits back: the patch files it writes are the ones in the repository, byte for byte, so the patches
in the repository are in the export's form (descriptions, full upstream blob ids). A commit added on the branch
comes back as a new patch that applies after the others.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lab import llama_series as ls
from orchestrator.backend import sources
from orchestrator.errors import BackendError
from orchestrator.paths import cache_dir


def _pinned_or_skip() -> None:
    try:
        sources.fetch(sources.SOURCES["mainline"], cache_dir(), progress=lambda s: None)
    except BackendError as err:
        pytest.skip(f"the pinned llama.cpp source cannot be had here: {err}")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("patch_dir", [ls.PRODUCT, ls.LAB], ids=["product", "lab"])
def test_checkout_then_export_gives_the_series_back(tmp_path, patch_dir):
    _pinned_or_skip()
    repo = tmp_path / "llama.cpp"
    ls.checkout(repo, [patch_dir], say=lambda s: None)
    patches = sorted(patch_dir.glob("*.patch"))
    log = _git(repo, "log", "--format=%s", f"{ls.UPSTREAM}..{ls.SERIES}").splitlines()
    assert len(log) == len(patches)
    assert log[-1] == ls.description(patches[0]).splitlines()[0]        # oldest commit = first patch

    out = tmp_path / "out"
    written = ls.export(repo, out, say=lambda s: None)
    assert [p.name for p in written] == [p.name for p in patches]
    for mine, theirs in zip(written, patches):
        assert mine.read_bytes() == theirs.read_bytes(), f"{theirs.name}: not in the export's form"
    for p in patches:
        index = [ln for ln in p.read_text().splitlines() if ln.startswith("index ")]
        assert index and all(len(ln.split()[1].split("..")[0]) == 40 for ln in index), p.name


def test_a_new_commit_comes_back_as_a_new_patch_that_applies_three_way(tmp_path):
    _pinned_or_skip()
    repo = tmp_path / "llama.cpp"
    ls.checkout(repo, [ls.PRODUCT], say=lambda s: None)
    readme = repo / "README.md"
    readme.write_text(readme.read_text() + "\nA line of our own.\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "README: a line of our own")
    written = ls.export(repo, tmp_path / "out", say=lambda s: None)
    assert written[-1].name == f"{len(written):04d}-readme-a-line-of-our-own.patch"
    assert "Patch-Name" not in written[-1].read_text()

    # onto a tree where README.md moved on: the three-way apply merges by the blob ids
    _git(repo, "checkout", "-q", "-b", "moved", ls.UPSTREAM)
    text = readme.read_text()
    readme.write_text("An upstream line.\n" + text)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "upstream moves on")
    three = subprocess.run(["git", "apply", "--3way", str(written[-1])], cwd=repo, capture_output=True, text=True)
    assert three.returncode == 0, three.stderr
    assert readme.read_text() == "An upstream line.\n" + text + "\nA line of our own.\n"
