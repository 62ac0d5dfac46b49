#!/usr/bin/env python3
"""Overwrite a llama.cpp tree with another, writing only the files whose bytes differ (their mtimes move, so an
incremental build recompiles only what they touch) and removing the files the other tree lacks.

usage: series_overlay.py NEW_TREE TREE      (prints what it wrote and removed)"""
from __future__ import annotations

import filecmp
import os
import shutil
import sys
from pathlib import Path


def files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.splitlines()[-1].strip(), file=sys.stderr)
        return 2
    new, tree = Path(sys.argv[1]), Path(sys.argv[2])
    for d in (new, tree):
        if not (d / "ggml").is_dir():
            print(f"series_overlay: {d}: not a llama.cpp tree", file=sys.stderr)
            return 1
    a, b = files(new), files(tree)
    written = removed = 0
    for rel in sorted(a):
        dst = tree / rel
        if rel in b and filecmp.cmp(new / rel, dst, shallow=False):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(new / rel, dst)
        os.utime(dst)                      # newer than the build's objects, whatever the archive said
        print(f"wrote {rel}")
        written += 1
    for rel in sorted(b - a):
        (tree / rel).unlink()
        print(f"removed {rel}")
        removed += 1
    print(f"{written} written, {removed} removed, {len(a) - written} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
