"""Read files under a root path (``/`` or an extracted dump) and remember exactly what was read.

Every reader goes through :class:`RootFS`, so ``orchestrator inspect --save`` can record the files that
discovery used (like ``hwloc-gather-topology``) and a recorded machine is read exactly like the live one.
Paths are relative to the root ("sys/devices/system/cpu/online"). Nothing here raises on a missing or
unreadable file: it returns None and, for unreadable files, keeps a note saying so.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class RootFS:
    def __init__(self, root: str | os.PathLike = "/"):
        self.root = Path(root)
        self.files: dict[str, bytes] = {}     # path -> content, for every file read successfully
        self.dirs: set[str] = set()           # every directory seen to exist
        self.notes: list[str] = []

    @property
    def live(self) -> bool:
        try:
            return self.root.resolve() == Path("/")
        except OSError:
            return False

    def _p(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def _note_error(self, rel: str, err: OSError) -> None:
        if err.errno in (errno.EACCES, errno.EPERM):
            self.notes.append(f"cannot read {self.display(rel)} (permission denied): treated as missing")
        elif err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENODEV, errno.EINVAL,
                               errno.ENXIO, errno.EIO, errno.ELOOP):
            self.notes.append(f"cannot read {self.display(rel)} ({os.strerror(err.errno or 0)}): treated as missing")

    def display(self, rel: str) -> str:
        return str(self._p(rel))

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            # O_NONBLOCK: a FIFO planted in a dump must not hang discovery (harmless for sysfs/procfs files)
            fd = os.open(self._p(rel), os.O_RDONLY | os.O_NONBLOCK)
            with open(fd, "rb", buffering=0) as f:
                # small reads: /proc/sys answers ENOMEM to a read() asking for megabytes
                chunks, size = [], 0
                while size < (16 << 20):
                    chunk = f.read(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                data = b"".join(chunks)
        except OSError as err:
            self._note_error(rel, err)
            return None
        self.files[rel.lstrip("/")] = data
        self._record_parents(rel)
        return data

    def read(self, rel: str) -> str | None:
        """The file's text, or None when it is missing or unreadable."""
        data = self.read_bytes(rel)
        # some recorded files end in NUL bytes (hwloc's dumps): they are never meaningful in sysfs text
        return None if data is None else data.decode("utf-8", "replace").replace("\x00", "")

    def read_line(self, rel: str) -> str | None:
        text = self.read(rel)
        return None if text is None else text.strip()

    def read_int(self, rel: str) -> int | None:
        text = self.read_line(rel)
        if text is None:
            return None
        try:
            return int(text, 0) if text.lower().startswith("0x") else int(text)
        except ValueError:
            self.notes.append(f"{self.display(rel)}: expected an integer, got {text[:40]!r}: treated as unknown")
            return None

    def isdir(self, rel: str) -> bool:
        try:
            ok = self._p(rel).is_dir()
        except OSError:
            return False
        if ok:
            self.dirs.add(rel.strip("/"))
            self._record_parents(rel)
        return ok

    def exists(self, rel: str) -> bool:
        """True for a file or directory; a dangling symlink does not exist."""
        p = self._p(rel)
        try:
            if p.is_dir():
                self.dirs.add(rel.strip("/"))
                self._record_parents(rel)
                return True
            return p.exists()
        except OSError:
            return False

    def listdir(self, rel: str) -> list[str]:
        """Sorted entry names of a directory ([] when missing). Entries are not recorded until used."""
        try:
            names = sorted(os.listdir(self._p(rel)))
        except OSError as err:
            self._note_error(rel, err)
            return []
        self.dirs.add(rel.strip("/"))
        self._record_parents(rel)
        return names

    def _record_parents(self, rel: str) -> None:
        parts = rel.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            self.dirs.add("/".join(parts[:i]))
