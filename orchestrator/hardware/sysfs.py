"""Discover a machine from Linux sysfs/procfs under a root path (``/`` or an extracted recorded dump).

The same code reads the live machine and a dump: everything goes through :class:`RootFS`. Rules (each one is
exercised by a recorded machine in ``tests/fixtures/sysfs``; see its README):

- online CPUs: ``cpu/online``, else each ``cpuN/online`` (no file = online); a PU is an online CPU with a
  ``topology/`` directory.
- cores and packages are the distinct ``core_cpus``/``thread_siblings`` and ``package_cpus``/``core_siblings``
  sets (list files, else hex masks) restricted to online CPUs; never counted by ``core_id``.
- NUMA nodes: ``node/online`` (else the ``nodeN`` directories); CPU lists restricted to online CPUs; a
  distance matrix is used only when every online node has a row with one entry per online node.
- the CPUs and nodes this process may use: the cpuset (cgroup v1, legacy cpuset fs, or cgroup v2 effective
  sets, found through ``/proc/self/cgroup`` or ``/proc/self/cpuset`` and ``/proc/mounts``) ∩ the affinity in
  ``/proc/self/status``.
- GPUs: NVML on the live machine (``nvml.py``), else PCI display/accelerator devices of NVIDIA or AMD (an
  NVIDIA device is also recognised by ``/proc/driver/nvidia/gpus/<pci>`` when its ``vendor`` file is missing).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from orchestrator.errors import HardwareError
from orchestrator.hardware.pci import PCI_DIR, pci_locality
from orchestrator.hardware.pci import norm_pci as _norm_pci
from orchestrator.hardware.rootfs import RootFS
from orchestrator.hardware.topology import (
    Core,
    FieldReader,
    Gpu,
    HugePages,
    Machine,
    NumaNode,
    Package,
    PciDevice,
)
from orchestrator.units import format_cpulist, parse_cpulist, parse_cpumask

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
NVML_RECORD = "orchestrator/nvml.json"        # what NVML said, stored in dumps saved with --save

GPU_VENDORS = {"0x10de": "nvidia", "0x1002": "amd"}
_PCIE_GEN = {"2.5": 1, "5": 2, "5.0": 2, "8": 3, "8.0": 3, "16": 4, "16.0": 4, "32": 5, "32.0": 5, "64": 6,
             "64.0": 6, "128": 7, "128.0": 7}


def read_machine(root: str | Path = "/", *, nvml: bool = True) -> Machine:
    """Read the machine under ``root``. NVML (and py-libnuma) are asked only when ``root`` is the live ``/``."""
    fs = RootFS(root)
    return read_from_fs(fs, nvml=nvml)


def read_from_fs(fs: RootFS, *, nvml: bool = True, source: str | None = None) -> Machine:
    notes: list[str] = []
    if not fs.isdir(CPU_DIR):
        raise HardwareError(f"{fs.display(CPU_DIR)} is missing: {fs.root} is not a Linux sysfs root "
                            "(expected ROOT/sys/devices/system/cpu/cpuN/topology)")

    # ---- CPUs -----------------------------------------------------------------------------------------
    cpus_in_sysfs = sorted(int(m.group(1)) for name in fs.listdir(CPU_DIR)
                           if (m := re.fullmatch(r"cpu(\d+)", name)) and fs.isdir(f"{CPU_DIR}/{name}"))
    if not cpus_in_sysfs:
        raise HardwareError(f"{fs.display(CPU_DIR)} holds no cpuN directories: cannot tell the CPUs")
    online_text = fs.read_line(f"{CPU_DIR}/online")
    if online_text is not None:
        online = set(_parse_list(online_text, fs, f"{CPU_DIR}/online", notes))
    else:
        online = set()
        for c in cpus_in_sysfs:
            flag = fs.read_line(f"{CPU_DIR}/cpu{c}/online")
            if flag is None or flag != "0":
                online.add(c)
        notes.append(f"no {CPU_DIR}/online: online CPUs taken from each cpuN/online (a CPU without one is online)")
    present = set(cpus_in_sysfs)
    pus = sorted(c for c in online & present if fs.isdir(f"{CPU_DIR}/cpu{c}/topology"))
    no_topo = sorted((online & present) - set(pus))
    if no_topo:
        notes.append(f"online CPUs {format_cpulist(no_topo)} have no topology directory: left out")
    if not pus:
        raise HardwareError(f"{fs.display(CPU_DIR)}: no online CPU with a topology directory "
                            "(expected cpuN/topology/core_cpus or thread_siblings)")
    offline_cpus = sorted(present - online)
    pu_set = set(pus)

    core_key: dict[int, frozenset[int]] = {}
    pkg_key: dict[int, frozenset[int] | None] = {}
    pkg_id: dict[int, int | None] = {}
    missing_core_sets = []
    for c in pus:
        topo = f"{CPU_DIR}/cpu{c}/topology"
        cs = _read_set(fs, topo, ("core_cpus", "thread_siblings"))
        if cs is None:
            missing_core_sets.append(c)
            cs = set()
        core_key[c] = frozenset((cs & pu_set) | {c})
        ps = _read_set(fs, topo, ("package_cpus", "core_siblings"))
        pkg_key[c] = frozenset((ps & pu_set) | {c}) if ps is not None else None
        pkg_id[c] = fs.read_int(f"{topo}/physical_package_id")
    if missing_core_sets:
        notes.append(f"CPUs {format_cpulist(missing_core_sets)} have no core_cpus/thread_siblings: "
                     "each counted as its own core")

    # packages: distinct sets (CPUs without a set are grouped by physical_package_id)
    groups: dict[object, list[int]] = {}
    for c in pus:
        key = pkg_key[c] if pkg_key[c] is not None else ("id", pkg_id[c])
        groups.setdefault(key, []).append(c)
    if any(pkg_key[c] is None for c in pus):
        notes.append("some CPUs have no package_cpus/core_siblings: grouped into packages by physical_package_id")
    pkg_cpu_lists = sorted((sorted(v) for v in groups.values()), key=lambda v: v[0])
    ids = [{pkg_id[c] for c in v} for v in pkg_cpu_lists]
    use_kernel_ids = (all(len(s) == 1 and next(iter(s)) is not None and next(iter(s)) >= 0 for s in ids)
                      and len({next(iter(s)) for s in ids}) == len(ids))
    if not use_kernel_ids and any(any(i is not None and i >= 0 for i in s) for s in ids):
        notes.append("physical_package_id disagrees with the package CPU sets: packages numbered 0..N-1")
    pkg_of_cpu: dict[int, int] = {}
    pkg_ids: list[int] = []
    for i, v in enumerate(pkg_cpu_lists):
        label = next(iter(ids[i])) if use_kernel_ids else i
        pkg_ids.append(label)
        for c in v:
            pkg_of_cpu[c] = label

    # cores: distinct sets, numbered in order of their first PU
    core_groups: dict[frozenset[int], list[int]] = {}
    for c in pus:
        core_groups.setdefault(core_key[c], []).append(c)
    core_pu_lists = sorted((sorted(v) for v in core_groups.values()), key=lambda v: v[0])

    # ---- NUMA nodes -------------------------------------------------------------------------------------
    gpu_mem_nodes = _nvidia_gpu_memory_nodes(fs)
    node_ids, node_source = _online_nodes(fs, notes)
    possible = fs.read_line(f"{NODE_DIR}/possible")
    offline_nodes: list[int] = []
    if possible is not None and node_ids is not None:
        offline_nodes = sorted(set(_parse_list(possible, fs, f"{NODE_DIR}/possible", notes)) - set(node_ids))

    node_cpus: dict[int, list[int]] = {}
    node_mem: dict[int, tuple[int | None, int | None]] = {}
    node_dist_rows: dict[int, list[int] | None] = {}
    if node_ids is None:  # no node/ directory: a UMA kernel
        notes.append(f"no {NODE_DIR}: one NUMA node 0 assumed holding every CPU, memory from /proc/meminfo")
        node_ids = [0]
        node_cpus[0] = list(pus)
        meminfo = _meminfo(fs.read("proc/meminfo"))
        node_mem[0] = (meminfo.get("MemTotal"), meminfo.get("MemFree"))
        node_dist_rows[0] = None
    else:
        seen: dict[int, int] = {}
        dup: set[int] = set()
        for nid in node_ids:
            d = f"{NODE_DIR}/node{nid}"
            if not fs.isdir(d):
                notes.append(f"node {nid} is online but {fs.display(d)} is missing: no CPUs, memory unknown")
                node_cpus[nid], node_mem[nid], node_dist_rows[nid] = [], (None, None), None
                continue
            cl = fs.read_line(f"{d}/cpulist")
            if cl is not None:
                cs = set(_parse_list(cl, fs, f"{d}/cpulist", notes))
            else:
                cm = fs.read_line(f"{d}/cpumap")
                cs = set(_parse_mask(cm, fs, f"{d}/cpumap", notes)) if cm is not None else set()
            mine = []
            for c in sorted(cs & pu_set):
                if c in seen:
                    dup.add(c)
                    continue
                seen[c] = nid
                mine.append(c)
            node_cpus[nid] = mine
            mi = fs.read(f"{d}/meminfo")
            if mi is None:
                notes.append(f"{fs.display(d + '/meminfo')} is missing: memory of node {nid} unknown")
                node_mem[nid] = (None, None)
            else:
                m = _meminfo(mi)
                node_mem[nid] = (m.get("MemTotal"), m.get("MemFree"))
            row = fs.read_line(f"{d}/distance")
            try:
                node_dist_rows[nid] = [int(x) for x in row.split()] if row is not None else None
            except ValueError:
                node_dist_rows[nid] = None
        if dup:
            notes.append(f"CPUs {format_cpulist(dup)} are listed in several NUMA nodes: kept in the first")
    orphan = sorted(pu_set - {c for v in node_cpus.values() for c in v})
    if orphan and node_source != "implicit":
        notes.append(f"online CPUs {format_cpulist(orphan)} belong to no online NUMA node")

    ordered = sorted(node_ids)
    rows_ok = all(node_dist_rows.get(n) is not None and len(node_dist_rows[n]) == len(ordered) for n in ordered)
    if not rows_ok and any(node_dist_rows.get(n) is not None for n in ordered):
        notes.append("NUMA distance rows do not have one entry per online node: distances left unknown")
    node_of_cpu = {c: nid for nid, cs in node_cpus.items() for c in cs}

    has_memory = fs.read_line(f"{NODE_DIR}/has_memory")
    has_memory_set = set(parse_cpulist(has_memory)) if has_memory and _is_list(has_memory) else None

    numa_nodes = []
    for nid in ordered:
        cs = tuple(node_cpus[nid])
        total, free = node_mem[nid]
        pkgs = tuple(sorted({pkg_of_cpu[c] for c in cs}))
        if nid in gpu_mem_nodes:
            kind = "gpu-memory"
        else:
            has_mem = (total > 0) if total is not None else (has_memory_set is None or nid in has_memory_set)
            kind = ("cpu+memory" if has_mem else "memory-less") if cs else ("memory-only" if has_mem else "empty")
        dists = tuple(zip(ordered, node_dist_rows[nid])) if rows_ok else ()
        numa_nodes.append(NumaNode(id=nid, cpus=cs, memory_bytes=total, free_bytes=free, distances=dists,
                                   packages=pkgs, kind=kind, gpu_memory_of=gpu_mem_nodes.get(nid)))

    cores = tuple(Core(index=i, package=pkg_of_cpu[v[0]], pus=tuple(v), node=node_of_cpu.get(v[0]))
                  for i, v in enumerate(core_pu_lists))
    packages = []
    for label, v in sorted(zip(pkg_ids, pkg_cpu_lists)):
        vs = set(v)
        packages.append(Package(id=label, cpus=tuple(v),
                                cores=tuple(c.index for c in cores if c.package == label),
                                nodes=tuple(n.id for n in numa_nodes if vs & set(n.cpus))))
    tpc = max(len(c.pus) for c in cores)

    # ---- what this process may use -------------------------------------------------------------------
    allowed_cpus, allowed_nodes, cgroup_desc = _allowed(fs, pus, ordered, notes)

    # ---- memory settings --------------------------------------------------------------------------------
    meminfo = _meminfo(fs.read("proc/meminfo"))
    numa_balancing = fs.read_int("proc/sys/kernel/numa_balancing") if fs.exists("proc/sys/kernel/numa_balancing") else None
    thp = None
    thp_text = fs.read_line("sys/kernel/mm/transparent_hugepage/enabled")
    if thp_text:
        m = re.search(r"\[(\w+)\]", thp_text)
        thp = m.group(1) if m else thp_text.split()[0]
    hugepages = _hugepages(fs, ordered)

    # ---- identity ---------------------------------------------------------------------------------------
    cpuinfo = fs.read("proc/cpuinfo")
    arch = fs.read_line("proc/sys/kernel/arch") or _arch_from_cpuinfo(cpuinfo)
    cpu_model = _cpu_model(cpuinfo)
    hostname = fs.read_line("proc/sys/kernel/hostname") or fs.read_line("etc/hostname")
    if not hostname:
        hostname = fs.root.name or "unknown"
        if fs.root.name == "fsroot":
            hostname = fs.root.parent.name

    # ---- PCI devices and GPUs -----------------------------------------------------------------------------
    gpus, others = _pci_gpus(fs)
    gpu_driver = None
    recorded = fs.read(NVML_RECORD)
    if recorded is not None:
        gpus, gpu_driver = _recorded_nvml(recorded, gpus, fs, notes)
    elif nvml and fs.live:
        from orchestrator.hardware import nvml as _nvml

        res = _nvml.read_gpus(fs)
        if res.note:
            notes.append(res.note)
        if res.ok:
            gpu_driver = res.driver
            extra = [g for g in gpus if g.vendor != "nvidia"]
            gpus = list(res.gpus) + [replace(g, index=len(res.gpus) + i) for i, g in enumerate(extra)]

    machine = Machine(
        hostname=hostname, arch=arch, cpu_model=cpu_model, packages=tuple(packages), cores=cores,
        pus=tuple(pus), offline_cpus=tuple(offline_cpus), numa_nodes=tuple(numa_nodes), gpus=tuple(gpus),
        allowed_cpus=tuple(allowed_cpus), allowed_nodes=tuple(allowed_nodes), smt=tpc > 1, threads_per_core=tpc,
        numa_balancing=numa_balancing, thp=thp, hugepages=hugepages,
        memory_total_bytes=meminfo.get("MemTotal"), memory_available_bytes=meminfo.get("MemAvailable"),
        bandwidth=None, offline_nodes=tuple(offline_nodes), pci_devices=tuple(others), gpu_driver=gpu_driver,
        cgroup=cgroup_desc, source=source or (f"live {fs.root}" if fs.live else f"root {fs.root}"),
        notes=(),
    )
    if fs.live:
        machine = _libnuma_check(machine, notes)
        from orchestrator.hardware.probe import cached_bandwidth  # `orchestrator probe` results, if any

        machine = replace(machine, bandwidth=cached_bandwidth(machine))
    return replace(machine, notes=tuple(dict.fromkeys(notes + fs.notes)))


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _is_list(text: str) -> bool:
    return bool(re.fullmatch(r"[0-9,\-:\s]*", text))


def _parse_list(text: str, fs: RootFS, rel: str, notes: list[str]) -> tuple[int, ...]:
    try:
        return parse_cpulist(text)
    except ValueError:
        notes.append(f"{fs.display(rel)}: expected a list like 0-3,8, got {text[:40]!r}: treated as empty")
        return ()


def _parse_mask(text: str, fs: RootFS, rel: str, notes: list[str]) -> tuple[int, ...]:
    try:
        return parse_cpumask(text)
    except ValueError:
        notes.append(f"{fs.display(rel)}: expected a hex mask, got {text[:40]!r}: treated as empty")
        return ()


def _read_set(fs: RootFS, d: str, names: tuple[str, ...]) -> set[int] | None:
    """The first of ``<name>_list`` / ``<name>`` (hex mask) that exists, for each name in order."""
    for name in names:
        text = fs.read_line(f"{d}/{name}_list")
        if text is not None:
            try:
                return set(parse_cpulist(text))
            except ValueError:
                pass
        text = fs.read_line(f"{d}/{name}")
        if text is not None:
            try:
                return set(parse_cpumask(text))
            except ValueError:
                pass
    return None


def _online_nodes(fs: RootFS, notes: list[str]) -> tuple[list[int] | None, str]:
    if not fs.isdir(NODE_DIR):
        return None, "implicit"
    text = fs.read_line(f"{NODE_DIR}/online")
    if text is not None:
        return list(_parse_list(text, fs, f"{NODE_DIR}/online", notes)), "online"
    ids = sorted(int(m.group(1)) for name in fs.listdir(NODE_DIR)
                 if (m := re.fullmatch(r"node(\d+)", name)) and fs.isdir(f"{NODE_DIR}/{name}"))
    if not ids:
        return None, "implicit"
    return ids, "dirs"


def _meminfo(text: str | None) -> dict[str, int]:
    """``/proc/meminfo`` or ``nodeN/meminfo`` → {field: bytes}."""
    out: dict[str, int] = {}
    if not text:
        return out
    for line in text.splitlines():
        m = re.match(r"^(?:Node\s+\d+\s+)?(\w+):\s+(\d+)(?:\s+kB)?", line.strip())
        if m:
            val = int(m.group(2))
            out[m.group(1)] = val * 1024 if line.rstrip().endswith("kB") else val
    return out


def _hugepages(fs: RootFS, nodes: list[int]) -> tuple[HugePages, ...]:
    out = []

    def pools(d: str, node: int | None):
        for name in fs.listdir(d):
            m = re.fullmatch(r"hugepages-(\d+)kB", name)
            if not m:
                continue
            p = f"{d}/{name}"
            out.append(HugePages(page_bytes=int(m.group(1)) * 1024, node=node,
                                 total=fs.read_int(f"{p}/nr_hugepages"), free=fs.read_int(f"{p}/free_hugepages"),
                                 surplus=fs.read_int(f"{p}/surplus_hugepages")))

    if fs.isdir("sys/kernel/mm/hugepages"):
        pools("sys/kernel/mm/hugepages", None)
    for n in nodes:
        if fs.isdir(f"{NODE_DIR}/node{n}/hugepages"):
            pools(f"{NODE_DIR}/node{n}/hugepages", n)
    return tuple(out)


def _cpuinfo_fields(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out.setdefault(k.strip().lower(), v.strip())
    return out


def _cpu_model(text: str | None) -> str | None:
    f = _cpuinfo_fields(text)
    for key in ("model name", "cpu"):
        if f.get(key):
            return f[key]
    return None


def _arch_from_cpuinfo(text: str | None) -> str:
    if not text:
        return "unknown"
    f = _cpuinfo_fields(text)
    flags = f.get("flags", "").split()
    if "vendor_id" in f or flags:
        return "x86_64" if "lm" in flags else "i686"
    if f.get("arch", "").upper() == "IA-64":
        return "ia64"
    if f.get("cpu", "").upper().startswith("POWER") or "pvr" in f.get("revision", ""):
        return "ppc64"
    if f.get("cpu architecture") == "8":
        return "aarch64"
    if "cpu architecture" in f:
        return "arm"
    if "isa" in f and "rv" in f.get("isa", ""):
        return "riscv64"
    return "unknown"


# ---- cpuset / cgroup ------------------------------------------------------------------------------------


def _allowed(fs: RootFS, pus: list[int], nodes: list[int], notes: list[str]):
    cg_cpus, cg_mems, desc = _cgroup_cpuset(fs)
    cpus = set(pus)
    mems = set(nodes)
    if cg_cpus is not None:
        cpus &= set(cg_cpus)
    if cg_mems is not None:
        mems &= set(cg_mems)
    status = fs.read("proc/self/status")
    if status:
        st = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in status.splitlines())}
        if _is_list(st.get("Cpus_allowed_list", "x")):
            cpus &= set(parse_cpulist(st["Cpus_allowed_list"]))
        if _is_list(st.get("Mems_allowed_list", "x")):
            mems &= set(parse_cpulist(st["Mems_allowed_list"]))
    if not cpus:
        notes.append("the cpuset/affinity allows no online CPU: restriction ignored")
        cpus = set(pus)
    if not mems:
        notes.append("the cpuset allows no online NUMA node: restriction ignored")
        mems = set(nodes)
    return sorted(cpus), sorted(mems), desc


def _mounts(fs: RootFS) -> list[tuple[str, str, set[str]]]:
    out = []
    for line in (fs.read("proc/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append((parts[1].replace("\\040", " "), parts[2], set(parts[3].split(","))))
    return out


def _self_cgroup(fs: RootFS) -> tuple[str | None, str | None]:
    """(cgroup v1 cpuset path, cgroup v2 path) of this process from /proc/self/cgroup."""
    v1 = v2 = None
    for line in (fs.read("proc/self/cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        if hid == "0" and ctrls == "":
            v2 = path
        elif "cpuset" in ctrls.split(","):
            v1 = path
    return v1, v2


def _cgroup_cpuset(fs: RootFS):
    """(allowed cpus or None, allowed mems or None, description) from the cpuset this process lives in."""
    v1_path, v2_path = _self_cgroup(fs)
    legacy = fs.read_line("proc/self/cpuset")
    mounts = _mounts(fs)
    cands = []
    for mnt, typ, opts in mounts:
        if typ == "cgroup" and "cpuset" in opts:
            prefix = "" if "noprefix" in opts else "cpuset."  # noprefix: the legacy cpuset file names
            cands.append(("cpuset" if "noprefix" in opts else "cgroup1", mnt, v1_path or legacy, (f"{prefix}cpus", f"{prefix}mems"), False))
    for mnt, typ, opts in mounts:
        if typ == "cpuset":
            cands.append(("cpuset", mnt, legacy or v1_path, ("cpus", "mems"), False))
    for mnt, typ, opts in mounts:
        if typ == "cgroup2":
            cands.append(("cgroup2", mnt, v2_path or legacy,
                          ("cpuset.cpus.effective", "cpuset.mems.effective"), True))
    if not mounts:  # no /proc/mounts: the standard places
        if fs.exists("sys/fs/cgroup/cgroup.controllers"):
            cands.append(("cgroup2", "/sys/fs/cgroup", v2_path or legacy,
                          ("cpuset.cpus.effective", "cpuset.mems.effective"), True))
        cands.append(("cgroup1", "/sys/fs/cgroup/cpuset", v1_path or legacy, ("cpuset.cpus", "cpuset.mems"), False))
        cands.append(("cpuset", "/dev/cpuset", legacy or v1_path, ("cpus", "mems"), False))
    for typ, mnt, path, (fcpus, fmems), walk_up in cands:
        if path is None:
            continue
        rel = "/".join(p for p in (mnt.strip("/"), path.strip("/")) if p)
        while True:
            cpus_text = fs.read_line(f"{rel}/{fcpus}")
            mems_text = fs.read_line(f"{rel}/{fmems}")
            if cpus_text is not None or mems_text is not None or not walk_up or rel == mnt.strip("/"):
                break
            rel = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if cpus_text is None and mems_text is None:
            continue
        cpus = parse_cpulist(cpus_text) if cpus_text and _is_list(cpus_text) else None
        mems = parse_cpulist(mems_text) if mems_text and _is_list(mems_text) else None
        return cpus, mems, f"{typ} {path} ({mnt})"
    return None, None, None


# ---- PCI ------------------------------------------------------------------------------------------------


def _pcie_gen(speed: str | None) -> int | None:
    if not speed:
        return None
    m = re.match(r"([\d.]+)\s*GT/s", speed)
    return _PCIE_GEN.get(m.group(1)) if m else None


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _nvidia_gpu_memory_nodes(fs: RootFS) -> dict[int, str]:
    """NUMA node -> PCI address, for GPUs whose memory the kernel exposes as a node (POWER9, Grace)."""
    out = {}
    base = "proc/driver/nvidia/gpus"
    for name in fs.listdir(base):
        text = fs.read(f"{base}/{name}/numa_status")
        if not text:
            continue
        m = re.search(r"^Node:\s*(-?\d+)", text, re.M)
        if m and int(m.group(1)) >= 0:
            out[int(m.group(1))] = _norm_pci(name)
    return out


def _pci_gpus(fs: RootFS) -> tuple[list[Gpu], list[PciDevice]]:
    gpus: list[Gpu] = []
    others: list[PciDevice] = []
    nvidia_proc = {_norm_pci(n) for n in fs.listdir("proc/driver/nvidia/gpus")}
    mem_nodes = {pci: node for node, pci in _nvidia_gpu_memory_nodes(fs).items()}
    entries = sorted(fs.listdir(PCI_DIR), key=lambda a: _pci_sort_key(_norm_pci(a)))
    for name in entries:
        d = f"{PCI_DIR}/{name}"
        cls = fs.read_line(f"{d}/class")
        if cls is None:
            continue
        cls = cls.lower()
        if not (cls.startswith("0x03") or cls.startswith("0x0b40") or cls.startswith("0x12")):
            continue
        pci = _norm_pci(name)
        vendor_id = fs.read_line(f"{d}/vendor")
        vendor_id = vendor_id.lower() if vendor_id else None
        device_id = fs.read_line(f"{d}/device")
        device_id = device_id.lower() if device_id else None
        node, local = pci_locality(fs, d)
        vendor = GPU_VENDORS.get(vendor_id or "")
        if vendor is None and vendor_id is None and pci in nvidia_proc:
            vendor = "nvidia"  # vendor file missing, but the NVIDIA driver lists the device
        if vendor and (cls.startswith("0x03") or cls.startswith("0x12")):
            gpus.append(Gpu(
                index=len(gpus), name=_sysfs_gpu_name(fs, pci, vendor, device_id), uuid=_proc_nvidia_uuid(fs, pci),
                pci=pci, vendor=vendor, numa_node=node, memory_bytes=None, memory_free_bytes=None,
                pcie_gen=_pcie_gen(fs.read_line(f"{d}/current_link_speed")),
                pcie_width=_int_or_none(fs.read_line(f"{d}/current_link_width")),
                pcie_gen_max=_pcie_gen(fs.read_line(f"{d}/max_link_speed")),
                pcie_width_max=_int_or_none(fs.read_line(f"{d}/max_link_width")),
                local_cpus=local, compute_capability=None, source="sysfs", peers=(),
                memory_node=mem_nodes.get(pci), vendor_id=vendor_id, device_id=device_id))
        else:
            others.append(PciDevice(pci=pci, pci_class=cls, vendor_id=vendor_id, device_id=device_id,
                                    numa_node=node, local_cpus=local))
    return gpus, others


def _pci_sort_key(pci: str):
    parts = re.split(r"[:.]", pci)
    try:
        return tuple(int(p, 16) for p in parts)
    except ValueError:
        return (1 << 40,)


def _proc_nvidia_info(fs: RootFS, pci: str) -> dict[str, str]:
    for name in (pci, pci.upper()):
        text = fs.read(f"proc/driver/nvidia/gpus/{name}/information")
        if text:
            return {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in text.splitlines()) if v}
    return {}


def _sysfs_gpu_name(fs: RootFS, pci: str, vendor: str, device_id: str | None) -> str:
    model = _proc_nvidia_info(fs, pci).get("model") if vendor == "nvidia" else None
    if model:
        return model
    return f"{vendor.upper()} GPU" + (f" (device {device_id})" if device_id else " (model unknown)")


def _proc_nvidia_uuid(fs: RootFS, pci: str) -> str | None:
    uuid = _proc_nvidia_info(fs, pci).get("gpu uuid")
    return uuid if uuid and not uuid.startswith("?") else None


def _recorded_nvml(text: str, sysfs_gpus: list[Gpu], fs: RootFS, notes: list[str]):
    """GPUs as NVML described them when the dump was saved (orchestrator/nvml.json)."""
    try:
        doc = json.loads(text)
        r = FieldReader(doc, fs.display(NVML_RECORD))
        gpus = []
        for e in r.items("gpus"):
            gpus.append(Gpu(
                index=e.int("index"), name=e.str("name"), uuid=e.opt_str("uuid"), pci=e.str("pci"),
                vendor=e.opt_str("vendor"), numa_node=e.int("numa_node"), memory_bytes=e.opt_int("memory_bytes"),
                memory_free_bytes=e.opt_int("memory_free_bytes"), pcie_gen=e.opt_int("pcie_gen"),
                pcie_width=e.opt_int("pcie_width"), pcie_gen_max=e.opt_int("pcie_gen_max"),
                pcie_width_max=e.opt_int("pcie_width_max"), local_cpus=e.cpus("local_cpus", default=""),
                compute_capability=e.opt_str("compute_capability"), source="nvml",
                peers=tuple((p.int("gpu"), p.str("link")) for p in e.items("peers", default=[])),
                memory_node=e.opt_int("memory_node"), vendor_id=e.opt_str("vendor_id"),
                device_id=e.opt_str("device_id")))
        return gpus, r.opt_str("driver")
    except (ValueError, HardwareError) as err:
        notes.append(f"{fs.display(NVML_RECORD)} is unreadable ({err}): GPUs read from sysfs")
        return sysfs_gpus, None


def _libnuma_check(machine: Machine, notes: list[str]) -> Machine:
    """On the live machine, ask libnuma (py-libnuma) which nodes this process may allocate from and how much
    memory each node has free right now; sysfs stays the reference when libnuma is missing or broken."""
    from orchestrator.hardware import libnuma

    info = libnuma.live_info([n.id for n in machine.numa_nodes])
    if info.error:
        notes.append(f"{info.error}: sysfs used alone" if info.error.endswith("not installed")
                     else f"py-libnuma unusable ({info.error}): sysfs used alone")
        return machine
    if not info.available:
        return machine
    changes = {}
    if info.mems_allowed is not None:
        mems = tuple(n for n in machine.allowed_nodes if n in info.mems_allowed)
        if mems and mems != machine.allowed_nodes:
            notes.append(f"libnuma allows nodes {format_cpulist(info.mems_allowed)}: allowed nodes narrowed to "
                         f"{format_cpulist(mems)}")
            changes["allowed_nodes"] = mems
    if info.free:
        changes["numa_nodes"] = tuple(
            replace(n, free_bytes=info.free.get(n.id, n.free_bytes) if n.free_bytes is None else n.free_bytes,
                    memory_bytes=n.memory_bytes if n.memory_bytes is not None else info.total.get(n.id))
            for n in machine.numa_nodes)
    return replace(machine, **changes) if changes else machine
