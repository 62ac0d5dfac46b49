"""What a machine is, in hwloc's vocabulary: Machine ⊃ Package (socket) ⊃ Core ⊃ PU; NUMA nodes as memory.

Pure and frozen: no I/O here. The readers (``sysfs.py``, ``nvml.py``, ``dump.py``) build these objects from a
root path, a recorded dump or a JSON document; the planner only reads them.

Conventions:
- CPU numbers are the kernel's (OS index); a *PU* is an online logical CPU.
- ``Core.index`` is the logical core number (0..N-1 in order of each core's first PU); ``Package.id`` is the
  kernel's ``physical_package_id`` when it is consistent, else 0..N-1 (see ``docs/hardware.md``).
- NUMA node ids are the kernel's and may be sparse (0, 8, 250-255): index by id, never by position.
- Unknown stays unknown: ``None`` (or ``-1`` for a GPU's ``numa_node``), never a guess.
- Sizes are bytes, bandwidths bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Mapping

from orchestrator.errors import HardwareError
from orchestrator.units import format_cpulist, parse_cpulist

SCHEMA = "orchestrator.machine/1"

NODE_KINDS = ("cpu+memory", "memory-only", "memory-less", "gpu-memory", "empty")


class FrozenMap(Mapping):
    """An immutable, hashable mapping (``bw.gpu_h2d[(0, 1)]``), so frozen dataclasses holding it stay hashable."""

    __slots__ = ("_d", "_h")

    def __init__(self, items: Mapping | Iterable[tuple[Any, Any]] = ()):
        self._d = dict(items.items() if isinstance(items, Mapping) else items)
        self._h: int | None = None

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self) -> Iterator:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        if self._h is None:
            self._h = hash(frozenset(self._d.items()))
        return self._h

    def __eq__(self, other) -> bool:
        if isinstance(other, Mapping):
            return dict(self._d) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._d!r})"


# ----------------------------------------------------------------------------------------------------------------
# Parts


@dataclass(frozen=True)
class NumaNode:
    """A NUMA node: memory, plus the online CPUs closest to it (none for CXL/HBM/NVM/GPU-memory nodes)."""

    id: int
    cpus: tuple[int, ...]                       # online CPUs of the node (cpulist/cpumap ∩ online)
    memory_bytes: int | None                    # MemTotal of the node; None = unknown
    free_bytes: int | None                      # MemFree of the node when read; None = unknown
    distances: tuple[tuple[int, int], ...]      # (node id, distance) incl. itself; () = unknown
    packages: tuple[int, ...]                   # packages holding some of its CPUs
    kind: str                                   # one of NODE_KINDS
    gpu_memory_of: str | None = None            # PCI address of the GPU whose memory this node is

    def distance_to(self, other_id: int) -> int | None:
        for nid, dist in self.distances:
            if nid == other_id:
                return dist
        return None

    @property
    def has_cpus(self) -> bool:
        return bool(self.cpus)


@dataclass(frozen=True)
class Core:
    """A physical core: its PUs (hardware threads) share its execution units."""

    index: int                                  # logical core number, 0..N-1 in order of first PU
    package: int                                # Package.id
    pus: tuple[int, ...]                        # online CPUs of the core
    node: int | None                            # NUMA node of its first PU; None = in no node


@dataclass(frozen=True)
class Package:
    """A socket (hwloc: Package)."""

    id: int
    cpus: tuple[int, ...]                       # online CPUs
    cores: tuple[int, ...]                      # Core.index of its cores
    nodes: tuple[int, ...]                      # NUMA nodes holding some of its CPUs


@dataclass(frozen=True)
class PciDevice:
    """A display, co-processor or accelerator PCI device that is not counted as a GPU (BMC VGA, Xeon Phi ...)."""

    pci: str                                    # domain:bus:dev.fn, lower case
    pci_class: str | None                       # "0x030000"
    vendor_id: str | None                       # "0x1a03"; None when the file is missing
    device_id: str | None
    numa_node: int                              # -1 = unknown
    local_cpus: tuple[int, ...]


@dataclass(frozen=True)
class Gpu:
    """A GPU, from NVML (``source="nvml"``) or from sysfs PCI (``source="sysfs"``, fewer facts)."""

    index: int                                  # NVML index (= PCI bus order); sysfs: PCI address order
    name: str
    uuid: str | None
    pci: str                                    # domain:bus:dev.fn, lower case, 4+ hex digit domain
    vendor: str | None                          # "nvidia" | "amd" | None (unknown)
    numa_node: int                              # from sysfs numa_node; -1 = unknown
    memory_bytes: int | None
    memory_free_bytes: int | None
    pcie_gen: int | None                        # current link generation (a GPU at idle may train down)
    pcie_width: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    local_cpus: tuple[int, ...]                 # sysfs local_cpus (else local_cpulist); () = unknown
    compute_capability: str | None              # "9.0"
    source: str                                 # "nvml" | "sysfs"
    peers: tuple[tuple[int, str], ...] = ()     # (other gpu index, "nvlink" | "pcie-p2p")
    memory_node: int | None = None              # NUMA node exposing this GPU's memory (POWER9/Grace), if any
    vendor_id: str | None = None                # PCI vendor id "0x10de"
    device_id: str | None = None                # PCI device id "0x2335"

    def link_to(self, other_index: int) -> str | None:
        for idx, link in self.peers:
            if idx == other_index:
                return link
        return None


@dataclass(frozen=True)
class HugePages:
    """One explicit huge page pool: system-wide (``node=None``) or per NUMA node."""

    page_bytes: int
    node: int | None
    total: int | None
    free: int | None
    surplus: int | None = None


@dataclass(frozen=True)
class Bandwidth:
    """Measured bandwidths (``orchestrator probe``), bytes per second.

    ``gpu_h2d[(gpu, node)]``: pinned host→device copies with the host buffer on NUMA node ``node``;
    ``gpu_d2h`` the other way; ``host[(cpu_node, mem_node)]``: threads pinned on the CPUs of ``cpu_node``
    reading memory bound to ``mem_node``. ``cpu_probe_pp``: prompt tokens/s of the probe's small model on one
    core (llama-bench; 0: not measured), the machine's CPU speed for prompts. ``key`` identifies the machine the
    numbers belong to.
    """

    gpu_h2d: FrozenMap = field(default_factory=FrozenMap)
    gpu_d2h: FrozenMap = field(default_factory=FrozenMap)
    host: FrozenMap = field(default_factory=FrozenMap)
    measured_at: str = ""
    key: str = ""
    cpu_probe_pp: float = 0.0

    def __post_init__(self):
        for name in ("gpu_h2d", "gpu_d2h", "host"):
            val = getattr(self, name)
            if not isinstance(val, FrozenMap):
                object.__setattr__(self, name, FrozenMap(val))

    def best_node_for_gpu(self, gpu_index: int) -> int | None:
        """The NUMA node whose host buffers gave the highest H2D bandwidth to this GPU (None if unmeasured)."""
        cands = [(bw, -node) for (g, node), bw in self.gpu_h2d.items() if g == gpu_index]
        return -max(cands)[1] if cands else None

    def to_json(self) -> dict:
        return {
            "gpu_h2d": [{"gpu": g, "node": n, "bytes_per_s": v} for (g, n), v in sorted(self.gpu_h2d.items())],
            "gpu_d2h": [{"gpu": g, "node": n, "bytes_per_s": v} for (g, n), v in sorted(self.gpu_d2h.items())],
            "host": [{"cpu_node": c, "mem_node": m, "bytes_per_s": v} for (c, m), v in sorted(self.host.items())],
            "measured_at": self.measured_at,
            "key": self.key,
            **({"cpu_probe_pp": self.cpu_probe_pp} if self.cpu_probe_pp else {}),
        }

    @classmethod
    def from_json(cls, doc: Mapping, where: str = "bandwidth") -> "Bandwidth":
        r = FieldReader(doc, where)
        return cls(
            gpu_h2d=FrozenMap(((e.int("gpu"), e.int("node")), e.float("bytes_per_s"))
                              for e in r.items("gpu_h2d", default=[])),
            gpu_d2h=FrozenMap(((e.int("gpu"), e.int("node")), e.float("bytes_per_s"))
                              for e in r.items("gpu_d2h", default=[])),
            host=FrozenMap(((e.int("cpu_node"), e.int("mem_node")), e.float("bytes_per_s"))
                           for e in r.items("host", default=[])),
            measured_at=str(r.get("measured_at", default="")),
            key=str(r.get("key", default="")),
            cpu_probe_pp=float(r.get("cpu_probe_pp", default=0.0) or 0.0),
        )


# ----------------------------------------------------------------------------------------------------------------
# The machine


@dataclass(frozen=True)
class Machine:
    hostname: str
    arch: str
    cpu_model: str | None
    packages: tuple[Package, ...]
    cores: tuple[Core, ...]
    pus: tuple[int, ...]                        # online CPUs (with a topology directory)
    offline_cpus: tuple[int, ...]
    numa_nodes: tuple[NumaNode, ...]            # online nodes, sorted by id
    gpus: tuple[Gpu, ...]
    allowed_cpus: tuple[int, ...]               # PUs this process may run on (cgroup cpuset ∩ affinity)
    allowed_nodes: tuple[int, ...]              # nodes this process may allocate from (cpuset mems)
    smt: bool
    threads_per_core: int
    numa_balancing: int | None                  # /proc/sys/kernel/numa_balancing; None = not in this kernel
    thp: str | None                             # transparent huge pages mode: always | madvise | never
    hugepages: tuple[HugePages, ...]
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    bandwidth: Bandwidth | None = None
    # additions to the planner's contract
    offline_nodes: tuple[int, ...] = ()
    pci_devices: tuple[PciDevice, ...] = ()     # display/accelerator PCI devices that are not GPUs
    gpu_driver: str | None = None
    cgroup: str | None = None                   # the cpuset restricting this process, for display
    source: str = ""                            # "live /", "root DIR", "dump FILE", "json FILE"
    notes: tuple[str, ...] = ()                 # what was missing and what was assumed

    # -- lookups ---------------------------------------------------------------------------------------------
    def node(self, id: int) -> NumaNode:
        for n in self.numa_nodes:
            if n.id == id:
                return n
        raise KeyError(f"no NUMA node {id} (nodes: {format_cpulist(n.id for n in self.numa_nodes) or 'none'})")

    def package(self, id: int) -> Package:
        for p in self.packages:
            if p.id == id:
                return p
        raise KeyError(f"no package {id} (packages: {', '.join(str(p.id) for p in self.packages) or 'none'})")

    def core(self, index: int) -> Core:
        for c in self.cores:
            if c.index == index:
                return c
        raise KeyError(f"no core {index}")

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU {index}")

    def cores_of_node(self, id: int) -> tuple[Core, ...]:
        return tuple(c for c in self.cores if c.node == id)

    def cores_of_package(self, id: int) -> tuple[Core, ...]:
        return tuple(c for c in self.cores if c.package == id)

    def node_of_cpu(self, cpu: int) -> int | None:
        for n in self.numa_nodes:
            if cpu in n.cpus:
                return n.id
        return None

    def physical_cpus(self, cpus: Iterable[int]) -> tuple[int, ...]:
        """One PU per core among ``cpus`` (the lowest), in core order: where to put one thread per core."""
        wanted = set(cpus)
        out = []
        for c in self.cores:
            mine = [p for p in c.pus if p in wanted]
            if mine:
                out.append(min(mine))
        return tuple(out)

    def nearest_cpu_node(self, gpu: Gpu) -> int | None:
        """The NUMA node (with CPUs) closest to ``gpu``: its ``numa_node``, else the node its ``local_cpus``
        fall in, else None (unknown)."""
        ids = {n.id for n in self.numa_nodes}
        if gpu.numa_node >= 0 and gpu.numa_node in ids and self.node(gpu.numa_node).cpus:
            return gpu.numa_node
        nodes = self.nodes_of_cpus(gpu.local_cpus)
        if len(nodes) == 1:
            return nodes[0]
        cpu_nodes = [n.id for n in self.numa_nodes if n.cpus]
        if len(cpu_nodes) == 1:
            return cpu_nodes[0]
        return None

    def nodes_of_cpus(self, cpus: Iterable[int]) -> tuple[int, ...]:
        """NUMA nodes holding some of ``cpus``; () when ``cpus`` is empty or covers every online CPU (no locality)."""
        cpus = set(cpus) & set(self.pus)
        if not cpus or cpus == set(self.pus):
            return ()
        return tuple(n.id for n in self.numa_nodes if cpus & set(n.cpus))

    @property
    def cpu_nodes(self) -> tuple[NumaNode, ...]:
        return tuple(n for n in self.numa_nodes if n.cpus)

    @property
    def restricted(self) -> bool:
        """True when a cgroup/cpuset or affinity keeps this process off some PUs or nodes."""
        return self.allowed_cpus != self.pus or self.allowed_nodes != tuple(n.id for n in self.numa_nodes)

    def summary(self) -> dict:
        return {"packages": len(self.packages), "numa_nodes": len(self.numa_nodes), "cores": len(self.cores),
                "pus": len(self.pus), "gpus": len(self.gpus)}

    # -- the view this process may use --------------------------------------------------------------------
    def allowed_view(self) -> "Machine":
        """The machine as this process may use it: only allowed PUs (and their cores and packages) and
        allowed NUMA nodes (their CPUs restricted to allowed PUs). Core indexes and ids are kept."""
        cpus = set(self.allowed_cpus)
        nodes_ok = set(self.allowed_nodes)
        cores = tuple(replace(c, pus=tuple(p for p in c.pus if p in cpus),
                              node=c.node if c.node in nodes_ok else None)
                      for c in self.cores if cpus & set(c.pus))
        numa_nodes = []
        for n in self.numa_nodes:
            if n.id not in nodes_ok:
                continue
            ncpus = tuple(p for p in n.cpus if p in cpus)
            pkgs = tuple(p.id for p in self.packages if set(p.cpus) & set(ncpus))
            numa_nodes.append(replace(n, cpus=ncpus, packages=pkgs))
        packages = []
        for p in self.packages:
            pcpus = tuple(c for c in p.cpus if c in cpus)
            if not pcpus:
                continue
            packages.append(replace(p, cpus=pcpus, cores=tuple(c.index for c in cores if c.package == p.id),
                                    nodes=tuple(n.id for n in numa_nodes if set(n.cpus) & set(pcpus))))
        tpc = max((len(c.pus) for c in cores), default=0)
        return replace(self, packages=tuple(packages), cores=cores, pus=tuple(sorted(cpus & set(self.pus))),
                       numa_nodes=tuple(numa_nodes), allowed_cpus=tuple(sorted(cpus & set(self.pus))),
                       allowed_nodes=tuple(n.id for n in numa_nodes), smt=tpc > 1, threads_per_core=tpc)

    def with_bandwidth(self, bandwidth: Bandwidth | None) -> "Machine":
        return replace(self, bandwidth=bandwidth)

    # -- JSON ----------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The documented ``orchestrator inspect --json`` document (docs/hardware.md)."""
        return {
            "schema": SCHEMA,
            "source": self.source,
            "hostname": self.hostname,
            "arch": self.arch,
            "cpu_model": self.cpu_model,
            "summary": self.summary(),
            "smt": self.smt,
            "threads_per_core": self.threads_per_core,
            "pus": format_cpulist(self.pus),
            "offline_cpus": format_cpulist(self.offline_cpus),
            "allowed_cpus": format_cpulist(self.allowed_cpus),
            "allowed_nodes": format_cpulist(self.allowed_nodes),
            "cgroup": self.cgroup,
            "packages": [{"id": p.id, "cpus": format_cpulist(p.cpus), "cores": format_cpulist(p.cores),
                          "nodes": list(p.nodes)} for p in self.packages],
            "cores": [{"index": c.index, "package": c.package, "pus": format_cpulist(c.pus), "node": c.node}
                      for c in self.cores],
            "numa_nodes": [{"id": n.id, "kind": n.kind, "cpus": format_cpulist(n.cpus),
                            "memory_bytes": n.memory_bytes, "free_bytes": n.free_bytes,
                            "packages": list(n.packages),
                            "distances": {str(k): v for k, v in n.distances},
                            "gpu_memory_of": n.gpu_memory_of} for n in self.numa_nodes],
            "offline_nodes": format_cpulist(self.offline_nodes),
            "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid, "pci": g.pci, "vendor": g.vendor,
                      "vendor_id": g.vendor_id, "device_id": g.device_id,
                      "numa_node": g.numa_node, "nearest_cpu_node": self.nearest_cpu_node(g),
                      "memory_bytes": g.memory_bytes, "memory_free_bytes": g.memory_free_bytes,
                      "pcie_gen": g.pcie_gen, "pcie_width": g.pcie_width,
                      "pcie_gen_max": g.pcie_gen_max, "pcie_width_max": g.pcie_width_max,
                      "local_cpus": format_cpulist(g.local_cpus), "compute_capability": g.compute_capability,
                      "memory_node": g.memory_node, "source": g.source,
                      "peers": [{"gpu": i, "link": link} for i, link in g.peers]} for g in self.gpus],
            "gpu_driver": self.gpu_driver,
            "pci_devices": [{"pci": d.pci, "class": d.pci_class, "vendor_id": d.vendor_id,
                             "device_id": d.device_id, "numa_node": d.numa_node,
                             "local_cpus": format_cpulist(d.local_cpus)} for d in self.pci_devices],
            "numa_balancing": self.numa_balancing,
            "thp": self.thp,
            "hugepages": [{"page_bytes": h.page_bytes, "node": h.node, "total": h.total, "free": h.free,
                           "surplus": h.surplus} for h in self.hugepages],
            "memory_total_bytes": self.memory_total_bytes,
            "memory_available_bytes": self.memory_available_bytes,
            "bandwidth": self.bandwidth.to_json() if self.bandwidth else None,
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, doc: Mapping, where: str = "machine") -> "Machine":
        """Inverse of :meth:`to_json`. A malformed document raises HardwareError naming the field."""
        r = FieldReader(doc, where)
        schema = r.get("schema")
        if schema != SCHEMA:
            raise HardwareError(f"{where}: field 'schema' is {schema!r}, expected {SCHEMA!r} "
                                "(an `orchestrator inspect --json` document)")
        numa_nodes = tuple(
            NumaNode(id=e.int("id"), cpus=e.cpus("cpus"), memory_bytes=e.opt_int("memory_bytes"),
                     free_bytes=e.opt_int("free_bytes"),
                     distances=e.distances("distances"),
                     packages=e.ints("packages"), kind=e.choice("kind", NODE_KINDS),
                     gpu_memory_of=e.opt_str("gpu_memory_of"))
            for e in r.items("numa_nodes"))
        gpus = tuple(
            Gpu(index=e.int("index"), name=e.str("name"), uuid=e.opt_str("uuid"), pci=e.str("pci"),
                vendor=e.opt_str("vendor"), numa_node=e.int("numa_node"), memory_bytes=e.opt_int("memory_bytes"),
                memory_free_bytes=e.opt_int("memory_free_bytes"), pcie_gen=e.opt_int("pcie_gen"),
                pcie_width=e.opt_int("pcie_width"), pcie_gen_max=e.opt_int("pcie_gen_max"),
                pcie_width_max=e.opt_int("pcie_width_max"), local_cpus=e.cpus("local_cpus", default=""),
                compute_capability=e.opt_str("compute_capability"), source=e.choice("source", ("nvml", "sysfs", "described")),
                peers=tuple((p.int("gpu"), p.str("link")) for p in e.items("peers", default=[])),
                memory_node=e.opt_int("memory_node"), vendor_id=e.opt_str("vendor_id"),
                device_id=e.opt_str("device_id"))
            for e in r.items("gpus"))
        bw = r.get("bandwidth", default=None)
        return cls(
            hostname=r.str("hostname"), arch=r.str("arch"), cpu_model=r.opt_str("cpu_model"),
            packages=tuple(Package(id=e.int("id"), cpus=e.cpus("cpus"), cores=e.cpus("cores"), nodes=e.ints("nodes"))
                           for e in r.items("packages")),
            cores=tuple(Core(index=e.int("index"), package=e.int("package"), pus=e.cpus("pus"),
                             node=e.opt_int("node")) for e in r.items("cores")),
            pus=r.cpus("pus"), offline_cpus=r.cpus("offline_cpus", default=""),
            numa_nodes=numa_nodes, gpus=gpus,
            allowed_cpus=r.cpus("allowed_cpus"), allowed_nodes=r.cpus("allowed_nodes"),
            smt=r.bool("smt"), threads_per_core=r.int("threads_per_core"),
            numa_balancing=r.opt_int("numa_balancing"), thp=r.opt_str("thp"),
            hugepages=tuple(HugePages(page_bytes=e.int("page_bytes"), node=e.opt_int("node"), total=e.opt_int("total"),
                                      free=e.opt_int("free"), surplus=e.opt_int("surplus"))
                            for e in r.items("hugepages", default=[])),
            memory_total_bytes=r.opt_int("memory_total_bytes"),
            memory_available_bytes=r.opt_int("memory_available_bytes"),
            bandwidth=Bandwidth.from_json(bw, f"{where}: bandwidth") if bw else None,
            offline_nodes=r.cpus("offline_nodes", default=""),
            pci_devices=tuple(PciDevice(pci=e.str("pci"), pci_class=e.opt_str("class"), vendor_id=e.opt_str("vendor_id"),
                                        device_id=e.opt_str("device_id"), numa_node=e.int("numa_node"),
                                        local_cpus=e.cpus("local_cpus", default=""))
                              for e in r.items("pci_devices", default=[])),
            gpu_driver=r.opt_str("gpu_driver"), cgroup=r.opt_str("cgroup"),
            source=str(r.get("source", default="")), notes=tuple(str(x) for x in r.list("notes", default=[])),
        )


# ----------------------------------------------------------------------------------------------------------------
# JSON field access with errors that name the field


_MISSING = object()


class FieldReader:
    def __init__(self, doc: Any, where: str):
        if not isinstance(doc, Mapping):
            raise HardwareError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        self.doc, self.where = doc, where

    def _err(self, key: str, expected: str, val: Any) -> HardwareError:
        return HardwareError(f"{self.where}: field '{key}' must be {expected}, got {val!r}")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.doc:
            if default is _MISSING:
                raise HardwareError(f"{self.where}: missing field '{key}'")
            return default
        return self.doc[key]

    def int(self, key: str) -> int:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._err(key, "an integer", v)
        return v

    def opt_int(self, key: str) -> int | None:
        v = self.get(key, default=None)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._err(key, "an integer or null", v)
        return v

    def float(self, key: str) -> float:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._err(key, "a number", v)
        return float(v)

    def distances(self, key: str) -> tuple[tuple[int, int], ...]:
        v = self.dict(key)
        try:
            out = tuple(sorted((int(k), int(d)) for k, d in v.items()))
        except (TypeError, ValueError):
            raise self._err(key, 'an object like {"0": 10, "1": 21}', v) from None
        return out

    def bool(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            raise self._err(key, "true or false", v)
        return v

    def str(self, key: str) -> str:
        v = self.get(key)
        if not isinstance(v, str):
            raise self._err(key, "a string", v)
        return v

    def opt_str(self, key: str) -> str | None:
        v = self.get(key, default=None)
        if v is not None and not isinstance(v, str):
            raise self._err(key, "a string or null", v)
        return v

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        v = self.str(key)
        if v not in options:
            raise self._err(key, "one of " + ", ".join(options), v)
        return v

    def cpus(self, key: str, default: Any = _MISSING) -> tuple[int, ...]:
        v = self.get(key, default)
        if not isinstance(v, str):
            raise self._err(key, 'a list string like "0-7,16-23"', v)
        try:
            return parse_cpulist(v)
        except ValueError:
            raise self._err(key, 'a list string like "0-7,16-23"', v) from None

    def ints(self, key: str) -> tuple[int, ...]:
        v = self.get(key)
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self._err(key, "a list of integers", v)
        return tuple(v)

    def list(self, key: str, default: Any = _MISSING) -> list:
        v = self.get(key, default)
        if not isinstance(v, list):
            raise self._err(key, "a list", v)
        return v

    def dict(self, key: str) -> Mapping:
        v = self.get(key)
        if not isinstance(v, Mapping):
            raise self._err(key, "an object", v)
        return v

    def items(self, key: str, default: Any = _MISSING) -> list["FieldReader"]:
        return [FieldReader(e, f"{self.where}: {key}[{i}]") for i, e in enumerate(self.list(key, default))]
