"""orchestrator doctor: what was found and what is missing, each with the fix."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

HELP = "Check llama-server, numactl, NUMA balancing, GPUs/driver, Ray and permissions; say how to fix what is missing"


@dataclass
class Check:
    name: str
    status: str          # "ok" | "warn" | "missing"
    detail: str
    fix: str = ""
    required: bool = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--binary", help="llama-server to check (default: backend.binary / $LLAMA_SERVER / PATH / cache)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _llama_checks(binary: str | None) -> list[Check]:
    from orchestrator.backend.detect import detect_backend, find_llama_server
    from orchestrator.errors import BackendError

    try:
        path, origin = find_llama_server(binary)
        info = detect_backend(path)
    except BackendError as err:
        return [Check("llama-server", "missing", str(err),
                      "orchestrator build   (builds the pinned llama.cpp, CPU or CUDA, into the cache)", True)]
    feats = ", ".join(f for f in ("fit", "n_cpu_moe", "override_tensor", "load_mode", "sm_tensor", "sm_graph")
                      if info.has(f)) or "none of the MoE placement flags"
    out = [Check("llama-server", "ok",
                 f"{path} (from {origin}); {info.flavor} {info.version}; "
                 f"{'CUDA' if info.cuda else 'CPU-only'}; features: {feats}", required=True)]
    if info.has("expert_cache"):
        out.append(Check("expert cache", "ok", "--moe-cache-mib: GPU slots for the experts of host-resident expert "
                         "layers" + ("; --moe-cache-cpu-misses" if info.has("expert_cache_cpu_misses") else "")
                         + ("" if info.cuda else " (this build has no GPU backend: it would stay off)")))
    else:
        out.append(Check("expert cache", "warn", "this llama-server has no --moe-cache-mib: generation reads every "
                         "host-resident expert from host memory",
                         "orchestrator build   (the pinned llama.cpp with orchestrator's patches has it)"))
    rpc = Path(info.server).resolve().parent / "ggml-rpc-server"
    tools = [("llama-bench", info.bench), ("llama-fit-params", info.fit_params)]
    if not info.ik:   # ik_llama.cpp's build has no RPC server
        tools.append(("ggml-rpc-server", str(rpc) if os.access(rpc, os.X_OK) else None))
    for tool, p in tools:
        out.append(Check(tool, "ok" if p else "warn", p or "not next to llama-server",
                         "" if p else f"orchestrator build (builds all {len(tools) + 1})"))
    return out


def _numactl() -> Check:
    exe = shutil.which("numactl")
    if not exe:
        return Check("numactl", "missing", "not on PATH (workers cannot be pinned to NUMA nodes)",
                     "apt-get install numactl   (or dnf install numactl)", True)
    try:
        res = subprocess.run([exe, "--show"], capture_output=True, text=True, timeout=10)
        ok = res.returncode == 0
        detail = res.stdout.splitlines()[0] if ok and res.stdout else (res.stderr.strip() or "failed")
    except (OSError, subprocess.SubprocessError) as err:
        ok, detail = False, str(err)
    return Check("numactl", "ok" if ok else "warn", f"{exe}: {detail}",
                 "" if ok else "numactl is present but cannot query the policy (container without NUMA syscalls?)")


def _numa_balancing() -> Check:
    p = "/proc/sys/kernel/numa_balancing"
    try:
        val = open(p).read().strip()
    except OSError:
        return Check("NUMA balancing", "ok", "not present in this kernel (nothing to disable)")
    writable = os.access(p, os.W_OK)
    if val == "0":
        return Check("NUMA balancing", "ok", f"off ({p} = 0)")
    return Check("NUMA balancing", "warn" if not writable else "ok",
                 f"on ({p} = {val}); {'workers turn it off while they run' if writable else 'not writable here'}",
                 "" if writable else "run as root, or `sudo sysctl kernel.numa_balancing=0` before `orchestrator up`")


def _gpus() -> list[Check]:
    try:
        import pynvml
    except ImportError:
        return [Check("GPUs", "warn", "nvidia-ml-py is not installed", "pip install nvidia-ml-py")]
    from orchestrator.hardware.nvml import Nvml

    with Nvml(pynvml) as nv:
        if not nv.started:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return [Check("GPUs", "ok", f"no NVIDIA driver/NVML ({nv.error.__class__.__name__}): CPU-only planning")]
        if nv.error is not None:
            raise nv.error
        names = [f"{i}: {nv.name(i)} {nv.memory(i)[0] / 2**30:.0f} GiB" for i in range(nv.count())]
        out = [Check("GPUs", "ok", f"driver {nv.driver_version()}; {nv.count()} GPU(s): " + "; ".join(names))]
    from orchestrator.backend.build import find_nvcc

    nvcc = find_nvcc()
    out.append(Check("nvcc", "ok" if nvcc else "warn", nvcc or "not found: `orchestrator build` would build CPU-only",
                     "" if nvcc else "install the CUDA toolkit (nvcc) to build llama.cpp with CUDA"))
    return out


def _ray() -> Check:
    try:
        import ray
    except ImportError:
        return Check("Ray", "missing", "ray is not installed", "pip install 'ray[default]'", True)
    return Check("Ray", "ok", f"ray {ray.__version__}")


def _build_tools() -> Check:
    missing = [t for t in ("cmake", "c++") if not shutil.which(t)]
    if missing:
        return Check("build tools", "warn", f"missing {', '.join(missing)} (needed only to build llama.cpp)",
                     "apt-get install cmake ninja-build g++")
    return Check("build tools", "ok", f"cmake, c++{', ninja' if shutil.which('ninja') else ''}")


def _permissions() -> list[Check]:
    from orchestrator.paths import cache_dir

    out = []
    c = cache_dir()
    try:
        c.mkdir(parents=True, exist_ok=True)
        ok = os.access(c, os.W_OK)
    except OSError:
        ok = False
    out.append(Check("cache dir", "ok" if ok else "missing", str(c),
                     "" if ok else "set ORCHESTRATOR_CACHE or XDG_CACHE_HOME to a writable directory", True))
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    out.append(Check("locked memory limit", "ok" if unlimited or os.geteuid() == 0 else "warn",
                     "unlimited" if unlimited else f"{soft / 2**20:.0f} MiB" + (" (root: not enforced)" if os.geteuid() == 0 else ""),
                     "" if unlimited or os.geteuid() == 0 else "raise `ulimit -l` (memlock) to use --mlock"))
    try:
        import numa  # py-libnuma

        avail = bool(numa.info.numa_available())
        out.append(Check("libnuma", "ok" if avail else "warn",
                         f"py-libnuma loaded; NUMA {'available' if avail else 'not available (reading sysfs instead)'}"))
    except Exception as err:  # OSError when libnuma.so is missing
        out.append(Check("libnuma", "warn", f"py-libnuma unusable ({err}); sysfs is read instead",
                         "apt-get install libnuma1"))
    return out


def collect(binary: str | None) -> list[Check]:
    return [*_llama_checks(binary), _numactl(), _numa_balancing(), *_gpus(), _ray(), _build_tools(), *_permissions()]


def run(args: argparse.Namespace) -> int:
    checks = collect(args.binary)
    bad = [c for c in checks if c.status == "missing" and c.required]
    if args.json:
        print(json.dumps({"ok": not bad, "checks": [asdict(c) for c in checks]}, indent=1))
        return 1 if bad else 0
    mark = {"ok": "ok  ", "warn": "warn", "missing": "MISS"}
    for c in checks:
        print(f"[{mark[c.status]}] {c.name:<20} {c.detail}")
        if c.fix:
            print(f"{'':7}{'':<20} fix: {c.fix}")
    print("\n" + ("all required parts found" if not bad else f"missing: {', '.join(c.name for c in bad)}"))
    return 1 if bad else 0
