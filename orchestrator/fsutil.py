"""Small file helpers shared by the commands that write results and state."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int | None = None,
                 size: int | None = None) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename: readers see the old
    file or the new one, never half of one, and a failure leaves no partial file. ``mode`` defaults to what a
    plain ``open`` would create (0o666 less the umask). ``size``: extend the file to this length with a hole
    (a sparse file: the rest reads as zeros and takes no disk)."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if size is not None:
                f.truncate(size)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
