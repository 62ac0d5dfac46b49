"""Wrapping a llama-server argv in the NUMA scripts: ``disable-numa-balancing.sh numactl ... -- llama-server ...``.

Where the scripts are: ``scripts/numa/`` of the repository checkout (:data:`orchestrator.paths.REPO_ROOT`, which is
what an editable or source install runs from); when that folder is absent (a wheel install), the copy shipped
as package data in ``orchestrator/_data/numa/``. Nothing else is searched: a missing script is a
:class:`LaunchError` that names both places.

An argv is built on one machine (the planner's) and may run on another Ray node where the package lives under
another path: :func:`localize_argv` swaps a wrapper path that does not exist there for the local one, and
``launch.process.start`` applies it before running anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from orchestrator.errors import LaunchError
from orchestrator.paths import REPO_ROOT

BALANCING_SCRIPT = "disable-numa-balancing.sh"
BIND_SOCKET_SCRIPT = "numactl-bind-socket.sh"
SCRIPTS = (BALANCING_SCRIPT, BIND_SOCKET_SCRIPT)


def _candidates() -> list[Path]:
    from importlib import resources   # here, not at import: the planner imports this package

    dirs = [REPO_ROOT / "scripts" / "numa"]
    try:
        data = resources.files("orchestrator") / "_data" / "numa"
        dirs.append(Path(str(data)))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - orchestrator is always importable here
        pass
    return dirs


def scripts_dir() -> Path:
    """The folder holding both NUMA scripts (repo checkout first, then package data)."""
    tried = _candidates()
    for d in tried:
        if all((d / name).is_file() for name in SCRIPTS):
            return d
    raise LaunchError(f"cannot find {BALANCING_SCRIPT} and {BIND_SOCKET_SCRIPT}: looked in "
                      + " and ".join(str(d) for d in tried) + " (reinstall orchestrator)")


def script_path(name: str) -> str:
    """Absolute path of one NUMA script (``disable-numa-balancing.sh`` or ``numactl-bind-socket.sh``)."""
    if name not in SCRIPTS:
        raise ValueError(f"unknown NUMA script {name!r}; expected one of {SCRIPTS}")
    return str(scripts_dir() / name)


def wrap(argv: Sequence[str], *, disable_numa_balancing: bool, numactl: Sequence[str]) -> tuple[str, ...]:
    """``argv`` (llama-server and its flags) under the wrappers the plan asks for.

    ``numactl`` is a :func:`orchestrator.launch.numa.numactl_argv` prefix (``[]`` for none); a ``--`` ends its
    options so the server's own flags are never read as numactl's. The balancing wrapper, when asked, goes
    first, so NUMA balancing is off before numactl places the first page.
    """
    argv = [str(a) for a in argv]
    if not argv:
        raise ValueError("wrap() needs a command (llama-server and its flags)")
    out: list[str] = []
    if disable_numa_balancing:
        out.append(script_path(BALANCING_SCRIPT))
    if numactl:
        out.extend(str(a) for a in numactl)
        out.append("--")
    out.extend(argv)
    return tuple(out)


def localize_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """Replace a NUMA-script path in ``argv`` that does not exist on this machine by this machine's copy.

    Only whole arguments whose file name is one of the two scripts and whose folder ends in ``scripts/numa`` (a
    checkout) or ``_data/numa`` (the package data of an installed wheel) are touched; everything else is returned
    unchanged.
    """
    out = []
    for arg in argv:
        p = Path(arg)
        if (p.name in SCRIPTS and p.parent.name == "numa" and p.parent.parent.name in ("scripts", "_data")
                and not os.path.isfile(arg)):
            out.append(script_path(p.name))
        else:
            out.append(arg)
    return tuple(out)
