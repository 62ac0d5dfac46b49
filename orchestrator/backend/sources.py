"""Pinned llama.cpp sources, obtained through the Python package registry.

Mainline llama.cpp is vendored in the ``llama-cpp-python`` sdist (MIT); ik_llama.cpp in the
``ik-llama-cpp-python`` sdist (MIT). Pinning the sdist by URL and sha256 makes the build reproducible;
a local archive (or an unpacked tree) can stand in for an air-gapped machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator.errors import BackendError


@dataclass(frozen=True)
class PinnedSource:
    name: str            # "mainline" | "ik_llama.cpp"
    package: str         # the PyPI package that vendors it
    version: str         # the package version
    url: str
    sha256: str
    subdir: str          # the llama.cpp tree inside the archive

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


SOURCES: dict[str, PinnedSource] = {
    "mainline": PinnedSource(
        name="mainline",
        package="llama-cpp-python",
        version="0.3.36",
        url="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
        "llama_cpp_python-0.3.36.tar.gz",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        subdir="llama_cpp_python-0.3.36/vendor/llama.cpp",
    ),
    "ik_llama.cpp": PinnedSource(
        name="ik_llama.cpp",
        package="ik-llama-cpp-python",
        version="0.1.5",
        url="https://files.pythonhosted.org/packages/3b/c1/e61bc5eb659e893bfd29305483f13c92452bc4101fc2e45e495fd71a7334/"
        "ik_llama_cpp_python-0.1.5.tar.gz",
        sha256="33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad",
        subdir="ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp",
    ),
}

# What a build needs from a llama.cpp tree; everything else (models, docs, tests, other GPU backends, the web UI
# sources) is left out of exported archives so they stay small enough to carry to an air-gapped server.
_KEEP_TOP = {"CMakeLists.txt", "cmake", "common", "include", "src", "ggml", "tools", "vendor", "licenses", "LICENSE",
             "build-info.sh", "scripts", "examples", "pocs", "ORCHESTRATOR_PATCHES"}
_DROP_GGML_BACKENDS = {"ggml-cann", "ggml-hexagon", "ggml-metal", "ggml-musa", "ggml-opencl", "ggml-openvino",
                       "ggml-sycl", "ggml-virtgpu", "ggml-vulkan", "ggml-webgpu", "ggml-zdnn", "ggml-et", "ggml-kompute",
                       "kompute"}     # ik_llama.cpp: the Kompute submodule (16 MiB) at ggml/src/kompute
# ik_llama.cpp keeps the server under examples/: its web UI sources and themes (the build embeds public*/ only)
_DROP_PATHS = {("examples", "server", "themes"), ("examples", "server", "webui"),
               ("examples", "server", "webui_llamacpp"), ("examples", "llama.android"), ("examples", "llama.swiftui")}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(src: PinnedSource, cache: Path, progress: Callable[[str], None] = print) -> Path:
    """Download ``src`` into ``cache/sources`` (once), verifying its sha256. Returns the archive path."""
    dest_dir = cache / "sources"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.filename
    if dest.exists() and sha256_file(dest) == src.sha256:
        return dest
    progress(f"downloading {src.package} {src.version} ({src.name} llama.cpp source) from PyPI ...")
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(src.url, timeout=120) as resp:  # noqa: S310
            shutil.copyfileobj(resp, out, 1 << 20)
        got = sha256_file(Path(tmp))
        if got != src.sha256:
            raise BackendError(f"{src.url}: sha256 {got} does not match the pinned {src.sha256}")
        os.replace(tmp, dest)
    except OSError as err:
        raise BackendError(
            f"cannot download {src.url} ({err}); on a machine without the package registry pass "
            f"--source with a llama.cpp source archive (make one elsewhere with `orchestrator build --export-source`)"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _is_llama_root(p: Path) -> bool:
    return (p / "CMakeLists.txt").is_file() and (p / "ggml").is_dir() and (p / "src").is_dir() and (
        (p / "src" / "llama.cpp").is_file()
    )


def find_llama_root(tree: Path) -> Path:
    """The shallowest directory under ``tree`` that is a llama.cpp source tree."""
    queue = [tree]
    for _depth in range(5):
        nxt = []
        for d in queue:
            if _is_llama_root(d):
                return d
            try:
                nxt.extend(sorted(c for c in d.iterdir() if c.is_dir() and not c.name.startswith(".")))
            except OSError:
                continue
        queue = nxt
    raise BackendError(f"{tree}: no llama.cpp source tree found (expected CMakeLists.txt, ggml/ and src/llama.cpp)")


def extract(archive: Path, dest: Path, subdir: str | None = None) -> Path:
    """Unpack ``archive`` (tar.*, zip) — only ``subdir`` when given — into ``dest``; return the llama.cpp root."""
    dest.mkdir(parents=True, exist_ok=True)
    name = archive.name
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                members = [m for m in zf.namelist() if subdir is None or m.startswith(subdir + "/")]
                zf.extractall(dest, members)
        else:
            with tarfile.open(archive) as tf:
                members = [m for m in tf.getmembers() if subdir is None or m.name.startswith(subdir + "/")]
                # the vendored tree has a `.git` file pointing into the sdist's .git/modules: skip it
                members = [m for m in members if not m.name.endswith("/.git")]
                tf.extractall(dest, members, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as err:
        raise BackendError(f"{archive}: cannot unpack ({err})") from None
    return find_llama_root(dest / subdir if subdir else dest)


def export_source(root: Path, out: Path) -> int:
    """Write a small ``.tar.xz`` of the llama.cpp tree at ``root`` holding only what a build needs.

    Returns the archive size in bytes. Writes to a temporary name and renames, so no partial file is left.
    """
    root = find_llama_root(root)
    top = out.name.split(".tar")[0] or "llama.cpp"

    def keep(rel: Path) -> bool:
        parts = rel.parts
        if not parts:
            return True
        if parts[0] not in _KEEP_TOP:
            return False
        if any(parts[:len(d)] == d for d in _DROP_PATHS):
            return False
        if parts[0] == "ggml" and len(parts) >= 3 and parts[1] == "src" and parts[2] in _DROP_GGML_BACKENDS:
            # keep the backend's CMakeLists so an `add_subdirectory` guarded by an option still configures
            return len(parts) == 4 and parts[3] == "CMakeLists.txt"
        if parts[0] == "tools" and len(parts) >= 2 and parts[1] == "ui" and len(parts) >= 3:
            # the server embeds the web UI through templates; the UI's own sources are not needed
            return len(parts) == 3 and (parts[2] == "CMakeLists.txt" or parts[2].endswith((".cmake", ".in")))
        return ".git" not in parts

    tmp = out.with_name(out.name + ".part")
    try:
        with tarfile.open(tmp, "w:xz") as tf:
            for dirpath, dirnames, filenames in os.walk(root):
                rel_dir = Path(dirpath).relative_to(root)
                dirnames[:] = [d for d in sorted(dirnames) if keep(rel_dir / d)]
                for fn in sorted(filenames):
                    rel = rel_dir / fn
                    if keep(rel):
                        tf.add(Path(dirpath) / fn, arcname=str(Path(top) / rel), recursive=False)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out.stat().st_size
