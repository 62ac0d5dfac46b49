"""Our patch series for the pinned llama.cpp source (``native/llama.cpp-patches/``).

The patches add what the pinned source lacks and the plan drives: the expert cache (``--moe-cache-mib``). They are
written against the pinned mainline tree and applied by ``orchestrator build`` to its own extracted copy (never to
a user's tree). A tree they were applied to carries a marker file listing them, so an archive exported from it
(``build --export-source``) builds the same binary on an air-gapped machine without applying them twice.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from orchestrator.errors import BackendError

MARKER = "ORCHESTRATOR_PATCHES"      # written into a patched tree: one "<sha256>  <name>" line per patch
# the series applies to mainline llama.cpp only; ik_llama.cpp is built as it comes
FLAVORS_PATCHED = ("mainline",)


def patch_dir() -> Path:
    """Where the series lives: the package's data folder (a link to the repository's native/ in a checkout)."""
    return Path(__file__).resolve().parent.parent / "_data" / "native" / "llama.cpp-patches"


def series(flavor: str, directory: Path | None = None) -> list[Path]:
    """The patches for ``flavor``, in the order they apply (file name order)."""
    if flavor not in FLAVORS_PATCHED:
        return []
    d = directory or patch_dir()
    return sorted(d.glob("*.patch")) if d.is_dir() else []


def describe(patches: list[Path]) -> list[str]:
    """``"<sha256>  <name>"`` per patch: the marker's lines, and part of the build cache key."""
    return [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in patches]


def applied(src_root: Path) -> list[str] | None:
    """The marker's lines when ``src_root`` was patched by us, else None."""
    try:
        return (src_root / MARKER).read_text().splitlines()
    except OSError:
        return None


def _git_apply(src_root: Path, patch: Path, *, check: bool, reverse: bool = False) -> subprocess.CompletedProcess:
    git = shutil.which("git")
    if git is None:
        raise BackendError("git not found: it applies orchestrator's llama.cpp patches (apt-get install git)")
    env = dict(os.environ)
    # never let git find an enclosing repository: the paths are relative to the llama.cpp tree itself
    env["GIT_CEILING_DIRECTORIES"] = str(src_root.parent)
    argv = ([git, "apply", "-p1", "--whitespace=nowarn"] + (["--check"] if check else []) +
            (["--reverse"] if reverse else []) + [str(patch)])
    return subprocess.run(argv, cwd=src_root, env=env, capture_output=True, text=True, timeout=120)


def apply(src_root: Path, patches: list[Path], say: Callable[[str], None], *, strict: bool) -> list[str]:
    """Apply ``patches`` to ``src_root`` and write the marker; returns the applied series' description.

    ``strict``: the source is the pinned one they were written for, so a patch that does not apply is an error.
    Otherwise (a user's archive of another llama.cpp) the series is applied only if all of it applies, and
    skipped with a note if not: that source is built as it is, without the features the patches add.
    """
    if not patches:
        return []
    # a later patch applies on top of the earlier ones: check each after applying those before it, and take the
    # applied ones back when one does not apply, so the tree is either patched whole or left as it was
    done: list[Path] = []
    for p in patches:
        res = _git_apply(src_root, p, check=True)
        if res.returncode == 0:
            res = _git_apply(src_root, p, check=False)
            if res.returncode == 0:
                done.append(p)
                continue
        for q in reversed(done):
            back = _git_apply(src_root, q, check=False, reverse=True)
            if back.returncode != 0:
                raise BackendError(f"{q.name}: could not be taken back after {p.name} failed: "
                                   f"{(back.stderr or back.stdout).strip()}")
        first = (res.stderr or res.stdout).strip().splitlines()[:1]
        if strict:
            raise BackendError(f"{p.name}: does not apply to the pinned llama.cpp source ({' '.join(first)})")
        say(f"orchestrator's llama.cpp patches do not apply to this source ({p.name}: {' '.join(first)}); "
            "building it without them (no expert cache)")
        return []
    lines = describe(patches)
    (src_root / MARKER).write_text("\n".join(lines) + "\n")
    say(f"applied {len(patches)} llama.cpp patch(es): {', '.join(p.name for p in patches)}")
    return lines
