"""Reading the model into the page cache while Ray starts (``up``), so a cold start does not pay Ray's start-up
and the disk one after the other.

The kernel is asked to read ahead (``posix_fadvise(WILLNEED)``) 8 MiB at a time: nothing is copied into this
process, pages already cached cost nothing, and the reads run at disk speed in the background (one call for a
whole file reads only the first few MiB on Linux, hence the chunks). Where page-cache placement matters (a
memory-mapped model on a machine with several NUMA nodes: its pages stay on the node that first read them) this
is not done; ``workers.warmup`` reads the model under each worker's own NUMA policy instead.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterable, Sequence

CHUNK = 8 << 20
MAX_SHARE_OF_AVAILABLE = 0.8   # a model that would not fit the page cache next to everything else is not read ahead


def advise_files(paths: Iterable[str], stop: threading.Event | None = None, chunk: int = CHUNK) -> int:
    """Ask the kernel to read ``paths`` into the page cache, ``chunk`` bytes per call; returns the bytes asked
    for. Stops early when ``stop`` is set. Files that cannot be opened are skipped (llama-server will say why)."""
    asked = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size, chunk):
                if stop is not None and stop.is_set():
                    return asked
                os.posix_fadvise(fd, off, min(chunk, size - off), os.POSIX_FADV_WILLNEED)
                asked += min(chunk, size - off)
        finally:
            os.close(fd)
    return asked


def eligible(model_bytes: int, load_modes: Sequence[str], numa_nodes: int, available: int | None) -> tuple[bool, str]:
    """Whether to read the model ahead on this machine, and why (one line). ``load_modes``: the load modes of the
    workers that run here."""
    if not load_modes:
        return False, "no worker runs on this machine"
    if numa_nodes > 1 and any(m != "pinned" for m in load_modes):
        return False, ("a memory-mapped model on several NUMA nodes: its pages must land where the workers read "
                       "them (workers.warmup does that)")
    if available is not None and model_bytes > MAX_SHARE_OF_AVAILABLE * available:
        return False, (f"the model ({model_bytes / 2**30:.1f} GiB) is more than {MAX_SHARE_OF_AVAILABLE:.0%} of "
                       f"the available memory ({available / 2**30:.1f} GiB)")
    return True, f"reading the model ({model_bytes / 2**30:.1f} GiB) into the page cache while Ray starts"


class Prefetch:
    """:func:`advise_files` in a daemon thread; :meth:`stop` ends it early (``up`` failed or was interrupted)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        self.asked = 0
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def start(self) -> "Prefetch":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        self.asked = advise_files(self.paths, self._stop)
        self.seconds = time.monotonic() - t0

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()
