"""Where orchestrator keeps things on disk (cache, state). Honours XDG_CACHE_HOME / XDG_STATE_HOME."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def pythonpath_with_package(current: str | None = None) -> str:
    """A PYTHONPATH that starts with the folder holding this orchestrator package, so a child process (Ray's
    workers, the keeper, a probe, the ballast) imports this very copy, installed or not; ``current`` (default:
    this process's PYTHONPATH) follows, without that folder again."""
    root = str(REPO_ROOT)
    cur = os.environ.get("PYTHONPATH", "") if current is None else current
    return os.pathsep.join([root] + [p for p in cur.split(os.pathsep) if p and p != root])


def cache_dir() -> Path:
    """``$ORCHESTRATOR_CACHE`` or ``$XDG_CACHE_HOME/orchestrator`` or ``~/.cache/orchestrator``."""
    env = os.environ.get("ORCHESTRATOR_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orchestrator"


def state_dir() -> Path:
    """``$ORCHESTRATOR_STATE`` or ``$XDG_STATE_HOME/orchestrator`` or ``~/.local/state/orchestrator``."""
    env = os.environ.get("ORCHESTRATOR_STATE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "orchestrator"


def native_dir() -> Path:
    """Sources of the native helpers: ``native/`` of the checkout, else the copy shipped in the package."""
    repo = REPO_ROOT / "native"
    if repo.is_dir():
        return repo
    return Path(__file__).resolve().parent / "_data" / "native"
