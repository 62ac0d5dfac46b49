"""Shared test fixtures.

Real parts are used wherever they exist here: the llama-server built by `orchestrator build` (scripts/setup.sh
builds it before the suite runs), numactl, Ray. A test that needs a GPU is marked `gpu` and skipped without one.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# The suite keeps the user's home as it found it: state (logs, deployments), caches (probe results, downloaded
# models, native tools) and Ray's files go to one private folder per run, for this process and every process it
# starts. Only the llama.cpp build and its downloaded source are shared with the user's cache, through links, since
# building them again would cost 15 minutes; nothing in the suite writes there (the build tests use their own cache).
# Set here, at import, so that even test modules that read a path when they are collected see the private one.
_REAL_HOME = Path(os.path.expanduser("~"))
_WATCHED = [_REAL_HOME / ".local" / "state" / "orchestrator", _REAL_HOME / ".cache" / "orchestrator", _REAL_HOME / ".ray"]
_SHARED_CACHE = ("llama.cpp", "sources")


def _private_home() -> Path:
    from orchestrator.paths import cache_dir, state_dir

    real_cache = cache_dir()
    _WATCHED.extend(p for p in (real_cache, state_dir()) if p not in _WATCHED)
    root = Path(tempfile.mkdtemp(prefix="orchestrator-tests-"))
    cache = root / "cache"
    cache.mkdir()
    for name in _SHARED_CACHE:
        if (real_cache / name).is_dir():
            (cache / name).symlink_to(real_cache / name, target_is_directory=True)
    (root / "home").mkdir()
    os.environ.update({"HOME": str(root / "home"), "ORCHESTRATOR_CACHE": str(cache),
                       "ORCHESTRATOR_STATE": str(root / "state")})
    for var in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        os.environ.pop(var, None)
    return root


def written_since(since: float, roots) -> list[Path]:
    """Files and folders under ``roots`` created or changed at or after ``since`` (the shared llama.cpp build and
    source left out: the suite only reads them)."""
    out = []
    for root in roots:
        if not root.exists():
            continue
        skip = {root / name for name in _SHARED_CACHE}
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = [d for d in dirnames if here / d not in skip]
            for name in dirnames + filenames:
                p = here / name
                try:
                    if p.lstat().st_mtime >= since:
                        out.append(p)
                except OSError:
                    continue
    return out


_STARTED = time.time() - 1.0     # mtimes are coarse on some filesystems: a second of margin, never a miss
PRIVATE_ROOT = _private_home()


@pytest.fixture(scope="session")
def private_root() -> Path:
    """The folder that holds this run's home, cache and state."""
    return PRIVATE_ROOT


@pytest.fixture(scope="session")
def home_writes():
    """The check the run ends with: ``home_writes(since, roots)`` lists what was written there since then."""
    return written_since


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if anything appeared in the user's own orchestrator or Ray folders while it ran."""
    left = written_since(_STARTED, _WATCHED)
    if left:
        shown = ", ".join(str(p) for p in sorted(left)[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"the test suite wrote under the user's home: {shown}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(PRIVATE_ROOT, ignore_errors=True)

# A test run started in the background (`bash .ci/run &`) inherits SIGINT ignored, and so would every process the
# tests start: the tests that press Ctrl-C (up in the foreground, synth-model mid-write, the NUMA wrapper) would
# see nothing happen. With a handler here, children start with the default disposition again (exec resets it).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_nvidia_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


HAS_GPU = _has_nvidia_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; the device counterpart is recorded in docs/benchmarks.md")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_server_path() -> str:
    """The real llama-server (from $LLAMA_SERVER, PATH or orchestrator's build cache). Fails, never skips:
    scripts/setup.sh builds it before the suite runs."""
    from orchestrator.backend.detect import find_llama_server

    path, _origin = find_llama_server(None)
    return path


@pytest.fixture(scope="session")
def numactl_path() -> str:
    exe = shutil.which("numactl")
    assert exe, "numactl must be installed (scripts/setup.sh installs it)"
    return exe


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    """A private ORCHESTRATOR_CACHE for tests that write to the cache."""
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
