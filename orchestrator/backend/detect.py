"""Find llama-server and read what it is: flavor (mainline llama.cpp or ik_llama.cpp), version, CUDA, features.

Everything is read from the binary itself (``--version``, ``--help``), never assumed from its path.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import BackendError


@dataclass(frozen=True)
class BackendInfo:
    """What a llama-server binary is and can do. Pure data: the planner reads it."""

    server: str                                 # path to llama-server
    flavor: str = "mainline"                    # "mainline" | "ik_llama.cpp"
    version: str = ""                           # e.g. "0 (0c1e570)"; build number and commit when known
    build_info: str = ""                        # "built with ... for ..."
    cuda: bool = False                          # built with the CUDA backend
    gpu_offload: bool = False                   # -ngl is offered (a GPU backend is compiled in)
    features: frozenset[str] = field(default_factory=frozenset)
    split_modes: tuple[str, ...] = ()           # values -sm accepts, as --help lists them
    devices: tuple[str, ...] = ()               # `--list-devices` lines, e.g. "CUDA0: NVIDIA H200 (143156 MiB, ...)"
    bench: str | None = None                    # llama-bench next to it, if any
    fit_params: str | None = None               # llama-fit-params next to it, if any

    def has(self, feature: str) -> bool:
        return feature in self.features

    def to_dict(self) -> dict:
        return {
            "server": self.server, "flavor": self.flavor, "version": self.version, "build_info": self.build_info,
            "cuda": self.cuda, "gpu_offload": self.gpu_offload, "features": sorted(self.features),
            "split_modes": list(self.split_modes), "devices": list(self.devices), "bench": self.bench, "fit_params": self.fit_params,
        }


# feature name -> regex on --help text
_FEATURES = {
    "fit": r"(^|\s)--fit\b",
    "fit_target": r"--fit-target\b",
    "fit_margin": r"--fit-margin\b",
    "n_cpu_moe": r"--n-cpu-moe\b",
    "cpu_moe": r"--cpu-moe\b",
    "override_tensor": r"--override-tensor\b",
    "load_mode": r"--load-mode\b",
    "no_mmap": r"--no-mmap\b",
    "mlock": r"--mlock\b",
    "numa": r"--numa\b",
    "flash_attn": r"--flash-attn\b",
    "metrics": r"--metrics\b",
    "no_host": r"--no-host\b",
    "cpu_range": r"--cpu-range\b",
    "threads_batch": r"--threads-batch\b",
    "mla": r"--mla-use\b",
    "merge_qkv": r"--merge-qkv\b",
    "attn_max_batch": r"--attention-max-batch\b",
    "graph_reuse": r"--graph-reuse\b",
    "split_mode_graph_scheduling": r"--split-mode-graph-scheduling\b",
    "cuda_params": r"--cuda-params\b",
    "offload_policy": r"--offload-policy\b",
    "no_op_offload": r"--no-op-offload\b",
    "moe_cache": r"--moe-cache-mib\b",
    "kv_unified": r"--kv-unified\b",
}


def parse_help(help_text: str) -> tuple[str, frozenset[str], tuple[str, ...], bool]:
    """(flavor, features, split modes, gpu_offload) from ``llama-server --help`` output."""
    feats = {name for name, rx in _FEATURES.items() if re.search(rx, help_text, re.M)}
    modes: list[str] = []
    m = re.search(r"--split-mode\s+\{([a-z,]+)\}", help_text)
    if m:
        modes = m.group(1).split(",")
    else:  # ik_llama.cpp lists the modes as "  - graph: ..." lines under -sm
        block = re.search(r"--split-mode[^\n]*\n((?:\s+.*\n){1,12})", help_text)
        if block:
            modes = re.findall(r"^\s+-\s+([a-z]+)(?:\s*\(default\))?\s*:", block.group(1), re.M)
    gpu_offload = bool(re.search(r"--gpu-layers\b|--n-gpu-layers\b", help_text))
    ik_markers = {"mla", "merge_qkv", "attn_max_batch", "graph_reuse", "cuda_params", "split_mode_graph_scheduling"}
    flavor = "ik_llama.cpp" if (feats & ik_markers or "graph" in modes) else "mainline"
    if flavor == "ik_llama.cpp":
        feats.add("override_tensor")  # ik_llama.cpp's parser takes -ot/--override-tensor; its --help omits it
    for mode in modes:
        feats.add(f"sm_{mode}")
    return flavor, frozenset(feats), tuple(modes), gpu_offload


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
