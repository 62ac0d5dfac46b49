"""Find llama-server and probe what it is: flavor (mainline llama.cpp or ik_llama.cpp), version, CUDA, features.

Everything is read from the binary itself (``--version``, ``--help``, ``--list-devices``), never assumed from its
path. The result is a pure :class:`~orchestrator.backend.info.BackendInfo`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from orchestrator.backend.info import BackendInfo, parse_help
from orchestrator.errors import BackendError


def _run(argv: list[str], timeout: float = 30.0) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise BackendError(f"{argv[0]}: not found") from None
    except PermissionError:
        raise BackendError(f"{argv[0]}: not executable (check its permissions)") from None
    except subprocess.TimeoutExpired:
        raise BackendError(f"{argv[0]} {' '.join(argv[1:])}: no answer within {timeout:.0f}s") from None
    except OSError as err:
        raise BackendError(f"{argv[0]}: cannot run ({err})") from None
    return (res.stdout or "") + (res.stderr or "")


def _binary_mentions(path: str, needle: bytes) -> bool:
    """Whether the binary (statically linked: the backends are inside) contains ``needle``."""
    try:
        with open(path, "rb") as f:
            tail = b""
            for chunk in iter(lambda: f.read(1 << 22), b""):
                if needle in tail + chunk:
                    return True
                tail = chunk[-len(needle):]
    except OSError:
        return False
    return False


def detect_backend(server: str | os.PathLike) -> BackendInfo:
    """Run the binary's ``--version`` and ``--help`` and describe it."""
    path = str(server)
    if not os.path.exists(path):
        raise BackendError(f"{path}: llama-server not found")
    if os.path.isdir(path):
        raise BackendError(f"{path}: is a directory, expected the llama-server binary")
    if not os.access(path, os.X_OK):
        raise BackendError(f"{path}: not executable (chmod +x it, or point backend.binary at the right file)")
    version_text = _run([path, "--version"])
    help_text = _run([path, "--help"])
    if "--port" not in help_text and "--host" not in help_text:
        raise BackendError(f"{path}: does not look like llama-server (its --help lists no --host/--port)")
    flavor, feats, modes, gpu_offload = parse_help(help_text)
    version = ""
    m = re.search(r"^version:\s*(.+)$", version_text, re.M)
    if m:
        version = m.group(1).strip()
    built = ""
    m = re.search(r"^(built with .+)$", version_text, re.M)
    if m:
        built = m.group(1).strip()
    devices_text = _run([path, "--list-devices"])
    devices = tuple(ln.strip() for ln in devices_text.split("Available devices:", 1)[-1].splitlines()
                    if re.match(r"\s+\S+\d*:", ln))
    cuda = any(d.startswith("CUDA") for d in devices) or _binary_mentions(path, b"ggml_cuda_init")
    here = Path(path).resolve().parent
    bench = here / "llama-bench"
    fitp = here / "llama-fit-params"
    return BackendInfo(
        server=path, flavor=flavor, version=version, build_info=built, cuda=cuda, gpu_offload=gpu_offload,
        features=feats, split_modes=modes, devices=devices,
        bench=str(bench) if os.access(bench, os.X_OK) else None,
        fit_params=str(fitp) if os.access(fitp, os.X_OK) else None,
    )


def find_llama_server(explicit: str | os.PathLike | None = None, *, cache: Path | None = None,
                      flavor: str | None = None) -> tuple[str, str]:
    """Locate llama-server. Returns (path, where it came from).

    Order: ``explicit`` (topology ``backend.binary`` / ``--binary``), ``$LLAMA_SERVER``, ``PATH``, then the newest
    build in orchestrator's cache (``orchestrator build`` makes one).
    """
    if explicit and str(explicit) != "auto":
        p = os.path.expanduser(str(explicit))
        if not os.path.exists(p):
            raise BackendError(f"{p}: llama-server not found (backend.binary)")
        return p, "backend.binary"
    env = os.environ.get("LLAMA_SERVER")
    if env:
        if not os.path.exists(env):
            raise BackendError(f"$LLAMA_SERVER={env}: no such file")
        return env, "$LLAMA_SERVER"
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path, "PATH"
    from orchestrator.backend.build import cached_builds

    builds = cached_builds(cache)
    if builds:
        # the wanted flavor (mainline unless asked), then a CUDA build when this machine has NVIDIA GPUs, then newest
        has_gpu = os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia")
        want = flavor if flavor and flavor != "auto" else "mainline"
        builds.sort(key=lambda b: (b[1].get("flavor", "mainline") != want, bool(b[1].get("cuda")) != has_gpu))
        return str(builds[0][0] / "bin" / "llama-server"), f"orchestrator cache ({builds[0][0].name})"
    raise BackendError(
        "llama-server not found: set backend.binary in the topology, $LLAMA_SERVER, put it on PATH, "
        "or build one with `orchestrator build`"
    )
