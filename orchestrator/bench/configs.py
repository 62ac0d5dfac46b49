"""Benchmark configurations: the plan and the alternatives it must beat, as typed settings.

Pure code. Every alternative is the plan's :class:`~orchestrator.launch.settings.WorkerSettings` changed with
``dataclasses.replace`` and rendered by :mod:`orchestrator.launch.llama_args` (the one place llama-server's flags
are spelled) for the plan's backend. What stays the same for every configuration (so that only placement is
compared): the model, the context, the parallel slots, threads, KV types, flash attention, ``--numa`` and the
wrapper (numactl ...) the plan runs under. What changes is named per generator below. A configuration given as
flags (``--config NAME='...'``) runs exactly those flags; they are read into settings for its coordinates.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from orchestrator.backend.devices import machine_gpu_key
from orchestrator.backend.info import BackendInfo
from orchestrator.backend.server_options import OPTIONS, PLACEMENT
from orchestrator.errors import ConfigError
from orchestrator.launch.llama_args import (
    FIELD_FLAGS, OFFLOAD_DEFAULT, OFFLOAD_ENV, OFFLOAD_NEVER, backend_seen_in, canonical, long_flag, numactl_argv,
    parse_server_args, server_args, server_env, split_flags,
)
from orchestrator.launch.numa import NumaPolicy
from orchestrator.launch.settings import ALL_LAYERS, WorkerSettings
from orchestrator.launch.wrappers import wrap
from orchestrator.launch.spec import LaunchSpec
from orchestrator.plan.types import WorkerPlan

# What a CPU llama-server holds resident beyond the buffers llama.cpp logs: the demo's replica (-c 8192 -np 2 -t 1)
# peaked at 202.8 MiB against 109.1 MiB of buffers (orchestrator bench topologies/demo.yaml on the dev VM, the
# `replica` row); the rest (93.7 MiB) is the process itself.
LLAMA_SERVER_CPU_PROCESS_BYTES = 94 << 20

GROUPS = ("plan", "fit", "fit-pinned", "cpu-moe", "ncmoe-sweep", "offload-sweep", "cache-grid")
OPTIONAL_GROUPS = ("control", "threads-sweep")          # asked for by name only
# a plan that runs on the CPU only: the choices it made there (threads, micro-batch, NUMA policy), each against
# llama.cpp's own defaults; the GPU-only groups would only run the same CPU computation again
CPU_GROUPS = ("plan", "defaults", "threads-sweep", "ub-sweep", "numa-sweep")
GPU_ONLY_GROUPS = ("fit", "fit-pinned", "cpu-moe", "ncmoe-sweep", "offload-sweep", "cache-grid")
CPU_UBATCHES = (128, 256, 512, 1024, 2048)
CACHE_GRID_STEPS = (0, 4, 8, 12)     # more expert layers in host memory than the plan, their VRAM as cache
CACHE_GRID_MARGIN_MIB = 64           # kept from the freed VRAM: the banks' id buffers and padding

# server identity: the runner sets these itself
ENDPOINT_FLAGS = FIELD_FLAGS["host"] + FIELD_FLAGS["port"]


@dataclass(frozen=True)
class Arg:
    flag: str | None          # as written ("-ngl"); None for a stray positional token
    value: str | None         # None for a switch

    @property
    def key(self) -> str | None:
        return long_flag(self.flag) if self.flag else None

    def tokens(self) -> list[str]:
        out = [self.flag] if self.flag else []
        if self.value is not None:
            out.append(self.value)
        return out


def parse_args(args: Sequence[str]) -> list[Arg]:
    """llama-server flags as (flag, value) pairs (:func:`orchestrator.launch.llama_args.split_flags`)."""
    return [Arg(f, v) for f, v in split_flags(args)]


def render(args: Iterable[Arg]) -> tuple[str, ...]:
    out: list[str] = []
    for a in args:
        out += a.tokens()
    return tuple(out)


def get_arg(args: Sequence[str], flag: str) -> str | None:
    """The value of the last occurrence of ``flag`` (any spelling), "" for a switch, None when absent."""
    key = long_flag(flag)
    found = None
    for a in parse_args(args):
        if a.key == key:
            found = a.value if a.value is not None else ""
    return found


def has_flag(args: Sequence[str], flag: str) -> bool:
    return get_arg(args, flag) is not None


def without(args: Sequence[str], flags: Iterable[str]) -> tuple[str, ...]:
    keys = {long_flag(f) for f in flags}
    return render(a for a in parse_args(args) if a.key not in keys)


def with_args(args: Sequence[str], *pairs: tuple[str, str | None]) -> tuple[str, ...]:
    """``args`` with each (flag, value) set: earlier occurrences (any spelling) removed, the new one appended."""
    out = list(parse_args(args))
    for flag, value in pairs:
        key = long_flag(flag)
        out = [a for a in out if a.key != key]
        out.append(Arg(flag, value))
    return render(out)


# --- the configuration ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    """One llama-server configuration to measure.

    ``args``: llama-server's flags (no binary; ``--host``/``--port`` are set by the runner). ``env``: variables on
    top of the inherited environment. ``wrapper``: argv put before the binary (``numactl ... --``).
    ``group``: which family it belongs to (plan, fit, cpu-moe, ncmoe-sweep, offload-sweep, extra); ``params``: its
    coordinates in that family (n_cpu_moe, ubatch, load_mode, op_offload_min_batch). ``predicted``: what the plan
    predicted ({"pp": {len: t/s}, "tg": t/s, "memory": {"gpu0": bytes, "CPU": bytes}}), compared in the summary.
    ``server``: this configuration's own llama-server (another build, e.g. ik_llama.cpp beside mainline); None =
    the run's. ``members``: a deployment of several replicas, every one started and serving at once (the
    requests spread over them as the gateway spreads them); its own flags are the first replica's. ``settings``: what ``args``/``env`` say, typed (read from them when not given); ``backend``: the
    binary the settings were rendered for (None: what the flags show of it), so alternatives render the same way.
    """

    name: str
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    group: str = "extra"
    params: Mapping[str, Any] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()
    predicted: Mapping[str, Any] = field(default_factory=dict)
    server: str | None = None
    settings: WorkerSettings | None = None
    backend: BackendInfo | None = None
    members: tuple["BenchConfig", ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+=@-]*", self.name):
            raise ConfigError(f"bench configuration name {self.name!r}: use letters, digits and . _ - + = @ only")
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        object.__setattr__(self, "wrapper", tuple(str(a) for a in self.wrapper))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})
        if self.settings is None:
            object.__setattr__(self, "settings", parse_server_args(self.args, self.env))

    @property
    def model_path(self) -> str | None:
        return self.settings.model_path or None

    @property
    def ctx(self) -> int | None:
        return self.settings.context

    @property
    def parallel(self) -> int | None:
        return self.settings.parallel

    @property
    def replicas(self) -> int:
        return len(self.members) or 1

    def cores(self, machine_cpus: int) -> int:
        """The cores this configuration computes on: its pinned CPUs (numactl), else its threads (prompt or
        generation, the larger; llama.cpp's default is every CPU), at most the machine's; a deployment the sum
        over its replicas."""
        if self.members:
            return min(machine_cpus, sum(m.cores(machine_cpus) for m in self.members))
        s = self.settings
        pinned = s.numa.n_cpus
        if pinned:
            return min(pinned, machine_cpus)
        threads = [t for t in (s.threads, s.threads_batch) if t]
        return min(max(threads), machine_cpus) if threads else machine_cpus

    def scope(self, machine_cpus: int) -> str:
        """What it runs as, in words: ``2 replicas × 1 core``, ``one server on 2 cores``."""
        if self.members:
            each = {m.cores(machine_cpus) for m in self.members}
            per = f"{next(iter(each))} core{'s' * (next(iter(each)) > 1)}" if len(each) == 1 else "cores each"
            return f"{len(self.members)} replicas × {per}"
        n = self.cores(machine_cpus)
        of = self.params.get("replica_of")
        if of:
            return f"one replica of {of}, on {n} core{'s' * (n > 1)}"
        return f"one server on {n} core{'s' * (n > 1)}"

    @property
    def renders_for(self) -> BackendInfo:
        """The backend alternatives are rendered for: the plan's, or what its flags show of it."""
        return self.backend or backend_seen_in(self.args, self.server or "llama-server")

    def argv(self, server_binary: str, host: str, port: int) -> tuple[str, ...]:
        """The complete command line: wrapper, binary, flags, then our --host/--port."""
        body = without(self.args, ENDPOINT_FLAGS)
        return (*self.wrapper, self.server or server_binary, *body, "--host", host, "--port", str(port))

    def shell_line(self, server_binary: str = "llama-server") -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        line = shlex.join([*self.wrapper, self.server or server_binary, *self.args])
        return f"{env} {line}" if env else line

    def to_dict(self) -> dict:
        return {"name": self.name, "group": self.group, "args": list(self.args), "env": dict(self.env),
                "wrapper": list(self.wrapper), "params": dict(self.params), "predicted": _jsonable(self.predicted),
                **({"server": self.server} if self.server else {}),
                "settings": self.settings.to_dict(),
                **({"backend": self.backend.to_dict()} if self.backend is not None else {}),
                **({"members": [m.to_dict() for m in self.members]} if self.members else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "BenchConfig":
        return cls(name=d["name"], args=tuple(d.get("args", ())), env=dict(d.get("env", {})),
                   group=d.get("group", "extra"), params=dict(d.get("params", {})),
                   wrapper=tuple(d.get("wrapper", ())), predicted=dict(d.get("predicted", {})),
                   server=d.get("server") or None,
                   settings=WorkerSettings.from_dict(d["settings"]) if d.get("settings") else None,
                   backend=BackendInfo.from_dict(d["backend"]) if d.get("backend") else None,
                   members=tuple(cls.from_dict(m) for m in d.get("members") or ()))


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# --- the plan as a configuration ----------------------------------------------------------------------------

def cpu_expert_layers_of(s: WorkerSettings, max_layers: int = 1024) -> tuple[int, ...] | None:
    """The layers whose routed experts a configuration keeps in host memory: its tensor overrides (the first
    matching pattern wins, as llama.cpp applies them), ``--n-cpu-moe N``, or none when only the GPU layers are
    given. None when it cannot be told (``--cpu-moe`` without the layer count, or no GPU settings at all)."""
    if s.tensor_overrides:
        try:
            pairs = [(re.compile(rx), buft) for rx, buft in s.tensor_overrides]
        except re.error:
            return None
        layers = []
        for i in range(max_layers):
            name = f"blk.{i}.ffn_up_exps.weight"
            buft = next((b for rx, b in pairs if rx.search(name)), None)
            if buft is not None and buft.upper() == "CPU":
                layers.append(i)
        return tuple(layers)
    if s.n_cpu_moe is not None:
        return tuple(range(s.n_cpu_moe))
    if s.cpu_moe:
        return None
    if s.n_gpu_layers is not None:
        return ()
    return None


def _params(s: WorkerSettings, cpu_expert_layers: Sequence[int] | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "ubatch": s.n_ubatch or 512,
        "batch": s.n_batch or 2048,
        "load_mode": s.load_mode,
        "op_offload_min_batch": s.op_offload_min_batch or OFFLOAD_DEFAULT,
    }
    if cpu_expert_layers is None:
        cpu_expert_layers = cpu_expert_layers_of(s)
    if cpu_expert_layers is not None:
        params["n_cpu_moe"] = len(cpu_expert_layers)
    if s.expert_cache_mib:
        params["expert_cache_mib"] = s.expert_cache_mib
    return params


def plan_config(args: Sequence[str], env: Mapping[str, str] | None = None, *, name: str = "plan",
                wrapper: Sequence[str] = (), cpu_expert_layers: Sequence[int] | None = None,
                predicted: Mapping[str, Any] | None = None, settings: WorkerSettings | None = None,
                backend: BackendInfo | None = None) -> BenchConfig:
    """The plan's own configuration (``group="plan"``), with its coordinates filled from its settings (read from
    its flags when not given)."""
    env = dict(env or {})
    settings = settings or parse_server_args(args, env)
    return BenchConfig(name=name, args=tuple(args), env=env, group="plan",
                       params=_params(settings, cpu_expert_layers), wrapper=tuple(wrapper),
                       predicted=dict(predicted or {}), settings=settings, backend=backend)


def _predicted(worker: WorkerPlan) -> dict[str, Any]:
    predicted: dict[str, Any] = {}
    pred = worker.predicted
    predicted["pp"] = {int(k): float(v) for k, v in dict(pred.pp or {}).items()}
    predicted["tg"] = float(pred.tg or 0.0)
    if pred.streams > 1 and pred.tg_streams:
        predicted["tg_streams"] = {int(pred.streams): float(pred.tg_streams)}
    mem = {machine_gpu_key(m.device, worker.gpus): int(m.total) for m in worker.memory}
    if mem and "CPU" in mem and not worker.gpus:
        # the bench compares with the server's resident size: llama.cpp's buffers (the plan's memory) and the
        # process's own (code, libraries, the HTTP server, the vocabulary's tables), measured for a CPU build
        mem["CPU"] += LLAMA_SERVER_CPU_PROCESS_BYTES
    if mem:
        predicted["memory"] = mem
    return predicted


def config_from_worker(worker: WorkerPlan, *, wrapper: Sequence[str] = ()) -> BenchConfig:
    """The plan configuration of a planner ``WorkerPlan``: its settings rendered for its backend, its
    predictions translated to the bench's device names (``gpu<machine index>``, ``CPU``)."""
    return plan_config(worker.args, worker.env, wrapper=wrapper, cpu_expert_layers=tuple(worker.cpu_expert_layers),
                       predicted=_predicted(worker), settings=worker.settings, backend=worker.backend)


def config_from_launch_spec(spec: LaunchSpec, worker: WorkerPlan | None = None) -> BenchConfig:
    """The plan configuration of a ``LaunchSpec`` (what ``up`` runs: wrappers, binary, flags, env) and the
    planner's ``WorkerPlan`` it was made from (its settings, backend and predictions)."""
    if worker is None:
        raise ConfigError(f"worker {spec.name}: benchmarking a launch spec needs the planned worker it came from")
    n = len(worker.args) + 1
    if tuple(spec.argv[-n:]) != (worker.backend.server, *worker.args):
        raise ConfigError(f"worker {spec.name}: its command line is not the plan's llama-server flags")
    c = config_from_worker(worker, wrapper=spec.argv[:-n])
    return replace(c, env=dict(spec.env))


def config_from_plan_json(data: Mapping, worker: int = 0) -> BenchConfig:
    """The plan configuration from ``orchestrator plan --json`` output, read through
    :class:`orchestrator.plan.document.PlanDocument` (its settings and backend when given, else its args)."""
    from orchestrator.plan.document import PlanDocument

    doc = PlanDocument.from_dict(data)
    w = doc.worker(worker)
    use_settings = w.settings is not None and doc.backend is not None
    predicted: dict[str, Any] = {}
    if w.predicted_pp:
        predicted["pp"] = dict(w.predicted_pp)
    if w.predicted_tg:
        predicted["tg"] = w.predicted_tg
    streams = (w.details.get("predicted") or {}).get("streams")
    if isinstance(streams, int) and streams > 1 and (w.details.get("predicted") or {}).get("tg_streams"):
        predicted["tg_streams"] = {streams: float(w.details["predicted"]["tg_streams"])}
    if w.devices:
        predicted["memory"] = {machine_gpu_key(k, w.gpus): v for k, v in w.devices.items()}
    c = plan_config(w.server_args, w.env, wrapper=w.wrapper, settings=w.settings if use_settings else None,
                    backend=doc.backend if use_settings else None, cpu_expert_layers=w.cpu_expert_layers,
                    predicted=predicted)
    if doc.n_layers:
        c = replace(c, params={**dict(c.params), "n_layers": doc.n_layers})
    return c


def server_from_plan_json(data: Mapping, worker: int = 0) -> str | None:
    """The llama-server binary of ``orchestrator plan --json`` output: its backend's, else the one in the
    worker's argv; None when neither tells."""
    from orchestrator.plan.document import PlanDocument

    try:
        doc = PlanDocument.from_dict(data)
        return doc.backend.server if doc.backend is not None else doc.worker(worker).server
    except ConfigError:
        return None


# --- the alternatives ----------------------------------------------------------------------------------------

def derive(plan: BenchConfig, name: str, group: str, settings: WorkerSettings, params: Mapping[str, Any],
           wrapper: Sequence[str] | None = None) -> BenchConfig:
    """A configuration from the plan's: ``settings`` rendered for the plan's backend, the plan's variables that
    the settings do not own kept, the plan's wrapper (or ``wrapper``) and server."""
    backend = plan.renders_for
    owned = set(server_env(plan.settings, backend)) | {OFFLOAD_ENV}
    env = {k: v for k, v in plan.env.items() if k not in owned}
    env.update(server_env(settings, backend))
    return BenchConfig(name=name, args=server_args(settings, backend), env=env, group=group, params=dict(params),
                       wrapper=plan.wrapper if wrapper is None else tuple(wrapper), server=plan.server,
                       settings=settings, backend=plan.backend)


def runs_on_cpu_only(plan: BenchConfig) -> bool:
    """The plan puts nothing on a GPU (no GPU selected, ``-ngl 0``, or a binary without GPU offload)."""
    s = plan.settings
    return s.gpus == () or s.n_gpu_layers == 0 or (plan.backend is not None and not plan.backend.gpu_offload)


def rewrapped(plan: BenchConfig, settings: WorkerSettings) -> tuple[str, ...]:
    """The wrappers ``settings`` ask for (NUMA balancing, numactl), with the numactl the plan's wrapper uses."""
    numactl = next((w for w in plan.wrapper if w.rsplit("/", 1)[-1] == "numactl"), "numactl")
    return wrap(("-",), disable_numa_balancing=settings.disable_numa_balancing,
                numactl=numactl_argv(settings.numa, numactl))[:-1]


def defaults_config(plan: BenchConfig) -> BenchConfig:
    """What a user runs on a CPU without a plan: llama.cpp's defaults for threads, batches and load mode, and no
    numactl (the plan's context, slots, model and cache types kept)."""
    s = replace(baseline(plan.settings), threads=None, threads_batch=None, numa=NumaPolicy.none(), numa_flag="",
                disable_numa_balancing=False)
    return derive(plan, "defaults", "defaults", s, {"threads": None, "numa": "none"}, wrapper=())


def default_cpu_ubatches(plan: BenchConfig) -> list[int]:
    """-ub values of the CPU sweep: 128 to 2048, up to the plan's -b."""
    top = plan.settings.n_batch or 2048
    return [u for u in CPU_UBATCHES if u <= top]


def ub_sweep(plan: BenchConfig, values: Sequence[int]) -> list[BenchConfig]:
    """The plan at other micro-batches (``-ub``); ``-b`` stays the plan's, raised to ``-ub`` where it is smaller."""
    s = plan.settings
    out = []
    for v in _other_points(values, s.n_ubatch, "ub"):
        b = max(s.n_batch or v, v)
        out.append(derive(plan, f"ub{v}", "ub-sweep", replace(s, n_ubatch=v, n_batch=b),
                          {**dict(plan.params), "ubatch": v}))
    return out


def numa_sweep(plan: BenchConfig, nodes: Sequence[int] = ()) -> list[BenchConfig]:
    """The plan under the NUMA policies it did not choose, on the same CPUs: no numactl (threads and pages
    where the kernel puts them), memory bound to the plan's nodes (or the first), and memory interleaved over
    ``nodes`` (the machine's; else the plan's own) with llama.cpp's ``--numa distribute``."""
    s = plan.settings
    p = s.numa
    mine = tuple(sorted(set(p.mem_nodes) | set(p.cpu_nodes)))
    every = tuple(sorted(set(nodes))) or mine or (0,)
    policies = {
        "none": (NumaPolicy.none(p.cpus), ""),
        "bind": (NumaPolicy("bind", p.cpus, () if p.cpus else (mine or every)[:1], (mine or every)[:1]), ""),
        # never llama.cpp's --numa: it would reset the threads' CPUs that numactl bound (plan/cpu.py)
        "interleave": (NumaPolicy("interleave", p.cpus, p.cpu_nodes, every), ""),
    }
    out = []
    for mode, (policy, flag) in policies.items():
        if mode == p.mode:
            continue                     # the plan's own point is the plan
        t = replace(s, numa=policy, numa_flag=flag)
        out.append(derive(plan, f"numa-{mode}", "numa-sweep", t, {**dict(plan.params), "numa": mode},
                          wrapper=rewrapped(plan, t)))
    return out


# what a user starting from llama.cpp's defaults leaves unset besides placement (the options the plan owns as
# placement, from the option table): the batches, the load mode, the op-offload threshold, --fit's context
_BASELINE_UNSET = frozenset({"split_mode", "fit_ctx", "n_ubatch", "n_batch", "load_mode", "op_offload_min_batch"})
_PLACEMENT_FIELDS = frozenset(o.field for o in OPTIONS if o.owner == PLACEMENT and o.field)
_PLACEMENT_FLAGS = frozenset(f for o in OPTIONS if o.owner == PLACEMENT for f in o.flags)


def baseline(s: WorkerSettings) -> WorkerSettings:
    """The plan's settings without any placement, batch, load-mode or op-offload decision and without its expert
    cache: what a user starts from (llama.cpp's defaults for those)."""
    unset = _PLACEMENT_FIELDS | _BASELINE_UNSET
    extra = tuple(t for f, v in split_flags(s.extra_args)
                  if not (f and (canonical(f) in unset or f in _PLACEMENT_FLAGS))
                  for t in (f, v) if t is not None)
    defaults = WorkerSettings()
    return replace(s, **{name: getattr(defaults, name) for name in unset | {"expert_cache_mib"}}, extra_args=extra)


def fit_config(plan: BenchConfig) -> BenchConfig:
    """llama.cpp's own automatic placement (``--fit on``, its defaults for -ngl/-ot/-ub/-b/load mode and the
    op-offload threshold), with the plan's context kept: ``-c`` stays explicit, which llama.cpp's fit never
    shrinks ("context size set by user"), and ``--fit-ctx`` is set to the same value as a second guard. A binary
    without ``--fit`` (ik_llama.cpp) gets none of it: its defaults are the baseline."""
    s = replace(baseline(plan.settings), fit=True, fit_ctx=plan.settings.context)
    return derive(plan, "fit", "fit", s, {"op_offload_min_batch": OFFLOAD_DEFAULT})


def fit_pinned_config(plan: BenchConfig) -> BenchConfig:
    """What a user who knows adds to llama.cpp's automatic placement: ``--fit on --load-mode none`` (host weights
    in pinned buffers, copied to the GPU at full PCIe speed)."""
    s = replace(baseline(plan.settings), fit=True, fit_ctx=plan.settings.context, load_mode="pinned")
    return derive(plan, "fit-pinned", "fit-pinned", s, {"op_offload_min_batch": OFFLOAD_DEFAULT,
                                                        "load_mode": "pinned"})


def cache_grid(plan: BenchConfig, layer_expert_bytes: int, steps: Sequence[int] = CACHE_GRID_STEPS,
               n_layers: int | None = None) -> list[BenchConfig]:
    """The expert cache around the plan, as measured by hand: ``d`` more expert layers in host memory than the
    plan (the next layers after its own), their VRAM added to the plan's cache (less a small margin), for each
    ``d`` in ``steps``; ``d = 0`` is the plan's placement without its cache when it has one (the plan itself
    otherwise). Everything else is the plan's. Nothing when the plan keeps no expert layer in host memory.

    With ``-sm layer`` over several GPUs every GPU holds the banks of its own host-resident layers, all at one
    slot count, so VRAM freed on one GPU only grows the cache as far as the fullest GPU allows: see
    :func:`_layer_split_grid`."""
    from orchestrator.plan.placement import cpu_expert_override

    layers = cpu_expert_layers_of(plan.settings)
    if layers is None:
        raise ConfigError("cache-grid: the plan's flags do not tell which expert layers are in host memory")
    if not layers or layer_expert_bytes <= 0:
        return []
    s0 = plan.settings
    if n_layers is None and plan.params.get("n_layers") is not None:
        n_layers = int(plan.params["n_layers"])
    devices = _layer_devices(s0, n_layers)
    out = []
    for d in steps:
        if d == 0 and not s0.expert_cache_mib:
            continue                                   # that point is the plan itself
        if devices is None:
            extra, nxt = [], max(layers) + 1
            while len(extra) < d and (n_layers is None or nxt < int(n_layers)):
                extra.append(nxt)
                nxt += 1
            if len(extra) < d:
                continue
            freed = d * layer_expert_bytes // (1 << 20)
            mib = s0.expert_cache_mib + max(0, freed - CACHE_GRID_MARGIN_MIB) if d else 0
            shares: dict[str, int] = {}
        else:
            grown = _layer_split_grid(layers, devices, s0.expert_cache_mib, layer_expert_bytes, d)
            if grown is None:
                continue
            extra, mib, shares = grown
        cpu = tuple(sorted(set(layers) | set(extra)))
        s = replace(s0, tensor_overrides=cpu_expert_override(cpu), n_cpu_moe=None, cpu_moe=False,
                    expert_cache_mib=mib)
        name = f"ncmoe{len(cpu)}" + (f"+cache{mib}" if mib else "")
        params = {**dict(plan.params), "n_cpu_moe": len(cpu), "expert_cache_mib": mib}
        if shares:
            params["expert_cache_mib_per_gpu"] = shares
        out.append(derive(plan, name, "cache-grid", s, params))
    return out


def _layer_devices(s: WorkerSettings, n_layers: int | None) -> list[int] | None:
    """The device (position in the worker's GPU list) of each layer of a ``-sm layer`` worker over several GPUs,
    by llama.cpp's rule (llama-model.cpp: layer il goes to the first device whose cumulative ``-ts`` share, as a
    float, exceeds il / (layers + 1), the output layer counted); None for one GPU. Refused where the grid cannot
    tell where the cache's banks would go."""
    ts = tuple(s.tensor_split or ())
    n_dev = max(len(ts), len(s.gpus or ()))
    if n_dev <= 1:
        return None
    if (s.split_mode or "layer") != "layer":
        raise ConfigError(f"cache-grid: -sm {s.split_mode} spreads every layer over all GPUs; the expert cache is "
                          f"planned for one GPU or -sm layer")
    if len(ts) != n_dev:
        raise ConfigError("cache-grid: the plan runs several GPUs without -ts, so which GPU holds each layer's "
                          "cache is not known")
    if n_layers is None:
        if not all(float(x).is_integer() for x in ts):
            raise ConfigError("cache-grid: the model's layer count is needed to split -ts shares into layers "
                              "(plan from a topology or a model)")
        n_layers = int(sum(ts)) - 1                  # the plan's -ts counts: every layer, then the output layer
    if s.n_gpu_layers is not None and s.n_gpu_layers <= n_layers:
        raise ConfigError("cache-grid: the plan keeps some layers' attention in host memory; the cache serves "
                          "layers computed on a GPU")
    import numpy as np

    parts = np.asarray(ts, dtype=np.float32)
    splits = np.cumsum(parts, dtype=np.float32) / np.float32(parts.sum())
    act = np.float32(n_layers + 1)
    return [int(np.searchsorted(splits, np.float32(il) / act, side="right")) for il in range(n_layers)]


def _layer_split_grid(layers: Sequence[int], devices: Sequence[int], cache_mib: int, layer_expert_bytes: int,
                      d: int) -> tuple[list[int], int, dict[str, int]] | None:
    """``d`` more expert layers in host memory for a ``-sm layer`` plan over several GPUs, and the cache their VRAM
    pays for. GPU g holds h_g of the H banks, every bank the same slot count, so a cache of T MiB takes
    T h_g / H on it; the plan's T0 is split so. Moving a layer of GPU g to host memory frees one layer's experts
    there; the new cache is the largest T' that fits every GPU holding banks:

        T' = min over g of (T0 h_g / H + d_g x layer) x H' / h'_g  - margin

    Each layer moved is the next one after the host-resident layers of the GPU where it grows T' the most (ties:
    the lowest GPU). Returns (the layers moved, T' in MiB or 0 for d = 0, each GPU's share in MiB) or None when
    fewer than ``d`` layers are left to move."""
    n_dev = max(devices) + 1
    host = set(layers)
    h0 = [sum(1 for i in host if i < len(devices) and devices[i] == g) for g in range(n_dev)]
    total0 = sum(h0)
    old = [cache_mib * h / total0 if total0 else 0.0 for h in h0]
    per_layer = layer_expert_bytes / (1 << 20)
    moved: list[int] = []
    h, freed = list(h0), [0.0] * n_dev

    def nxt(g: int) -> int | None:
        mine = [i for i in range(len(devices)) if devices[i] == g]
        own = [i for i in mine if i in host or i in moved]
        after = [i for i in mine if i not in host and i not in moved and (not own or i > max(own))]
        return after[0] if after else None

    def size(hh: list[int], ff: list[float]) -> float:
        tot = sum(hh)
        return min((old[g] + ff[g]) * tot / hh[g] for g in range(n_dev) if hh[g])

    for _ in range(d):
        best = None
        for g in range(n_dev):
            i = nxt(g)
            if i is None:
                continue
            hh, ff = list(h), list(freed)
            hh[g] += 1
            ff[g] += per_layer
            t = size(hh, ff)
            if best is None or t > best[0]:
                best = (t, g, i)
        if best is None:
            return None
        _t, g, i = best
        moved.append(i)
        h[g] += 1
        freed[g] += per_layer
    if d == 0:
        return [], 0, {}
    mib = int(max(0.0, size(h, freed) - CACHE_GRID_MARGIN_MIB))
    tot = sum(h)
    return moved, mib, {f"CUDA{g}": int(mib * h[g] / tot) for g in range(n_dev)}


def cpu_moe_config(plan: BenchConfig) -> BenchConfig:
    """The common recipe: every layer on the GPU, every routed expert in host memory (``-ngl 999 --cpu-moe``),
    llama.cpp's defaults otherwise."""
    s = replace(baseline(plan.settings), n_gpu_layers=ALL_LAYERS, cpu_moe=True)
    return derive(plan, "cpu-moe", "cpu-moe", s, {"op_offload_min_batch": OFFLOAD_DEFAULT})


def control_config(plan: BenchConfig) -> BenchConfig:
    """The plan again under another name (an A/A control): ``plan/control`` should be 1.0, and how far it is
    not is the noise floor of this machine and run, against which the 0.97 targets are read."""
    return replace(plan, name="plan-control", group="control")


def _unique_ints(values: Iterable[int]) -> list[int]:
    out: list[int] = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def default_ncmoe_values(plan: BenchConfig, n_layers: int | None = None, span: int = 1) -> list[int]:
    """``--n-cpu-moe`` points around the plan's number of CPU-resident expert layers (plan-span .. plan+span)."""
    k = plan.params.get("n_cpu_moe")
    if n_layers is None and plan.params.get("n_layers") is not None:
        n_layers = int(plan.params["n_layers"])
    if k is None:
        raise ConfigError("the --n-cpu-moe sweep needs the plan's number of CPU expert layers, which its flags do "
                          "not tell (no -ot/--n-cpu-moe): give the sweep's values (--ncmoe N,...)")
    vals = [k + d for d in range(-span, span + 1)]
    return [v for v in vals if v >= 0 and (n_layers is None or v <= n_layers)]


def ncmoe_sweep(plan: BenchConfig, n_values: Sequence[int], ubatches: Sequence[int] | None = None,
                load_modes: Sequence[str] = ("mmap", "pinned")) -> list[BenchConfig]:
    """llama.cpp's manual knobs: ``-ngl 999 --n-cpu-moe N -ub U`` × load mode (mmap or pinned host buffers).

    The plan's op-offload threshold is kept, so the sweep isolates placement, micro-batch and load mode; the
    threshold has its own sweep. ``-b`` is max(U, the plan's -b).
    """
    if ubatches is None:
        ubatches = _unique_ints([512, int(plan.params.get("ubatch", 512))])
    plan_b = int(plan.params.get("batch", 2048))
    base = replace(baseline(plan.settings), n_gpu_layers=ALL_LAYERS,
                   fit=False if plan.settings.fit is not None else None,
                   op_offload_min_batch=plan.settings.op_offload_min_batch)
    out = []
    for mode in load_modes:
        if mode not in ("mmap", "pinned", "mlock"):
            raise ConfigError(f"load mode {mode!r}: expected mmap, pinned or mlock")
        for n in n_values:
            for ub in ubatches:
                s = replace(base, n_cpu_moe=n, n_ubatch=ub, n_batch=max(ub, plan_b), load_mode=mode)
                out.append(derive(plan, f"ncmoe{n}-ub{ub}-{mode}", "ncmoe-sweep", s, {
                    "n_cpu_moe": n, "ubatch": ub, "load_mode": mode,
                    "op_offload_min_batch": plan.params.get("op_offload_min_batch", OFFLOAD_DEFAULT)}))
    return out


def default_offload_values(plan: BenchConfig) -> list[int]:
    """Thresholds around the plan's T: T/4, T/2, 2T, 4T, llama.cpp's default 32, and "never" (the plan's own
    point is the plan configuration itself). A plan that never offloads sweeps around the default 32."""
    t = int(plan.params.get("op_offload_min_batch") or OFFLOAD_DEFAULT)
    if t >= OFFLOAD_NEVER:
        t = OFFLOAD_DEFAULT
        return sorted({max(1, t // 4), max(1, t // 2), t, t * 2, t * 4})
    vals = sorted({max(1, t // 4), max(1, t // 2), t * 2, t * 4, OFFLOAD_DEFAULT} - {t})
    return vals + [OFFLOAD_NEVER]


def _other_points(values: Sequence[int], plan_value: int | None, what: str) -> list[int]:
    """A sweep's values as positive ints, without the plan's own point (that point is the plan itself)."""
    out = []
    for v in values:
        v = int(v)
        if v < 1:
            raise ConfigError(f"{what} {v}: must be at least 1")
        if v != plan_value:
            out.append(v)
    return out


def offload_sweep(plan: BenchConfig, values: Sequence[int]) -> list[BenchConfig]:
    """The plan at other op-offload thresholds, spelled as the plan's binary takes them (mainline's
    GGML_OP_OFFLOAD_MIN_BATCH or ``--no-op-offload``, ik_llama.cpp's ``-cuda offload-batch-size=N``)."""
    out = []
    t_plan = int(plan.params.get("op_offload_min_batch") or OFFLOAD_DEFAULT)
    for v in _other_points(values, t_plan, "op-offload threshold"):
        name = "offload-never" if v >= OFFLOAD_NEVER else f"offload{v}"
        out.append(derive(plan, name, "offload-sweep", replace(plan.settings, op_offload_min_batch=v),
                          {**dict(plan.params), "op_offload_min_batch": v}))
    return out


def default_thread_values(plan: BenchConfig) -> list[int]:
    """Generation threads below the plan's T: T/4, T/2, 3T/4 and T-1 (the plan's own point is the plan)."""
    t = plan.settings.threads
    if t is None:
        raise ConfigError("threads-sweep: the plan's flags have no -t/--threads: give the sweep's values "
                          "(--threads N,...)")
    return sorted({max(1, t // 4), max(1, t // 2), max(1, 3 * t // 4), max(1, t - 1)} - {t})


def threads_sweep(plan: BenchConfig, values: Sequence[int]) -> list[BenchConfig]:
    """The plan with its generation threads (``-t``) replaced; prompt threads (``-tb``) stay the plan's, so a
    plan without ``-tb`` gets the plan's ``-t`` there (llama-server would otherwise follow ``-t``)."""
    s = plan.settings
    out = []
    for v in _other_points(values, s.threads, "threads"):
        tb = s.threads_batch if s.threads_batch is not None else s.threads
        out.append(derive(plan, f"threads{v}", "threads-sweep", replace(s, threads=v, threads_batch=tb),
                          {**dict(plan.params), "threads": v}))
    return out


def build_configs(plan: BenchConfig, which: Sequence[str] = GROUPS, *, ncmoe_values: Sequence[int] | None = None,
                  ubatches: Sequence[int] | None = None, load_modes: Sequence[str] = ("mmap", "pinned"),
                  offload_values: Sequence[int] | None = None, n_layers: int | None = None,
                  thread_values: Sequence[int] | None = None, layer_expert_bytes: int | None = None,
                  numa_nodes: Sequence[int] = ()) -> list[BenchConfig]:
    """The configurations named in ``which`` (plan, fit, fit-pinned, cpu-moe, ncmoe-sweep, offload-sweep,
    cache-grid, and the optional control: the plan again, and threads-sweep: the plan at other generation
    threads), derived from the plan's, in that order; names are unique. ``cache-grid`` needs the routed-expert
    bytes of one layer (``layer_expert_bytes``) and a backend with the expert cache; without them it is left
    out unless asked for by name. The CPU groups (:data:`CPU_GROUPS`): ``defaults`` (llama.cpp's own),
    ``ub-sweep`` (``ubatches``), ``numa-sweep`` (the other NUMA policies, ``numa_nodes`` being the machine's)."""
    known = dict.fromkeys(GROUPS + OPTIONAL_GROUPS + CPU_GROUPS)
    unknown = [w for w in which if w not in known]
    if unknown:
        raise ConfigError(f"unknown bench configuration group {unknown[0]!r}: expected one of {', '.join(known)}")
    out: list[BenchConfig] = []
    for w in which:
        if w == "plan":
            out.append(plan)
        elif w == "defaults":
            out.append(defaults_config(plan))
        elif w == "ub-sweep":
            out += ub_sweep(plan, list(ubatches) if ubatches is not None else default_cpu_ubatches(plan))
        elif w == "numa-sweep":
            out += numa_sweep(plan, numa_nodes)
        elif w == "fit":
            out.append(fit_config(plan))
        elif w == "fit-pinned":
            out.append(fit_pinned_config(plan))
        elif w == "cache-grid":
            has_cache = plan.renders_for.has("expert_cache")
            if layer_expert_bytes is None or not has_cache:
                if which is not GROUPS:
                    why = ("the routed-expert bytes of a layer (plan from a topology or a model)"
                           if layer_expert_bytes is None else f"a llama-server with --moe-cache-mib")
                    raise ConfigError(f"cache-grid needs {why}")
                continue
            try:
                out += cache_grid(plan, layer_expert_bytes, n_layers=n_layers)
            except ConfigError:
                if which is not GROUPS:
                    raise                              # asked for by name: say why not
        elif w == "cpu-moe":
            out.append(cpu_moe_config(plan))
        elif w == "ncmoe-sweep":
            vals = list(ncmoe_values) if ncmoe_values is not None else default_ncmoe_values(plan, n_layers)
            out += ncmoe_sweep(plan, vals, ubatches, load_modes)
        elif w == "control":
            out.append(control_config(plan))
        elif w == "offload-sweep":
            vals = list(offload_values) if offload_values is not None else default_offload_values(plan)
            out += offload_sweep(plan, vals)
        elif w == "threads-sweep":
            vals = list(thread_values) if thread_values is not None else default_thread_values(plan)
            out += threads_sweep(plan, vals)
    return dedupe(out)


def dedupe(configs: Sequence[BenchConfig]) -> list[BenchConfig]:
    """Drop later configurations with a name already taken."""
    seen: set[str] = set()
    out = []
    for c in configs:
        if c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out


_ENV_TOKEN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def parse_config_option(text: str, *, group: str = "extra") -> BenchConfig:
    """``NAME=ARGS`` from the command line: ``fast=-m m.gguf -c 8192 -ngl 999`` (leading ``VAR=value`` words are
    environment: ``off64=GGML_OP_OFFLOAD_MIN_BATCH=64 -m m.gguf ...``; ``LLAMA_SERVER=PATH`` among them is this
    configuration's own llama-server, e.g. an ik_llama.cpp build beside mainline). A config named ``plan`` is the
    plan."""
    if "=" not in text:
        raise ConfigError(f"--config {text!r}: expected NAME='llama-server flags'")
    name, rest = text.split("=", 1)
    name = name.strip()
    try:
        words = shlex.split(rest)
    except ValueError as e:
        raise ConfigError(f"--config {name}: cannot split the flags: {e}") from None
    env: dict[str, str] = {}
    while words and _ENV_TOKEN.match(words[0]) and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if not words:
        raise ConfigError(f"--config {name}: no llama-server flags given")
    server = env.pop("LLAMA_SERVER", None) or None
    if name == "plan":
        return replace(plan_config(words, env), server=server)
    c = BenchConfig(name=name, args=tuple(words), env=env, group=group, server=server)
    return replace(c, params={"op_offload_min_batch": c.settings.op_offload_min_batch or OFFLOAD_DEFAULT})
