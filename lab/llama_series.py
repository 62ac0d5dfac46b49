"""The llama.cpp patch series as git commits, for maintainers who change or rebase it.

``checkout DIR`` lays the pinned llama.cpp source (the tree vendored in the ``llama-cpp-python`` sdist named in
``orchestrator/backend/sources.py``, downloaded and cached as ``orchestrator build`` does) out as a git repository at
``DIR``: branch ``upstream`` holds the pristine tree, branch ``series`` one commit per patch, in file-name order, its
message the patch's description. ``export DIR`` writes the commits ``upstream..series`` back as patch files, each the
commit's message and its diff with full upstream blob ids (``git format-patch --full-index``), so ``git apply
--3way`` can merge a patch into another llama.cpp. A commit keeps its patch's file name in a ``Patch-Name:`` line
that the export strips; a new commit without one is named after its number and subject.

usage: python -m lab.llama_series checkout DIR [--patches PATCH_DIR] [--version V]
       python -m lab.llama_series export DIR [--patches PATCH_DIR]

``--patches`` defaults to the product series (``native/llama.cpp-patches``); ``--lab`` takes the lab's set
(``lab/llama.cpp-patches``: the series as measured with the lab's features and switches) instead. ``--version`` lays out the
llama.cpp of another llama-cpp-python sdist (for a rebase: its URL and sha256 from the package index).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from orchestrator.backend import sources
from orchestrator.errors import BackendError
from orchestrator.paths import cache_dir

REPO = Path(__file__).resolve().parent.parent
PRODUCT = REPO / "native" / "llama.cpp-patches"
LAB = REPO / "lab" / "llama.cpp-patches"
NAME_LINE = "Patch-Name: "
UPSTREAM, SERIES = "upstream", "series"
_IDENT = ["-c", "user.name=llama-series", "-c", "user.email=llama-series@localhost", "-c", "commit.gpgsign=false"]


def _git(repo: Path, *args: str, input: str | None = None) -> str:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(repo.parent), GIT_AUTHOR_DATE="2000-01-01T00:00:00Z",
               GIT_COMMITTER_DATE="2000-01-01T00:00:00Z")
    res = subprocess.run(["git", *_IDENT, *args], cwd=repo, env=env, input=input, capture_output=True, text=True)
    if res.returncode != 0:
        raise BackendError(f"git {' '.join(args[:2])} in {repo}: {(res.stderr or res.stdout).strip()}")
    return res.stdout


def pinned_source(version: str | None = None) -> sources.PinnedSource:
    """The pinned mainline source, or the llama-cpp-python sdist of ``version`` (its URL and sha256 from PyPI)."""
    pin = sources.SOURCES["mainline"]
    if version is None or version == pin.version:
        return pin
    return sdist_of(version)


def sdist_of(version: str) -> sources.PinnedSource:
    """The llama-cpp-python sdist of ``version`` as the package index lists it (URL and sha256)."""
    import urllib.request

    index = "https://pypi.org/simple/llama-cpp-python/"
    try:
        req = urllib.request.Request(index, headers={"Accept": "text/html"})
        with urllib.request.urlopen(req, timeout=60) as resp:      # noqa: S310
            page = resp.read().decode()
    except OSError as err:
        raise BackendError(f"{index}: cannot read the package's files ({err})") from None
    m = re.search(r'href="(https://[^"#]*/llama_cpp_python-' + re.escape(version) + r'\.tar\.gz)#sha256=([0-9a-f]{64})"',
                  page)
    if m is None:
        raise BackendError(f"llama-cpp-python {version}: no sdist in {index}")
    pin = sources.SOURCES["mainline"]
    return replace(pin, version=version, url=m.group(1), sha256=m.group(2),
                   subdir=f"llama_cpp_python-{version}/vendor/llama.cpp")


def description(patch: Path) -> str:
    """The text above a patch's first ``diff --git`` line."""
    text = patch.read_text()
    at = text.find("diff --git ")
    return text if at < 0 else text[:at]


def lay_out(dest: Path, pin: sources.PinnedSource, say=print) -> Path:
    """``dest`` as a git repository of the pristine tree of ``pin`` on branch ``upstream``."""
    if dest.exists() and any(dest.iterdir()):
        raise BackendError(f"{dest}: exists and is not empty")
    archive = sources.fetch(pin, cache_dir(), progress=say)
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.exists() else None) as tmp:
        root = sources.extract(archive, Path(tmp), pin.subdir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(root), str(dest))
    _git(dest, "init", "-q", "-b", UPSTREAM)
    _git(dest, "add", "-A", "-f")
    _git(dest, "commit", "-q", "--no-verify", "-m",
         f"llama.cpp as vendored in {pin.package} {pin.version}\n\n{pin.url}\nsha256 {pin.sha256}")
    return dest


def move_to(repo: Path, pin: sources.PinnedSource, say=print) -> None:
    """Commit the tree of ``pin`` on top of the current one: the blobs of both stay in the repository, so a
    patch written against the first merges three-way into the second."""
    archive = sources.fetch(pin, cache_dir(), progress=say)
    with tempfile.TemporaryDirectory(dir=repo.parent) as tmp:
        root = sources.extract(archive, Path(tmp), pin.subdir)
        for child in repo.iterdir():
            if child.name != ".git":
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        for child in root.iterdir():
            shutil.move(str(child), str(repo / child.name))
    _git(repo, "add", "-A", "-f")
    _git(repo, "commit", "-q", "--no-verify", "--allow-empty", "-m",
         f"llama.cpp as vendored in {pin.package} {pin.version}\n\n{pin.url}\nsha256 {pin.sha256}")


def apply_series(repo: Path, patches: list[Path], *, three_way: bool = False) -> None:
    """One commit per patch on the current branch, the message the patch's description and its file name."""
    for n, p in enumerate(patches):
        args = ["apply", "--index", "--whitespace=nowarn"] + (["--3way"] if three_way else [])
        try:
            _git(repo, *args, str(p))
        except BackendError as err:
            unmerged = _git(repo, "diff", "--name-only", "--diff-filter=U").split()
            if not unmerged:
                raise
            raise BackendError(f"{p.name}: conflicts in {', '.join(unmerged)}, left in {repo} to resolve and commit; "
                               f"{len(patches) - n - 1} later patch(es) not applied") from err
        msg = description(p).rstrip("\n") + f"\n\n{NAME_LINE}{p.name}\n"
        _git(repo, "commit", "-q", "--no-verify", "--allow-empty", "--cleanup=verbatim", "-F", "-", input=msg)


def checkout(dest: Path, patch_dirs: list[Path], version: str | None = None, say=print) -> None:
    lay_out(dest, pinned_source(), say)
    if version is not None and version != pinned_source().version:
        move_to(dest, pinned_source(version), say)      # upstream: the pinned tree, then the other release's
    _git(dest, "checkout", "-q", "-b", SERIES)
    for d in patch_dirs:
        apply_series(dest, sorted(d.glob("*.patch")), three_way=version is not None)
    say(f"{dest}: branch {UPSTREAM} (the pinned source), {SERIES} (+{sum(len(list(d.glob('*.patch'))) for d in patch_dirs)} "
        f"commits); change it with git (commit --fixup, rebase -i), then `python -m lab.llama_series export {dest}`")


def _slug(subject: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:50] or "patch"


def export(repo: Path, out: Path, *, base: str = UPSTREAM, head: str = SERIES, say=print) -> list[Path]:
    """Write ``base..head`` as patch files into ``out`` (replacing the ``*.patch`` there); return them."""
    commits = _git(repo, "rev-list", "--reverse", "--first-parent", f"{base}..{head}").split()
    written = []
    for n, c in enumerate(commits, 1):
        msg = _git(repo, "log", "-1", "--format=%B", c)
        lines = msg.rstrip("\n").split("\n")
        names = [ln[len(NAME_LINE):].strip() for ln in lines if ln.startswith(NAME_LINE)]
        text = "\n".join(ln for ln in lines if not ln.startswith(NAME_LINE)).rstrip("\n") + "\n"
        name = names[0] if names else f"{n:04d}-{_slug(lines[0])}.patch"
        diff = _git(repo, "-c", "core.quotepath=off", "diff", "--full-index", "--binary", "--no-color",
                    "--no-ext-diff", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/", f"{c}^", c)
        if not diff:
            raise BackendError(f"commit {c[:12]} ({lines[0]}): changes nothing")
        written.append((name, text + "\n" + diff))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    paths = []
    for name, body in written:
        (out / name).write_text(body)
        paths.append(out / name)
    say(f"wrote {len(paths)} patch(es) into {out}")
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.llama_series", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    co = sub.add_parser("checkout", help="the pinned source as a git repository, the series as commits")
    co.add_argument("dir", type=Path)
    co.add_argument("--patches", type=Path, default=PRODUCT)
    co.add_argument("--lab", action="store_true", help="the lab's set instead of the product series")
    co.add_argument("--version", help="another llama-cpp-python release's llama.cpp (patches applied three-way)")
    ex = sub.add_parser("export", help="write upstream..series back as patch files")
    ex.add_argument("dir", type=Path)
    ex.add_argument("--patches", type=Path, default=PRODUCT)
    ex.add_argument("--base", default=UPSTREAM, help="the commit the patches start from (default: upstream)")
    ex.add_argument("--head", default=SERIES)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "checkout":
            checkout(a.dir.resolve(), [LAB if a.lab else a.patches], a.version)
        else:
            export(a.dir.resolve(), a.patches, base=a.base, head=a.head)
    except BackendError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
