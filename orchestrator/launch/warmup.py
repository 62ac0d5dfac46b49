"""The warm-up recipe for memory-mapped models (``workers.warmup: true``): drop the page cache, then read the
model once under the worker's own NUMA policy, so its pages land where the worker will read them (page cache
pages stay on the node that first read them; a cache filled by another process on another node would be read
across the interconnect for the whole life of the worker)."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Sequence

from orchestrator.errors import LaunchError


def drop_caches(path: str = "/proc/sys/vm/drop_caches") -> str:
    """sync, then drop clean page cache, dentries and inodes. Returns what happened (one line)."""
    os.sync()
    try:
        with open(path, "w") as f:
            f.write("3\n")
    except PermissionError:
        return f"cannot write {path} (needs root): page cache kept"
    except OSError as err:
        return f"cannot write {path} ({err.strerror or err}): page cache kept"
    return "page cache dropped"


def numactl_prefix(argv: Sequence[str]) -> list[str]:
    """The ``numactl ... `` part of a worker's argv (before its ``--``), or [] when it runs unbound."""
    for i, a in enumerate(argv):
        if os.path.basename(a) == "numactl":
            end = list(argv).index("--", i) if "--" in argv[i:] else i + 1
            return list(argv[i:end])
    return []


def warm(paths: Sequence[str], argv: Sequence[str], timeout: float = 3600.0) -> float:
    """Read the model files once under the NUMA policy of ``argv`` (a worker's argv); returns seconds."""
    prefix = numactl_prefix(argv)
    cmd = [*prefix, "--", "cat", *paths] if prefix else ["cat", *paths]
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LaunchError(f"warm-up of {paths[0]} failed: {err}") from None
    if res.returncode != 0:
        raise LaunchError(f"warm-up of {paths[0]} failed: {res.stderr.strip().splitlines()[-1:] or res.returncode}")
    return time.monotonic() - t0
