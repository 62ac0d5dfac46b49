"""Benchmark configurations: the plan and the alternatives it must beat, as llama-server flags.

Pure code: every generator takes the planned worker's llama-server flags and returns new flag tuples. What stays
the same for every configuration (so that only placement is compared): the model, the context (``-c``), the
parallel slots (``-np``), threads (``-t``/``-tb``), KV types, flash attention, ``--numa`` and the wrapper
(numactl ...) the plan runs under. What changes is named per generator below.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from orchestrator.errors import ConfigError

from orchestrator.launch.llama_args import OFFLOAD_DEFAULT, OFFLOAD_ENV, OFFLOAD_NEVER

GROUPS = ("plan", "fit", "cpu-moe", "ncmoe-sweep", "offload-sweep")
OPTIONAL_GROUPS = ("control", "threads-sweep")          # asked for by name only

# long name of every flag the generators look at (llama-server's short and long aliases)
_ALIASES = {
    "-m": "--model", "-c": "--ctx-size", "-np": "--parallel", "-t": "--threads", "-tb": "--threads-batch",
    "-ngl": "--n-gpu-layers", "--gpu-layers": "--n-gpu-layers", "-ot": "--override-tensor",
    "-ub": "--ubatch-size", "-b": "--batch-size", "-sm": "--split-mode", "-ts": "--tensor-split",
    "-mg": "--main-gpu", "-cmoe": "--cpu-moe", "-ncmoe": "--n-cpu-moe", "-fit": "--fit", "-fitt": "--fit-target",
    "-fitc": "--fit-ctx", "-lm": "--load-mode", "-a": "--alias", "-fa": "--flash-attn",
}
_NEGATIVE_NUMBER = re.compile(r"^-\d")

# flags that decide where weights live, how big batches are, and how weights are loaded
PLACEMENT_FLAGS = frozenset({
    "--n-gpu-layers", "--override-tensor", "--cpu-moe", "--n-cpu-moe", "--split-mode", "--tensor-split",
    "--main-gpu", "--fit", "--fit-target", "--fit-ctx", "--ubatch-size", "--batch-size", "--load-mode",
    "--no-mmap", "--mmap", "--mlock", "-cuda", "--cuda-params", "--no-op-offload", "--op-offload",
})
# server identity: the runner sets these itself
ENDPOINT_FLAGS = frozenset({"--host", "--port"})


def canonical(flag: str) -> str:
    return _ALIASES.get(flag, flag)


@dataclass(frozen=True)
class Arg:
    flag: str | None          # as written ("-ngl"); None for a stray positional token
    value: str | None         # None for a switch

    @property
    def key(self) -> str | None:
        return canonical(self.flag) if self.flag else None

    def tokens(self) -> list[str]:
        out = [self.flag] if self.flag else []
        if self.value is not None:
            out.append(self.value)
        return out


def parse_args(args: Sequence[str]) -> list[Arg]:
    """Split llama-server flags into (flag, value) pairs.

    llama-server takes no positional arguments, so a flag takes a value exactly when the next token is not a
    flag (a negative number counts as a value). ``--flag=value`` is split.
    """
    out: list[Arg] = []
    toks = list(args)
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.startswith("-") and not _NEGATIVE_NUMBER.match(t):
            if t.startswith("--") and "=" in t:
                f, v = t.split("=", 1)
                out.append(Arg(f, v))
                i += 1
                continue
            nxt = toks[i + 1] if i + 1 < len(toks) else None
            if nxt is not None and (not nxt.startswith("-") or _NEGATIVE_NUMBER.match(nxt)):
                out.append(Arg(t, nxt))
                i += 2
            else:
                out.append(Arg(t, None))
                i += 1
        else:
            out.append(Arg(None, t))
            i += 1
    return out


def render(args: Iterable[Arg]) -> tuple[str, ...]:
    out: list[str] = []
    for a in args:
        out += a.tokens()
    return tuple(out)


def get_arg(args: Sequence[str], flag: str) -> str | None:
    """The value of the last occurrence of ``flag`` (any alias), "" for a switch, None when absent."""
    key = canonical(flag)
    found = None
    for a in parse_args(args):
        if a.key == key:
            found = a.value if a.value is not None else ""
    return found


def has_flag(args: Sequence[str], flag: str) -> bool:
    return get_arg(args, flag) is not None


def without(args: Sequence[str], flags: Iterable[str]) -> tuple[str, ...]:
    keys = {canonical(f) for f in flags}
    return render(a for a in parse_args(args) if a.key not in keys)


def with_args(args: Sequence[str], *pairs: tuple[str, str | None]) -> tuple[str, ...]:
    """``args`` with each (flag, value) set: earlier occurrences (any alias) removed, the new one appended."""
    out = list(parse_args(args))
    for flag, value in pairs:
        key = canonical(flag)
        out = [a for a in out if a.key != key]
        out.append(Arg(flag, value))
    return render(out)


def _int_arg(args: Sequence[str], flag: str) -> int | None:
    v = get_arg(args, flag)
    try:
        return int(v) if v else None
    except ValueError:
        return None


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
    the run's.
    """

    name: str
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    group: str = "extra"
    params: Mapping[str, Any] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()
    predicted: Mapping[str, Any] = field(default_factory=dict)
    server: str | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+=@-]*", self.name):
            raise ConfigError(f"bench configuration name {self.name!r}: use letters, digits and . _ - + = @ only")
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        object.__setattr__(self, "wrapper", tuple(str(a) for a in self.wrapper))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})

    @property
    def model_path(self) -> str | None:
        return get_arg(self.args, "--model") or None

    @property
    def ctx(self) -> int | None:
        return _int_arg(self.args, "--ctx-size")

    @property
    def parallel(self) -> int | None:
        return _int_arg(self.args, "--parallel")

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
                **({"server": self.server} if self.server else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "BenchConfig":
        return cls(name=d["name"], args=tuple(d.get("args", ())), env=dict(d.get("env", {})),
                   group=d.get("group", "extra"), params=dict(d.get("params", {})),
                   wrapper=tuple(d.get("wrapper", ())), predicted=dict(d.get("predicted", {})),
                   server=d.get("server") or None)


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# --- the plan as a configuration ----------------------------------------------------------------------------

def _load_mode_of(args: Sequence[str]) -> str:
    lm = get_arg(args, "--load-mode")
    if lm in ("none",):
        return "pinned"
    if lm in ("mlock", "mmap+mlock"):
        return "mlock"
    if lm == "mmap":
        return "mmap"
    if has_flag(args, "--no-mmap"):
        return "mlock" if has_flag(args, "--mlock") else "pinned"
    return "mmap"


def offload_threshold_of(args: Sequence[str], env: Mapping[str, str]) -> int | None:
    """The op-offload threshold a configuration runs with: :data:`OFFLOAD_NEVER` for ``--no-op-offload``,
    ik_llama.cpp's ``-cuda offload-batch-size=N`` or mainline's GGML_OP_OFFLOAD_MIN_BATCH; None when unset
    (llama.cpp's default 32 applies)."""
    if has_flag(args, "--no-op-offload"):
        return OFFLOAD_NEVER
    cuda = get_arg(args, "-cuda")
    if cuda:
        m = re.search(r"offload-batch-size=(\d+)", cuda)
        if m:
            return int(m.group(1))
    v = env.get(OFFLOAD_ENV)
    if v is not None and str(v).strip().isdigit():
        return int(v)
    return None


def cpu_expert_layers_of(args: Sequence[str], max_layers: int = 1024) -> tuple[int, ...] | None:
    """The layers whose routed experts a configuration keeps in host memory, read from its flags: ``-ot``
    (first matching pattern wins, as llama.cpp applies them), ``--n-cpu-moe N``, or none when only ``-ngl``
    is given. None when it cannot be told (``--cpu-moe`` without the layer count, or no GPU flags at all)."""
    ot = get_arg(args, "--override-tensor")
    if ot:
        pairs = []
        for item in ot.split(","):
            if "=" in item:
                rx, buft = item.rsplit("=", 1)
                try:
                    pairs.append((re.compile(rx), buft))
                except re.error:
                    return None
        layers = []
        for i in range(max_layers):
            name = f"blk.{i}.ffn_up_exps.weight"
            buft = next((b for rx, b in pairs if rx.search(name)), None)
            if buft is not None and buft.upper() == "CPU":
                layers.append(i)
        return tuple(layers)
    n = _int_arg(args, "--n-cpu-moe")
    if n is not None:
        return tuple(range(n))
    if has_flag(args, "--cpu-moe"):
        return None
    if has_flag(args, "--n-gpu-layers"):
        return ()
    return None


def plan_config(args: Sequence[str], env: Mapping[str, str] | None = None, *, name: str = "plan",
                wrapper: Sequence[str] = (), cpu_expert_layers: Sequence[int] | None = None,
                predicted: Mapping[str, Any] | None = None) -> BenchConfig:
    """The plan's own configuration (``group="plan"``), with its coordinates filled from its flags."""
    env = dict(env or {})
    params: dict[str, Any] = {
        "ubatch": _int_arg(args, "--ubatch-size") or 512,
        "batch": _int_arg(args, "--batch-size") or 2048,
        "load_mode": _load_mode_of(args),
        "op_offload_min_batch": offload_threshold_of(args, env) or OFFLOAD_DEFAULT,
    }
    if cpu_expert_layers is None:
        cpu_expert_layers = cpu_expert_layers_of(args)
    if cpu_expert_layers is not None:
        params["n_cpu_moe"] = len(cpu_expert_layers)
    return BenchConfig(name=name, args=tuple(args), env=env, group="plan", params=params,
                       wrapper=tuple(wrapper), predicted=dict(predicted or {}))


def config_from_worker(worker: Any, *, wrapper: Sequence[str] = ()) -> BenchConfig:
    """The plan configuration of a planner ``WorkerPlan`` (duck-typed: args, env, cpu_expert_layers, predicted,
    memory, gpus), its predictions translated to the bench's device names (``gpu<machine index>``, ``CPU``)."""
    predicted: dict[str, Any] = {}
    pred = getattr(worker, "predicted", None)
    if pred is not None:
        predicted["pp"] = {int(k): float(v) for k, v in dict(getattr(pred, "pp", {}) or {}).items()}
        predicted["tg"] = float(getattr(pred, "tg", 0.0) or 0.0)
    mem: dict[str, int] = {}
    gpus = tuple(getattr(worker, "gpus", ()) or ())
    for m in getattr(worker, "memory", ()) or ():
        mem[_device_key(m.device, gpus)] = int(m.total)
    if mem:
        predicted["memory"] = mem
    return plan_config(worker.args, worker.env, wrapper=wrapper,
                       cpu_expert_layers=tuple(getattr(worker, "cpu_expert_layers", ()) or ()),
                       predicted=predicted)


def split_server_argv(argv: Sequence[str]) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """(wrapper, binary, flags) of a complete command line: the binary is the word after the last ``--``
    (numactl ... -- llama-server), else the first word named llama-server*, else the first word."""
    argv = tuple(argv)
    if not argv:
        raise ConfigError("empty command line")
    if "--" in argv:
        i = len(argv) - 1 - argv[::-1].index("--") + 1
    else:
        i = next((k for k, a in enumerate(argv) if re.search(r"(^|/)llama-server[^/]*$", a)), 0)
    if i >= len(argv):
        raise ConfigError(f"no server binary after '--' in {' '.join(argv)}")
    return argv[:i], argv[i], argv[i + 1:]


def config_from_launch_spec(spec: Any, worker: Any | None = None) -> BenchConfig:
    """The plan configuration of a ``LaunchSpec`` (what ``up`` runs: wrappers, binary, flags, env), with the
    planner's ``WorkerPlan`` for its predictions and CPU expert layers when given."""
    wrapper, _binary, args = split_server_argv(spec.argv)
    if worker is not None:
        c = config_from_worker(worker, wrapper=wrapper)
        return replace(c, args=args, env=dict(spec.env))
    return plan_config(args, dict(spec.env), wrapper=wrapper)


def config_from_plan_json(data: Mapping, worker: int = 0) -> BenchConfig:
    """The plan configuration from ``orchestrator plan --json`` output (``workers[i]`` with ``args`` or ``argv``,
    ``env``, ``predicted``, ``devices``/``memory``, ``gpus``, ``cpu_expert_layers``)."""
    workers = data.get("workers")
    if not isinstance(workers, list) or not workers:
        raise ConfigError("plan JSON: expected a non-empty 'workers' list (the output of `orchestrator plan --json`)")
    if not 0 <= worker < len(workers):
        raise ConfigError(f"plan JSON: worker {worker} does not exist (it has {len(workers)})")
    w = workers[worker]
    wrapper: tuple[str, ...] = ()
    if w.get("args"):
        args = tuple(w["args"])
        argv = tuple(w.get("argv") or ())
        if argv and "--" in argv:
            wrapper = argv[: argv.index("--") + 1]
    elif w.get("argv"):
        argv = tuple(w["argv"])
        idx = next((i for i, a in enumerate(argv) if re.search(r"(^|/)llama-server[^/]*$", a)), None)
        if idx is None:
            raise ConfigError("plan JSON: workers[%d].argv has no llama-server binary in it" % worker)
        wrapper, args = argv[:idx], argv[idx + 1:]
    else:
        raise ConfigError(f"plan JSON: workers[{worker}] has neither 'args' nor 'argv'")
    predicted: dict[str, Any] = {}
    p = w.get("predicted") or {}
    if p.get("pp"):
        predicted["pp"] = {int(k): float(v) for k, v in p["pp"].items()}
    if p.get("tg"):
        predicted["tg"] = float(p["tg"])
    gpus = tuple(w.get("gpus") or ())
    devices = w.get("devices") or {m["device"]: m["total"] for m in w.get("memory") or () if "device" in m}
    if devices:
        predicted["memory"] = {_device_key(k, gpus): int(v) for k, v in devices.items()}
    cel = w.get("cpu_expert_layers")
    c = plan_config(args, w.get("env") or {}, wrapper=wrapper,
                    cpu_expert_layers=tuple(cel) if cel is not None else None, predicted=predicted)
    n_layers = (data.get("model") or {}).get("n_layers")
    if isinstance(n_layers, int) and n_layers > 0:
        c = replace(c, params={**dict(c.params), "n_layers": n_layers})
    return c


def server_from_plan_json(data: Mapping, worker: int = 0) -> str | None:
    """The llama-server binary in ``workers[i].argv`` of ``orchestrator plan --json`` output, if any."""
    try:
        argv = data["workers"][worker].get("argv") or ()
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return next((a for a in argv if re.search(r"(^|/)llama-server[^/]*$", a)), None)


def _device_key(device: str, gpus: Sequence[int]) -> str:
    """"CUDA1" of a worker using machine GPUs (4, 5) -> "gpu5"; "CPU" stays."""
    m = re.fullmatch(r"CUDA(\d+)", str(device))
    if m:
        i = int(m.group(1))
        return f"gpu{gpus[i] if i < len(gpus) else i}"
    return str(device)


# --- the alternatives ----------------------------------------------------------------------------------------

def baseline_args(args: Sequence[str]) -> tuple[str, ...]:
    """The plan's flags without any placement, batch or load-mode decision: what a user starts from."""
    return without(args, PLACEMENT_FLAGS)


def _baseline_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != OFFLOAD_ENV}


def _uses_fit(args: Sequence[str]) -> bool:
    """Whether the binary knows ``--fit`` (mainline): the plan passes ``--fit off`` exactly then."""
    return has_flag(args, "--fit")


def fit_config(plan: BenchConfig) -> BenchConfig:
    """llama.cpp's own automatic placement (``--fit on``, its defaults for -ngl/-ot/-ub/-b/load mode and the
    op-offload threshold), with the plan's context kept: ``-c`` stays explicit, which llama.cpp's fit never
    shrinks ("context size set by user"), and ``--fit-ctx`` is set to the same value as a second guard."""
    args = baseline_args(plan.args)
    ctx = _int_arg(plan.args, "--ctx-size")
    extra: list[tuple[str, str | None]] = []
    if _uses_fit(plan.args):            # the binary has --fit (on by default): say so, and pin the context
        extra.append(("--fit", "on"))
        if ctx:
            extra.append(("--fit-ctx", str(ctx)))
    return BenchConfig(name="fit", args=with_args(args, *extra), env=_baseline_env(plan.env), group="fit",
                       params={"op_offload_min_batch": OFFLOAD_DEFAULT}, wrapper=plan.wrapper)


def cpu_moe_config(plan: BenchConfig) -> BenchConfig:
    """The common recipe: every layer on the GPU, every routed expert in host memory (``-ngl 999 --cpu-moe``),
    llama.cpp's defaults otherwise."""
    args = with_args(baseline_args(plan.args), ("-ngl", "999"), ("--cpu-moe", None))
    return BenchConfig(name="cpu-moe", args=args, env=_baseline_env(plan.env), group="cpu-moe",
                       params={"op_offload_min_batch": OFFLOAD_DEFAULT}, wrapper=plan.wrapper)


def control_config(plan: BenchConfig) -> BenchConfig:
    """The plan again under another name (an A/A control): ``plan/control`` should be 1.0, and how far it is
    not is the noise floor of this machine and run, against which the 0.97 targets are read."""
    return replace(plan, name="plan-control", group="control")


def _load_mode_pairs(plan_args: Sequence[str], mode: str) -> list[tuple[str, str | None]]:
    if has_flag(plan_args, "--load-mode") or _uses_fit(plan_args):   # a mainline that has --load-mode
        return [("--load-mode", {"mmap": "mmap", "pinned": "none", "mlock": "mlock"}[mode])]
    if mode == "pinned":
        return [("--no-mmap", None)]
    if mode == "mlock":
        return [("--no-mmap", None), ("--mlock", None)]
    return []


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

    The plan's environment (its op-offload threshold) is kept, so the sweep isolates placement, micro-batch and
    load mode; the threshold has its own sweep. ``-b`` is max(U, the plan's -b).
    """
    if ubatches is None:
        ubatches = _unique_ints([512, int(plan.params.get("ubatch", 512))])
    plan_b = int(plan.params.get("batch", 2048))
    base = baseline_args(plan.args)
    out = []
    for mode in load_modes:
        if mode not in ("mmap", "pinned", "mlock"):
            raise ConfigError(f"load mode {mode!r}: expected mmap, pinned or mlock")
        for n in n_values:
            for ub in ubatches:
                pairs: list[tuple[str, str | None]] = [("-ngl", "999"), ("--n-cpu-moe", str(n)), ("-ub", str(ub)),
                                                       ("-b", str(max(ub, plan_b)))]
                if _uses_fit(plan.args):
                    pairs.append(("--fit", "off"))
                pairs += _load_mode_pairs(plan.args, mode)
                out.append(BenchConfig(
                    name=f"ncmoe{n}-ub{ub}-{mode}", args=with_args(base, *pairs), env=dict(plan.env),
                    group="ncmoe-sweep", wrapper=plan.wrapper,
                    params={"n_cpu_moe": n, "ubatch": ub, "load_mode": mode,
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
    """The plan with its op-offload threshold replaced (GGML_OP_OFFLOAD_MIN_BATCH, or ik_llama.cpp's
    ``-cuda offload-batch-size=N`` when the plan uses that). A plan's ``--no-op-offload`` is "never": every
    other point drops it, and "never" keeps it."""
    out = []
    ik = get_arg(plan.args, "-cuda")
    t_plan = int(plan.params.get("op_offload_min_batch") or OFFLOAD_DEFAULT)
    switch = has_flag(plan.args, "--no-op-offload")
    for v in _other_points(values, t_plan, "op-offload threshold"):
        args, env = without(plan.args, ["--no-op-offload"]), dict(plan.env)
        if switch and v >= OFFLOAD_NEVER:
            out.append(BenchConfig(name="offload-never", args=plan.args, env=env, group="offload-sweep",
                                   wrapper=plan.wrapper, params={**dict(plan.params), "op_offload_min_batch": v}))
            continue
        if ik and "offload-batch-size=" in ik:
            args = with_args(args, ("-cuda", re.sub(r"offload-batch-size=\d+", f"offload-batch-size={v}", ik)))
        else:
            env[OFFLOAD_ENV] = str(v)
        name = "offload-never" if v >= OFFLOAD_NEVER else f"offload{v}"
        out.append(BenchConfig(name=name, args=args, env=env, group="offload-sweep", wrapper=plan.wrapper,
                               params={**dict(plan.params), "op_offload_min_batch": v}))
    return out


def default_thread_values(plan: BenchConfig) -> list[int]:
    """Generation threads below the plan's T: T/4, T/2, 3T/4 and T-1 (the plan's own point is the plan)."""
    t = _int_arg(plan.args, "-t")
    if t is None:
        raise ConfigError("threads-sweep: the plan's flags have no -t/--threads: give the sweep's values "
                          "(--threads N,...)")
    return sorted({max(1, t // 4), max(1, t // 2), max(1, 3 * t // 4), max(1, t - 1)} - {t})


def threads_sweep(plan: BenchConfig, values: Sequence[int]) -> list[BenchConfig]:
    """The plan with its generation threads (``-t``) replaced; prompt threads (``-tb``) stay the plan's, so a
    plan without ``-tb`` gets the plan's ``-t`` there (llama-server would otherwise follow ``-t``)."""
    t_plan = _int_arg(plan.args, "-t")
    out = []
    for v in _other_points(values, t_plan, "threads"):
        pairs = [("-t", str(v))]
        if get_arg(plan.args, "-tb") is None and t_plan is not None:
            pairs.append(("-tb", str(t_plan)))
        out.append(BenchConfig(name=f"threads{v}", args=with_args(plan.args, *pairs), env=dict(plan.env),
                               group="threads-sweep", wrapper=plan.wrapper, params={**dict(plan.params), "threads": v}))
    return out


def build_configs(plan: BenchConfig, which: Sequence[str] = GROUPS, *, ncmoe_values: Sequence[int] | None = None,
                  ubatches: Sequence[int] | None = None, load_modes: Sequence[str] = ("mmap", "pinned"),
                  offload_values: Sequence[int] | None = None, n_layers: int | None = None,
                  thread_values: Sequence[int] | None = None) -> list[BenchConfig]:
    """The configurations named in ``which`` (plan, fit, cpu-moe, ncmoe-sweep, offload-sweep, and the optional
    control: the plan again, and threads-sweep: the plan at other generation threads), derived from the plan's,
    in that order; names are unique."""
    unknown = [w for w in which if w not in GROUPS + OPTIONAL_GROUPS]
    if unknown:
        raise ConfigError(f"unknown bench configuration group {unknown[0]!r}: expected one of "
                          f"{', '.join(GROUPS + OPTIONAL_GROUPS)}")
    out: list[BenchConfig] = []
    for w in which:
        if w == "plan":
            out.append(plan)
        elif w == "fit":
            out.append(fit_config(plan))
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
    return replace(BenchConfig(name=name, args=tuple(words), env=env, group=group, server=server),
                   params={"op_offload_min_batch": offload_threshold_of(words, env) or OFFLOAD_DEFAULT})
