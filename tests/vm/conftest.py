"""The two-node guest as a fixture: ``guest(argv, timeout=...)`` boots it, runs ``argv`` inside (cwd: the
repository) and returns (status, output, seconds).

Where QEMU, virtiofsd, a static busybox or the kernel package are missing, the fixture installs them when it can
(root and apt-get: the same packages scripts/setup.sh installs) and otherwise skips with the reason; in CI
(CI=true) a missing prerequisite fails instead."""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numa_guest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"


def _unavailable(why: str):
    if IN_CI:
        pytest.fail(f"two-node guest: {why} (CI must have it: scripts/setup.sh installs "
                    f"{' '.join(numa_guest.APT_PACKAGES)})")
    pytest.skip(f"two-node guest: {why}")


@pytest.fixture(scope="session")
def guest():
    try:
        numa_guest.install()
    except numa_guest.GuestError as e:
        _unavailable(str(e))
    if lack := numa_guest.missing():
        _unavailable("missing " + "; ".join(lack))
    try:
        numa_guest.prepare()
    except numa_guest.GuestError as e:
        _unavailable(str(e))

    def run(argv, *, timeout: float = 300, **kw) -> tuple[int, str, float]:
        out = io.StringIO()
        t0 = time.monotonic()
        rc = numa_guest.run([str(a) for a in argv], timeout=timeout, cwd=str(REPO), stdout=out, **kw)
        return rc, out.getvalue(), time.monotonic() - t0

    return run
