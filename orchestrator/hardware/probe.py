"""The bandwidth probe: pinned H2D/D2H per GPU and host buffer NUMA node, host memory read bandwidth per
(CPU node, memory node) pair. Measured by small native programs (``native/``) built on demand, cached per
machine under ``<cache>/probe/<key>.json``.

- Host memory: ``native/membw.c``, built with ``cc -O3 -march=native -pthread`` into
  ``<cache>/native/membw-<hash>/``; threads pinned one per physical core of the CPU node, buffer bound to the
  memory node, sized past the last-level caches. Without a C compiler the host part is reported as unmeasured.
- GPUs: ``native/pcie_bw.cu`` built with nvcc; without nvcc the same measurement runs through libcudart via
  ctypes (``cudart_probe.py``). The host buffer is mmap'ed, mbind'ed to the node and cudaHostRegister'ed
  (``gpu_alloc="hostalloc"``: cudaHostAlloc under a bound memory policy). Without a GPU: host memory only,
  and we say so.

The cache key hashes what the numbers depend on: CPU model and layout, the NUMA nodes and what this process
may use, GPU UUIDs (PCI addresses when unknown) and the driver version. ``--refresh`` measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from orchestrator.errors import HardwareError
from orchestrator.hardware.pci import norm_pci
from orchestrator.hardware.topology import Bandwidth, FrozenMap, Machine
from orchestrator.paths import cache_dir, native_dir, pythonpath_with_package
from orchestrator.units import format_cpulist

PROBE_VERSION = 1
NATIVE_DIR = native_dir()
CACHE_SCHEMA = "orchestrator.probe/1"
GPU_BYTES = 256 << 20
GPU_REPS = 8
HOST_REPS = 5


@dataclass
class ProbeResult:
    bandwidth: Bandwidth
    cached: bool
    cache_file: Path
    records: list[dict] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)   # what was not measured and why
    failed: bool = False                                # a part that applies could not be measured
    backends: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"schema": CACHE_SCHEMA, "key": self.bandwidth.key, "measured_at": self.bandwidth.measured_at,
                "cached": self.cached, "cache_file": str(self.cache_file), "failed": self.failed,
                "backends": self.backends, "messages": self.messages,
                "bandwidth": self.bandwidth.to_json(), "records": self.records}


# ---- cache ---------------------------------------------------------------------------------------------------


def machine_key(m: Machine) -> str:
    ident = {
        "probe": PROBE_VERSION, "arch": m.arch, "cpu_model": m.cpu_model, "pus": format_cpulist(m.pus),
        "nodes": [[n.id, format_cpulist(n.cpus), n.kind] for n in m.numa_nodes],
        "allowed_cpus": format_cpulist(m.allowed_cpus), "allowed_nodes": format_cpulist(m.allowed_nodes),
        "gpus": [[g.uuid or g.pci, g.name, g.pci] for g in m.gpus], "driver": m.gpu_driver,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def cache_file(m: Machine) -> Path:
    return cache_dir() / "probe" / f"{machine_key(m)}.json"


def load_cached(m: Machine) -> ProbeResult | None:
    path = cache_file(m)
    try:
        doc = json.loads(path.read_text())
        if doc.get("schema") != CACHE_SCHEMA or doc.get("key") != machine_key(m):
            return None
        bw = Bandwidth.from_json(doc["bandwidth"], str(path))
    except (OSError, ValueError, KeyError, HardwareError):
        return None
    return ProbeResult(bandwidth=bw, cached=True, cache_file=path, records=doc.get("records", []),
                       messages=doc.get("messages", []), failed=bool(doc.get("failed")),
                       backends=doc.get("backends", {}))


def cached_bandwidth(m: Machine) -> Bandwidth | None:
    res = load_cached(m)
    return res.bandwidth if res else None


def _save(res: ProbeResult) -> None:
    path = res.cache_file
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({**res.to_json(), "cached": False}, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- building the native tools ---------------------------------------------------------------------------------


def find_cc() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def find_nvcc() -> str | None:
    cands = [os.environ.get("NVCC")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", "nvcc"))
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc"]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    return None


def _tool_version(exe: str) -> str:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.strip().splitlines()[-1] if out.strip() else "?"


def build_native(name: str, compiler: str, log: Callable[[str], None] = lambda s: None) -> Path:
    """Build ``native/<name>.c`` (cc) or ``native/<name>.cu`` (nvcc) once per source+compiler, return the binary."""
    is_cuda = name == "pcie_bw"
    src = NATIVE_DIR / (f"{name}.cu" if is_cuda else f"{name}.c")
    header = NATIVE_DIR / "probe_common.h"
    if not src.is_file() or not header.is_file():
        raise HardwareError(f"{src}: probe source not found (the native/ directory of the orchestrator checkout)")
    flags = (["-O3", "-std=c++17", "-Xcompiler", "-pthread"] if is_cuda
             else ["-O3", "-march=native", "-pthread", "-std=gnu11"])
    h = hashlib.sha256()
    for part in (src.read_bytes(), header.read_bytes(), compiler.encode(), _tool_version(compiler).encode(),
                 " ".join(flags).encode()):
        h.update(part)
    out_dir = cache_dir() / "native" / f"{name}-{h.hexdigest()[:16]}"
    exe = out_dir / name
    if os.access(exe, os.X_OK):
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{name}.{os.getpid()}.tmp"
    argv = [compiler, *flags, "-I", str(NATIVE_DIR), "-o", str(tmp), str(src)]
    log(f"building {src.name} with {os.path.basename(compiler)} ...")
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as err:
        raise HardwareError(f"cannot run {compiler} to build {src.name}: {err}") from None
    if res.returncode != 0 or not tmp.exists():
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        if tmp.exists():
            tmp.unlink()
        raise HardwareError(f"building {src.name} with {compiler} failed (exit {res.returncode}): {tail}")
    os.replace(tmp, exe)
    return exe


# ---- what to measure ---------------------------------------------------------------------------------------


def _llc_bytes_per_node(m: Machine, root: str = "/") -> dict[int, int]:
    """Sum of distinct last-level cache instances over each node's CPUs (from live sysfs)."""
    base = Path(root) / "sys/devices/system/cpu"
    seen: dict[int, set[str]] = {}
    out: dict[int, int] = {}
    for n in m.numa_nodes:
        for c in n.cpus:
            cache = base / f"cpu{c}" / "cache"
            best = None
            try:
                for idx in cache.glob("index*"):
                    level = int((idx / "level").read_text())
                    typ = (idx / "type").read_text().strip()
                    if typ == "Instruction":
                        continue
                    if best is None or level > best[0]:
                        best = (level, idx)
            except (OSError, ValueError):
                continue
            if best is None:
                continue
            try:
                shared = (best[1] / "shared_cpu_list").read_text().strip()
                size_txt = (best[1] / "size").read_text().strip()
            except OSError:
                continue
            mm = re.fullmatch(r"(\d+)([KMG]?)", size_txt)
            if not mm or shared in seen.setdefault(n.id, set()):
                continue
            seen[n.id].add(shared)
            out[n.id] = out.get(n.id, 0) + int(mm.group(1)) * {"": 1, "K": 1024, "M": 1 << 20, "G": 1 << 30}[mm.group(2)]
    return out


def host_plan(m: Machine, bytes_override: int | None = None) -> tuple[list[int], list[tuple[int, tuple[int, ...]]], int]:
    """(memory nodes, [(cpu node, one CPU per core)], buffer bytes) for the host memory probe.

    Buffers are 4x the largest per-node last-level cache (past the caches), 512 MiB to 4 GiB."""
    allowed_cpus = set(m.allowed_cpus)
    allowed_nodes = set(m.allowed_nodes)
    sets = []
    for n in m.numa_nodes:  # a CPU node's threads may read any allowed memory node, allowed itself or not
        cpus = m.physical_cpus(c for c in n.cpus if c in allowed_cpus)
        if cpus:
            sets.append((n.id, cpus))
    mem_nodes = [n.id for n in m.numa_nodes if n.id in allowed_nodes
                 and n.kind in ("cpu+memory", "memory-only") and (n.memory_bytes or 0) > 0]
    if bytes_override:
        nbytes = bytes_override
    else:
        llc = max(_llc_bytes_per_node(m).values(), default=0)
        nbytes = min(max(4 * llc, 512 << 20), 4 << 30)
        # one buffer at a time: at most a quarter of the smallest node and half of what the kernel says is
        # available (MemAvailable counts reclaimable page cache, which MemFree does not)
        limits = [m.node(n).memory_bytes // 4 for n in mem_nodes if m.node(n).memory_bytes]
        if m.memory_available_bytes:
            limits.append(m.memory_available_bytes // 2)
        if limits:
            nbytes = min(nbytes, max(64 << 20, min(limits)))
    return mem_nodes, sets, max(1 << 20, nbytes >> 20 << 20)


def gpu_nodes(m: Machine) -> list[tuple[int, tuple[int, ...]]]:
    """(node, CPUs to pin the copying thread to) for each node a host buffer may be put on."""
    allowed_cpus = tuple(m.allowed_cpus)
    out = []
    for n in m.numa_nodes:
        if n.id not in m.allowed_nodes or n.kind not in ("cpu+memory", "memory-only"):
            continue
        cpus = tuple(c for c in n.cpus if c in m.allowed_cpus) or allowed_cpus
        out.append((n.id, cpus))
    return out


# ---- running ---------------------------------------------------------------------------------------------------


def _run_lines(argv: list[str], env: dict | None, timeout: float) -> tuple[list[dict], int, str]:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [], 124, f"timed out after {timeout:.0f} s"
    except OSError as err:
        return [], 127, str(err)
    recs = []
    for line in res.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass
    return recs, res.returncode, res.stderr.strip()


def run_probe(m: Machine, *, refresh: bool = False, host: bool = True, gpu: bool = True,
              host_bytes: int | None = None, host_reps: int = HOST_REPS, gpu_bytes: int = GPU_BYTES,
              gpu_reps: int = GPU_REPS, gpu_backend: str = "auto", gpu_alloc: str = "register", save: bool = True,
              log: Callable[[str], None] = lambda s: None, cpu_prompt: Callable | None = None) -> ProbeResult:
    """Measure (or load from the cache) the bandwidths of the live machine ``m`` (``read_machine("/")``);
    ``cpu_prompt(m, records, log) -> (tokens/s, why not)``, when given, measures the CPU's prompt speed too
    (:func:`probe_cpu_prompt` with a llama-bench and the probe model: orchestrator.resolve.cpu_prompt_probe)."""
    path = cache_file(m)
    if not refresh:
        cached = load_cached(m)
        if cached is not None:
            return cached
    t0 = time.monotonic()
    records: list[dict] = []
    messages: list[str] = []
    failed = False
    backends: dict = {}
    h2d: dict = {}
    d2h: dict = {}
    hostbw: dict = {}

    if gpu:
        if not m.gpus:
            messages.append("no GPU found: measuring host memory only")
        else:
            ok, gpu_msgs = _probe_gpus(m, gpu_bytes, gpu_reps, gpu_backend, gpu_alloc, records, h2d, d2h, backends,
                                       log)
            messages += gpu_msgs
            failed |= not ok

    if host:
        mem_nodes, sets, nbytes = host_plan(m, host_bytes)
        cc = find_cc()
        if not sets or not mem_nodes:
            messages.append("no allowed NUMA node with CPUs and memory: host memory bandwidth not measured")
        elif cc is None:
            messages.append("no C compiler (cc/gcc/clang): host memory bandwidth not measured "
                            "(apt-get install gcc, then `orchestrator probe --refresh`)")
            failed = True
        else:
            try:
                exe = build_native("membw", cc, log)
            except HardwareError as err:
                messages.append(f"host memory bandwidth not measured: {err}")
                exe, failed = None, True
            if exe is not None:
                backends["host"] = f"membw ({os.path.basename(cc)})"
                argv = [str(exe), "--mem-nodes", format_cpulist(mem_nodes), "--bytes", str(nbytes),
                        "--reps", str(host_reps)]
                for node, cpus in sets:
                    argv += ["--set", f"{node}:{format_cpulist(cpus)}"]
                log(f"host memory: {len(sets)} CPU node(s) x {len(mem_nodes)} memory node(s), "
                    f"{nbytes >> 20} MiB buffers ...")
                recs, rc, err = _run_lines(argv, None, timeout=1800)
                records += recs
                ingest_host(recs, hostbw, messages)
                if rc != 0 or not hostbw:
                    messages.append(f"host memory probe failed (exit {rc}){': ' + err if err else ''}")
                    failed = True

    cpu_pp = 0.0
    if host and cpu_prompt is not None:
        cpu_pp, msg = cpu_prompt(m, records, log)
        if msg:
            messages.append(msg)
        elif cpu_pp:
            backends["cpu"] = "llama-bench (the probe's small model, one core)"
    bw = Bandwidth(gpu_h2d=FrozenMap(h2d), gpu_d2h=FrozenMap(d2h), host=FrozenMap(hostbw),
                   measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), key=machine_key(m), cpu_probe_pp=cpu_pp)
    backends["seconds"] = round(time.monotonic() - t0, 3)
    res = ProbeResult(bandwidth=bw, cached=False, cache_file=path, records=records, messages=messages,
                      failed=failed, backends=backends)
    if save and not failed:
        try:
            _save(res)
        except OSError as err:
            res.messages.append(f"cannot write the probe cache {path}: {err.strerror or err}")
    return res


# The CPU's prompt speed: the demo's model shape (synth-model --like qwen3-30b-a3b --scale 0.125 --quant q8_0, 70
# MiB), a 512-token prompt on the first physical core of the first node, the fastest of a few repetitions
# (plan/rates.py: CPU_PROBE_REFERENCE_PP is what the reference machine does there).
CPU_PROBE_SHAPE = ("qwen3-30b-a3b", 0.125, "q8_0")
CPU_PROBE_PROMPT = 512
CPU_PROBE_REPS = 3


def cpu_probe_model_path() -> Path:
    like, scale, quant = CPU_PROBE_SHAPE
    return cache_dir() / "probe" / f"cpu-probe-{like}-{scale:g}-{quant}.gguf"


def probe_cpu_prompt(m: Machine, records: list, bench: str, model: str | os.PathLike,
                     log: Callable[[str], None] = lambda s: None) -> tuple[float, str]:
    """(prompt tokens/s of ``model`` (:data:`CPU_PROBE_SHAPE`) on one core by ``bench`` (llama-bench), "" or why it
    was not measured)."""
    if not os.access(bench, os.X_OK):
        return 0.0, f"CPU prompt speed not measured: no llama-bench beside {os.path.dirname(bench)}"
    cpus = list(m.physical_cpus(m.allowed_cpus)) or list(m.allowed_cpus or m.pus)
    argv = [bench, "-m", str(model), "-t", "1", "-C", f"0x{1 << cpus[0]:x}", "--cpu-strict", "1", "-ngl", "0",
            "-fa", "on", "-ub", "512", "-p", str(CPU_PROBE_PROMPT), "-n", "0", "-r", str(CPU_PROBE_REPS),
            "-o", "jsonl"]
    log(f"CPU prompt speed: llama-bench, {CPU_PROBE_PROMPT} tokens on CPU {cpus[0]} ...")
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return 0.0, f"CPU prompt speed not measured: {e}"
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    samples = [float(v) for row in rows for v in row.get("samples_ts") or ()]
    if r.returncode != 0 or not samples:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return 0.0, f"CPU prompt speed not measured: llama-bench exit {r.returncode}: {tail}"
    records.append({"kind": "cpu_prompt", "argv": [os.path.basename(bench), *argv[1:]], "samples_ts": samples})
    return max(samples), ""


def _probe_gpus(m: Machine, nbytes: int, reps: int, backend: str, alloc: str, records: list, h2d: dict,
                d2h: dict, backends: dict, log) -> tuple[bool, list[str]]:
    msgs: list[str] = []
    nodes = gpu_nodes(m)
    if not nodes:
        return False, ["no allowed NUMA node with memory: GPU bandwidth not measured"]
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    args = ["--bytes", str(nbytes), "--reps", str(reps), "--alloc", alloc]
    for node, cpus in nodes:
        args += ["--node", f"{node}:{format_cpulist(cpus)}"]
    nvcc = find_nvcc() if backend in ("auto", "nvcc") else None
    argv = None
    if nvcc:
        try:
            argv = [str(build_native("pcie_bw", nvcc, log)), *args]
            backends["gpu"] = "pcie_bw (nvcc)"
        except HardwareError as err:
            msgs.append(f"{err}; trying libcudart through ctypes")
    if argv is None and backend in ("auto", "cudart"):
        from orchestrator.hardware import cudart_probe

        if cudart_probe.load_cudart() is None:
            return False, msgs + ["GPUs present but neither nvcc nor libcudart was found: GPU bandwidth not "
                                  "measured (install the CUDA toolkit or `pip install nvidia-cuda-runtime-cu12`)"]
        argv = [sys.executable, "-m", "orchestrator.hardware.cudart_probe", *args]
        env["PYTHONPATH"] = pythonpath_with_package(env.get("PYTHONPATH", ""))
        backends["gpu"] = "cudart_probe (ctypes)"
    if argv is None:
        return False, msgs + [f"GPU probe backend {backend!r} is not available here"]
    log(f"GPUs: {len(m.gpus)} GPU(s) x {len(nodes)} NUMA node(s), {nbytes >> 20} MiB copies ({backends['gpu']}) ...")
    recs, rc, err = _run_lines(argv, env, timeout=600)
    records += recs
    ok = ingest_gpu(m, recs, h2d, d2h, msgs)
    if rc != 0 and not ok:
        msgs.append(f"GPU probe failed (exit {rc}){': ' + err.splitlines()[-1] if err else ''}")
    return ok, msgs


def _placement_ok(r: dict, node: int, what: str, msgs: list[str]) -> bool:
    """A measurement counts for ``node`` only if its buffer is there (or the kernel would not say)."""
    placed = r.get("placed_node", -1)
    how = r.get("placement", "mbind")
    if isinstance(placed, int) and placed >= 0 and placed != node:
        msgs.append(f"{what}: the buffer meant for node {node} landed on node {placed} ({how}): not counted")
        return False
    if placed == -1:
        note = f"NUMA placement of probe buffers could not be verified (move_pages refused); placement: {how}"
        if note not in msgs:
            msgs.append(note)
    elif how == "first-touch":
        note = "mbind/set_mempolicy are not permitted here: buffers placed by first touch from the node's CPUs"
        if note not in msgs:
            msgs.append(note)
    return True


def ingest_host(recs: list[dict], hostbw: dict, msgs: list[str]) -> None:
    """membw's records → hostbw[(cpu node, memory node)] (best pass), messages for errors and misplacements."""
    for r in recs:
        if r.get("error"):
            msgs.append(f"host memory, CPUs of node {r.get('cpu_node', '?')} reading node {r.get('mem_node')}: "
                        f"{r['error']}")
        elif "best_bytes_per_s" in r:
            c, mem = int(r["cpu_node"]), int(r["mem_node"])
            if _placement_ok(r, mem, f"host memory, CPUs of node {c} reading node {mem}", msgs):
                hostbw[(c, mem)] = float(r["best_bytes_per_s"])


def ingest_gpu(m: Machine, recs: list[dict], h2d: dict, d2h: dict, msgs: list[str]) -> bool:
    """pcie_bw's records → h2d/d2h[(gpu index, node)], GPUs matched by PCI address. True if any counted."""
    by_pci = {g.pci: g.index for g in m.gpus}
    ok = False
    for r in recs:
        if r.get("error"):
            where = f" (host buffer on node {r['node']})" if "node" in r else ""
            msgs.append(f"GPU probe{where}: {r['error']}")
            continue
        if r.get("kind") != "gpu":
            continue
        gi = by_pci.get(norm_pci(str(r.get("pci", ""))), r.get("device"))
        r["gpu"] = gi
        node = int(r["node"])
        if not _placement_ok(r, node, f"GPU {gi}, host buffer on node {node}", msgs):
            continue
        h2d[(int(gi), node)] = float(r["h2d_best"])
        d2h[(int(gi), node)] = float(r["d2h_best"])
        ok = True
    return ok


def gpu_seconds(records: list[dict]) -> dict[int, float]:
    """Probe time per GPU (context set-up + all its copies), from the records."""
    out: dict[int, float] = {}
    dev_to_gpu = {r.get("device"): r.get("gpu") for r in records if r.get("kind") == "gpu"}
    for r in records:
        if r.get("kind") == "device":
            g = dev_to_gpu.get(r.get("device"), r.get("device"))
            out[g] = out.get(g, 0.0) + float(r.get("init_seconds", 0))
        elif r.get("kind") == "gpu" and "seconds" in r:
            out[r["gpu"]] = out.get(r["gpu"], 0.0) + float(r["seconds"])
    return out

