"""Resolve a topology against the world: machines (live or recorded), the model, the llama-server binary, then
the plan and the exact LaunchSpecs. ``plan``, ``up`` and ``bench`` all go through here, so what ``plan``
prints is exactly what ``up`` runs (one code path, no dry-run flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.backend.detect import detect_backend, find_llama_server
from orchestrator.backend.info import BackendInfo, nominal_backend
from orchestrator.config import Topology, load_topology
from orchestrator.errors import BackendError, ConfigError, PlanError
from orchestrator.hardware import Machine
from orchestrator.launch.worker_spec import ROUTER_TRACE_TOKENS, spec_for_worker
from orchestrator.launch.spec import LaunchSpec
from orchestrator.model import ModelInfo
from orchestrator.plan import Plan
from orchestrator.plan.from_topology import request_from_topology


@dataclass(frozen=True)
class Resolved:
    topology: Topology
    machines: dict[str, Machine]
    model: ModelInfo
    backend: BackendInfo
    plan: Plan
    specs: tuple[LaunchSpec, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)


def measured(machine: Machine, notes: list[str]) -> Machine:
    """This machine with measured bandwidths. When nothing is cached yet, measure now (`orchestrator probe`, a few
    seconds, cached per machine): generation speed on the CPU follows host memory bandwidth, and with GPUs the
    op-offload threshold and the main GPU follow the PCIe bandwidth, so `plan` and `up` must not fall back to
    assumed numbers where one measurement settles them. A probe that cannot run leaves the assumed bandwidths
    and says why."""
    if machine.bandwidth is not None:
        return machine
    from orchestrator.errors import HardwareError
    from orchestrator.hardware.probe import run_probe

    try:
        res = run_probe(machine, cpu_prompt=cpu_prompt_probe)
    except (HardwareError, OSError) as e:
        notes.append(f"bandwidth: not measured ({e}); assumed values are used")
        return machine
    if res.failed:
        notes.append("bandwidth: partly measured (" + "; ".join(res.messages) + ")")
    what = "host memory and PCIe" if machine.gpus else "host memory"
    notes.append(f"bandwidth: {what} measured {'now ' if not res.cached else ''}by `orchestrator probe` (cached in "
                 f"{res.cache_file}; `orchestrator probe --refresh` measures again)")
    return replace(machine, bandwidth=res.bandwidth)


def cpu_prompt_probe(machine: Machine, records: list, log=lambda s: None) -> tuple[float, str]:
    """The probe's CPU prompt measurement with this installation's llama-bench (beside the llama-server it would
    run) and the probe's small model (written once into the cache)."""
    import os

    from orchestrator.backend.detect import find_llama_server
    from orchestrator.errors import BackendError
    from orchestrator.hardware.probe import CPU_PROBE_SHAPE, cpu_probe_model_path, probe_cpu_prompt

    try:
        server, _ = find_llama_server(None)
    except BackendError:
        return 0.0, "CPU prompt speed not measured: no llama.cpp build (`orchestrator build`)"
    model = cpu_probe_model_path()
    if not model.is_file():
        from orchestrator.model.synth import write_model

        like, scale, quant = CPU_PROBE_SHAPE
        model.parent.mkdir(parents=True, exist_ok=True)
        part = model.with_name(model.name + ".part")
        write_model(part, like, scale=scale, quant=quant, fsync=False)
        os.replace(part, model)
    return probe_cpu_prompt(machine, records, os.path.join(os.path.dirname(server), "llama-bench"), model, log)


def assumed_host_bandwidth(machines: dict[str, Machine]) -> list[str]:
    """One note per machine whose host memory bandwidth the plan assumes instead of knowing: the speed it
    predicts on the CPU then rests on that figure, and the user must see which."""
    from orchestrator.plan import rates

    out = []
    for name, m in machines.items():
        host = dict(m.bandwidth.host) if m.bandwidth is not None else {}
        missing = [n.id for n in m.numa_nodes if not host.get((n.id, n.id))]
        if host and not missing:
            continue
        per, _src = rates.host_memory_bandwidth_default(len(m.numa_nodes))
        nodes = "" if not host else f" on node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        out.append(f"node {name}: host memory bandwidth not measured{nodes}: CPU speed predicted from an assumed "
                   f"{per / 1e9:.0f} GB/s per NUMA node (`orchestrator probe` on that machine measures it; a recorded "
                   f"machine carries it with `inspect --save` after a probe)")
    return out


def load_machines(topo: Topology) -> tuple[dict[str, Machine], list[str]]:
    from orchestrator.hardware import read_machine
    from orchestrator.hardware.dump import load_machine

    machines: dict[str, Machine] = {}
    notes = []
    live_local = None
    for i, n in enumerate(topo.nodes):
        if n.machine == "live":
            if n.address not in (None, "127.0.0.1", "localhost") and len(topo.nodes) > 1:
                raise topo.error(f"nodes.{i}.machine",
                                 f"node {n.name!r} is another machine: record it there with `orchestrator inspect "
                                 f"--save {n.name}.tar.gz` and give that file as machine:")
            if live_local is None:
                live_local = measured(read_machine("/"), notes)
            machines[n.name] = live_local
        else:
            machines[n.name] = load_machine(str(n.machine))
            notes.append(f"node {n.name}: recorded machine {n.machine}")
    return machines, notes


def remote_note(remote) -> str:
    from orchestrator.model.remote import bytes_to_download

    left = bytes_to_download(remote.files)
    where = remote.files[0].cache_path
    if not left:
        return f"model: {remote.ref}, downloaded in {where}"
    return (f"model: {remote.ref} read over the network (headers only); `up` or `orchestrator pull` downloads "
            f"{left / 2**30:.1f} GiB into {where}")


def find_backend(topo: Topology, machines: dict[str, Machine]) -> tuple[BackendInfo, list[str]]:
    notes = []
    all_recorded = all(n.machine != "live" for n in topo.nodes)
    try:
        path, origin = find_llama_server(topo.backend.binary, flavor=topo.backend.flavor)
        info = detect_backend(path)
        notes.append(f"llama-server: {path} (from {origin}; {info.flavor}, {'CUDA' if info.cuda else 'CPU'})")
    except BackendError:
        if not all_recorded:
            raise
        flavor = topo.backend.flavor if topo.backend.flavor != "auto" else "mainline"
        cuda = any(m.gpus for m in machines.values())
        info = nominal_backend(flavor, cuda)
        notes.append(f"no llama-server here: planned for {flavor} llama-server{' with CUDA' if cuda else ''} "
                     f"(the recorded machines' own binary is detected at `up`)")
        return info, notes
    want = topo.backend.flavor
    if want != "auto" and want != info.flavor:
        raise ConfigError(f"{topo.where('backend.flavor')}: backend.flavor: {want} was asked for but {info.server} "
                          f"is {info.flavor}: point backend.binary at a {want} llama-server or set flavor: auto")
    if all_recorded and any(m.gpus for m in machines.values()) and not info.cuda:
        notes.append(f"{info.server} has no CUDA; planning the recorded machine for a CUDA build of it")
        from dataclasses import replace

        info = replace(info, cuda=True)
    return info, notes


def routing_curve(model_path: str, backend: BackendInfo):
    """The model's measured hit-rate curve when `orchestrator model MODEL --routing` cached one (read, never
    measured here), else None: the plan then uses the stated default curve. Only a backend with the expert
    cache reads it."""
    from orchestrator.model.routing import load_profile

    if not backend.has("expert_cache") or not Path(model_path).is_file():
        return None
    found = load_profile(model_path)
    return found[0].curve("lru-layer") if found else None


def resolve(topology: str | Path | Topology, *, overrides: dict | None = None,
            backend: BackendInfo | None = None) -> Resolved:
    """``backend``: use this llama-server description instead of finding and detecting the binary."""
    from orchestrator.model.remote import load_model
    from orchestrator.plan import make_plan

    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    if overrides:
        topo = topo.override(overrides)
    topo.check_files()
    machines, notes = load_machines(topo)
    notes += assumed_host_bandwidth(machines)
    model, remote = load_model(str(topo.model.path))
    if remote is not None:
        notes.append(remote_note(remote))
    if backend is None:
        backend, bnotes = find_backend(topo, machines)
        notes += bnotes
    if topo.workers.live_routing == "on" and not backend.has("router_trace"):
        notes.append(f"workers.live_routing: on, but {backend.server} has no --router-trace (orchestrator's build "
                     f"of llama.cpp adds it): the workers record no routing")
    request = request_from_topology(topo)
    routing = routing_curve(model.paths[0], backend)
    try:
        plan = make_plan(machines=machines, model=model, request=request, backend=backend, routing=routing)
    except PlanError as err:
        raise PlanError(f"{topo.where('model')}: {err}") from None
    local = next((n.name for n in topo.nodes if n.address in (None, "127.0.0.1", "localhost")), None)
    by_name = {n.name: n for n in topo.nodes}
    specs = []
    for w in plan.workers:
        n = by_name[w.node]
        resources = {n.ray_resource: 0.001} if n.ray_resource else None
        spec = spec_for_worker(w.name, w.settings, w.backend, node=w.node, local_node=local, resources=resources,
                               router_trace=ROUTER_TRACE_TOKENS if topo.workers.live_routing == "on" else 0)
        if spec.node is not None and n.address and not n.ray_resource:
            spec = replace(spec, node=n.address)  # Ray finds a node by its name, address or host name
        specs.append(spec)
    specs = tuple(specs)
    return Resolved(topo, machines, model, backend, plan, specs, tuple(notes))
