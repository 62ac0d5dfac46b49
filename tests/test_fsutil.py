"""orchestrator.fsutil.write_atomic: all or nothing, mode, and sparse extension."""

from __future__ import annotations

import os

import pytest

from orchestrator.fsutil import write_atomic


def test_replaces_whole_and_leaves_no_temp_file(tmp_path):
    p = tmp_path / "f.json"
    p.write_text("old")
    write_atomic(p, "new", mode=0o600)
    assert p.read_text() == "new" and (p.stat().st_mode & 0o777) == 0o600
    assert [x.name for x in tmp_path.iterdir()] == ["f.json"]


def test_size_makes_a_sparse_tail_of_zeros(tmp_path):
    p = tmp_path / "m.gguf"
    write_atomic(p, b"HEAD", size=1 << 30)
    st = p.stat()
    assert st.st_size == 1 << 30 and st.st_blocks * 512 < (1 << 20)     # a hole, not a gigabyte on disk
    with open(p, "rb") as f:
        assert f.read(4) == b"HEAD" and f.read(16) == b"\0" * 16


def test_a_failure_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_text("old")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write_atomic(p, "new")
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["f"]
