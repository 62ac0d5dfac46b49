"""llama-server's and numactl's vocabulary, for both flavors: the one place their flags and variables are spelled.

:func:`server_args` / :func:`server_env` render a :class:`~orchestrator.launch.settings.WorkerSettings` for a
:class:`~orchestrator.backend.info.BackendInfo` (what the binary offers decides the spelling: ``--load-mode none``
or ``--no-mmap``, ``--no-op-offload`` or ``-cuda offload-batch-size=N`` or ``GGML_OP_OFFLOAD_MIN_BATCH``);
:func:`parse_server_args` reads a user's flags (a bench ``--config``) back into settings, keeping what it does
not know as extra arguments; :func:`numactl_argv` renders a NUMA policy. Pure: the planner imports it.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from orchestrator.backend.info import BackendInfo, Flavor
from orchestrator.launch.numa import NumaPolicy
from orchestrator.launch.settings import ALL_LAYERS, WorkerSettings
from orchestrator.units import format_cpulist

OFFLOAD_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"
OFFLOAD_DEFAULT = 32          # llama.cpp's op-offload threshold when nothing sets it
OFFLOAD_NEVER = 1 << 30       # larger than any batch: host-resident weights are never copied to the GPU

# every spelling of the flags a WorkerSettings field stands for (the first is the one rendered)
FIELD_FLAGS: dict[str, tuple[str, ...]] = {
    "model_path": ("-m", "--model"),
    "alias": ("--alias", "-a"),
    "host": ("--host",),
    "port": ("--port",),
    "context": ("-c", "--ctx-size"),
    "parallel": ("-np", "--parallel"),
    "n_gpu_layers": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "split_mode": ("-sm", "--split-mode"),
    "tensor_split": ("-ts", "--tensor-split"),
    "main_gpu": ("-mg", "--main-gpu"),
    "tensor_overrides": ("-ot", "--override-tensor"),
    "cpu_moe": ("--cpu-moe", "-cmoe"),
    "n_cpu_moe": ("--n-cpu-moe", "-ncmoe"),
    "op_offload_min_batch": ("--no-op-offload", "--op-offload", "-cuda", "--cuda-params"),
    "moe_cache_mib": ("--moe-cache-mib",),
    "moe_cache_max_batch": ("--moe-cache-max-batch",),
    "moe_cache_cpu_misses": ("--moe-cache-cpu-misses",),
    "moe_cache_prefetch": ("--moe-cache-prefetch",),
    "moe_cache_device_slots": ("--moe-cache-slots",),
    "moe_cache_prefill_ahead": ("--moe-cache-prefill-ahead",),
    "moe_cache_prefill_ahead_min_batch": ("--moe-cache-prefill-ahead-min-batch",),
    "fit": ("--fit", "-fit"),
    "fit_ctx": ("--fit-ctx", "-fitc"),
    "threads": ("-t", "--threads"),
    "threads_batch": ("-tb", "--threads-batch"),
    "n_batch": ("-b", "--batch-size"),
    "n_ubatch": ("-ub", "--ubatch-size"),
    "flash_attn": ("-fa", "--flash-attn"),
    "type_k": ("-ctk", "--cache-type-k"),
    "type_v": ("-ctv", "--cache-type-v"),
    "load_mode": ("--load-mode", "-lm", "--mmap", "--no-mmap", "--mlock"),
    "numa_flag": ("--numa",),
    "metrics": ("--metrics",),
}
# the spellings of one flag, long name first
_SPELLINGS = (
    ("--model", "-m"), ("--ctx-size", "-c"), ("--parallel", "-np"), ("--threads", "-t"),
    ("--threads-batch", "-tb"), ("--n-gpu-layers", "-ngl", "--gpu-layers"), ("--override-tensor", "-ot"),
    ("--ubatch-size", "-ub"), ("--batch-size", "-b"), ("--split-mode", "-sm"), ("--tensor-split", "-ts"),
    ("--main-gpu", "-mg"), ("--cpu-moe", "-cmoe"), ("--n-cpu-moe", "-ncmoe"), ("--fit", "-fit"),
    ("--fit-target", "-fitt"), ("--fit-ctx", "-fitc"), ("--load-mode", "-lm"), ("--alias", "-a"),
    ("--flash-attn", "-fa"), ("--cuda-params", "-cuda"), ("--cache-type-k", "-ctk"), ("--cache-type-v", "-ctv"),
    ("--device", "-dev"), ("--log-verbosity", "-lv", "--verbosity"),
)
_LONG = {spelling: names[0] for names in _SPELLINGS for spelling in names}
LOG_VERBOSITY = "--log-verbosity"     # how much llama-server logs (the bench reads its buffer sizes there)


def log_verbosity_args(level: int | str) -> tuple[str, ...]:
    return ("-lv", str(level))


# flags that place weights without a settings field of their own
DEVICE_FLAGS = ("-dev", "--device", "-fitt", "--fit-target")
API_KEY_FLAGS = ("--api-key", "--api-key-file")
_FLAG_FIELD = {f: name for name, flags in FIELD_FLAGS.items() for f in flags}
_NEGATIVE_NUMBER = re.compile(r"^-\d")
_OFFLOAD_BATCH = re.compile(r"^offload-batch-size=(\d+)$")


def flags_of(*names: str) -> tuple[str, ...]:
    """Every spelling of the flags of these settings fields."""
    return tuple(f for n in names for f in FIELD_FLAGS[n])


# --- settings -> argv / env -------------------------------------------------------------------------------

def server_args(s: WorkerSettings, backend: BackendInfo) -> tuple[str, ...]:
    """llama-server's own flags (no binary, no wrappers) for ``s`` on ``backend``."""
    a: list[str] = []
    if s.model_path:
        a += ["-m", s.model_path]
    if s.alias is not None:
        a += ["--alias", s.alias]
    if s.host is not None:
        a += ["--host", s.host]
    if s.port is not None:
        a += ["--port", str(s.port)]
    if s.context is not None:
        a += ["-c", str(s.context)]
    if s.parallel is not None:
        a += ["-np", str(s.parallel)]
    if s.n_gpu_layers is not None:
        a += ["-ngl", str(s.n_gpu_layers)]
    if s.split_mode is not None:
        a += ["-sm", s.split_mode]
    if s.tensor_split:
        a += ["-ts", ",".join(_num(x) for x in s.tensor_split)]
    if s.main_gpu is not None:
        a += ["-mg", str(s.main_gpu)]
    if s.tensor_overrides:
        a += ["-ot", ",".join(f"{pattern}={buft}" for pattern, buft in s.tensor_overrides)]
    if s.cpu_moe:
        a.append("--cpu-moe")
    if s.n_cpu_moe is not None:
        a += ["--n-cpu-moe", str(s.n_cpu_moe)]
    t = s.op_offload_min_batch
    if t is not None and t >= OFFLOAD_NEVER and backend.has("no_op_offload"):
        a.append("--no-op-offload")
    elif t is not None and backend.ik and backend.has("cuda_params"):
        a += ["-cuda", f"offload-batch-size={t}"]
    if s.moe_cache_mib > 0 and backend.has("moe_cache"):
        a += ["--moe-cache-mib", str(s.moe_cache_mib)]
        if s.moe_cache_max_batch is not None:
            a += ["--moe-cache-max-batch", str(s.moe_cache_max_batch)]
        if s.moe_cache_cpu_misses and backend.has("moe_cache_cpu_misses"):
            a.append("--moe-cache-cpu-misses")
        if s.moe_cache_prefetch and backend.has("moe_cache_prefetch"):
            a += ["--moe-cache-prefetch", "on"]
        if s.moe_cache_device_slots and backend.has("moe_cache_slots"):
            a += ["--moe-cache-slots", "device"]
        if s.moe_cache_prefill_ahead > 0 and backend.has("moe_cache_prefill_ahead"):
            a += ["--moe-cache-prefill-ahead", str(s.moe_cache_prefill_ahead)]
            if s.moe_cache_prefill_ahead_min_batch > 0 and backend.has("moe_cache_prefill_ahead_min_batch"):
                a += ["--moe-cache-prefill-ahead-min-batch", str(s.moe_cache_prefill_ahead_min_batch)]
    if s.fit is not None and backend.has("fit") and not backend.ik:
        a += ["--fit", "on" if s.fit else "off"]
    if s.fit_ctx is not None and backend.has("fit") and not backend.ik:
        a += ["--fit-ctx", str(s.fit_ctx)]
    for flag, value in (("-t", s.threads), ("-tb", s.threads_batch), ("-b", s.n_batch), ("-ub", s.n_ubatch)):
        if value is not None:
            a += [flag, str(value)]
    if s.flash_attn != "auto":
        a += ["-fa", s.flash_attn]          # both flavors take on|off
    if s.type_k != "f16":
        a += ["-ctk", s.type_k]
    if s.type_v != "f16":
        a += ["-ctv", s.type_v]
    if s.load_mode in ("pinned", "mlock"):
        if backend.has("load_mode"):
            a += ["--load-mode", "none" if s.load_mode == "pinned" else "mlock"]
        else:
            a += ["--no-mmap"] + (["--mlock"] if s.load_mode == "mlock" else [])
    if s.numa_flag and backend.has("numa"):
        a += ["--numa", s.numa_flag]
    if s.metrics and backend.has("metrics"):
        a.append("--metrics")
    return tuple(a + list(s.extra_args))


def server_env(s: WorkerSettings, backend: BackendInfo) -> dict[str, str]:
    """The variables set on top of the inherited environment: the GPUs it sees (PCI order, as the plan numbers
    them) and mainline's op-offload threshold when no switch says it."""
    env: dict[str, str] = {}
    if s.gpus is not None:
        if s.gpus:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in s.gpus)
    t = s.op_offload_min_batch
    if t is not None and not backend.ik and not (t >= OFFLOAD_NEVER and backend.has("no_op_offload")):
        env[OFFLOAD_ENV] = str(t)
    return env


def numactl_argv(policy: NumaPolicy, numactl: str = "numactl") -> list[str]:
    """The numactl prefix for ``policy`` (without the ``--`` that ends it): ``[]`` for mode ``none``.

    CPUs go to ``--physcpubind`` when the policy lists them (exact threads, e.g. one per physical core), else
    ``--cpunodebind``; never both (numactl applies them in turn and the last one would win).
    """
    if policy.mode == "none":
        return []
    argv = [numactl]
    if policy.cpus:
        argv.append(f"--physcpubind={format_cpulist(policy.cpus)}")
    elif policy.cpu_nodes:
        argv.append(f"--cpunodebind={format_cpulist(policy.cpu_nodes)}")
    nodes = format_cpulist(policy.mem_nodes)
    argv.append(f"--membind={nodes}" if policy.mode == "bind" else f"--interleave={nodes}")
    return argv


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --- argv -> settings ---------------------------------------------------------------------------------------

def split_flags(args: Sequence[str]) -> list[tuple[str | None, str | None]]:
    """llama-server flags as (flag, value) pairs: value None for a switch, flag None for a stray word.

    llama-server takes no positional arguments, so a flag takes a value exactly when the next word is not a
    flag (a negative number counts as a value). ``--flag=value`` is split.
    """
    out: list[tuple[str | None, str | None]] = []
    toks = [str(t) for t in args]
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.startswith("-") and not _NEGATIVE_NUMBER.match(t):
            if t.startswith("--") and "=" in t:
                f, v = t.split("=", 1)
                out.append((f, v))
                i += 1
                continue
            nxt = toks[i + 1] if i + 1 < len(toks) else None
            if nxt is not None and (not nxt.startswith("-") or _NEGATIVE_NUMBER.match(nxt)):
                out.append((t, nxt))
                i += 2
            else:
                out.append((t, None))
                i += 1
        else:
            out.append((None, t))
            i += 1
    return out


def long_flag(flag: str) -> str:
    """The long spelling of a flag (``-ngl`` -> ``--n-gpu-layers``); a flag without aliases stays itself."""
    return _LONG.get(flag, flag)


def canonical(flag: str) -> str:
    """One name for every spelling of a flag (the settings field it sets, or the flag itself)."""
    return _FLAG_FIELD.get(flag, flag)


def parse_server_args(args: Sequence[str], env: Mapping[str, str] | None = None) -> WorkerSettings:
    """A user's llama-server flags (and environment) read into settings. Flags without a field, and values this
    module cannot read back exactly, stay in ``extra_args`` in their order, so rendering runs the same server."""
    env = dict(env or {})
    kw: dict = {"metrics": False}
    extra: list[str] = []
    no_mmap = mlock = False
    for flag, value in split_flags(args):
        name = _FLAG_FIELD.get(flag) if flag else None
        try:
            done = _set(kw, name, flag, value)
        except ValueError:
            done = False
        if flag in ("--no-mmap",):
            no_mmap, done = True, True
        elif flag == "--mlock":
            mlock, done = True, True
        if not done:
            extra += [t for t in (flag, value) if t is not None]
    if no_mmap:
        kw["load_mode"] = "mlock" if mlock else "pinned"
    elif mlock:
        extra.append("--mlock")             # locked, still memory-mapped: no load mode of its own
    if OFFLOAD_ENV in env and "op_offload_min_batch" not in kw and str(env[OFFLOAD_ENV]).strip().isdigit():
        kw["op_offload_min_batch"] = int(env[OFFLOAD_ENV])
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    # GPU numbers are the plan's (PCI order) only when the order says so; otherwise the variables stay the user's
    if cvd is not None and (cvd.strip() == "" or env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID") and \
            re.fullmatch(r"\s*(\d+\s*(,\s*\d+\s*)*)?", cvd):
        kw["gpus"] = tuple(int(g) for g in cvd.split(",") if g.strip())
    return WorkerSettings(**kw, extra_args=tuple(extra))


def _set(kw: dict, name: str | None, flag: str | None, value: str | None) -> bool:
    """Set field ``name`` from one flag; False when it is not one this module reads back."""
    if name is None:
        return False
    ints = {"context", "parallel", "port", "main_gpu", "n_cpu_moe", "fit_ctx", "threads", "threads_batch",
            "n_batch", "n_ubatch", "moe_cache_mib", "moe_cache_max_batch", "moe_cache_prefill_ahead",
            "moe_cache_prefill_ahead_min_batch"}
    strs = {"model_path", "alias", "host", "split_mode", "type_k", "type_v", "numa_flag"}
    if name in ints and value is not None:
        kw[name] = int(value)
    elif name in strs and value is not None:
        kw[name] = value
    elif name == "n_gpu_layers" and value is not None:
        kw[name] = ALL_LAYERS if value == "all" else int(value)
    elif name == "tensor_split" and value is not None:
        kw[name] = tuple(float(x) for x in re.split(r"[,/]", value) if x)
    elif name == "tensor_overrides" and value is not None:
        pairs = [item.rsplit("=", 1) for item in value.split(",") if item]
        if any(len(p) != 2 for p in pairs):
            return False
        kw[name] = kw.get(name, ()) + tuple((p, b) for p, b in pairs)
    elif name == "cpu_moe" and value is None:
        kw[name] = True
    elif name in ("metrics", "moe_cache_cpu_misses") and value is None:
        kw[name] = True
    elif name == "moe_cache_prefetch" and value in ("on", "off"):
        kw[name] = value == "on"
    elif name == "moe_cache_device_slots" and value in ("device", "host"):
        kw[name] = value == "device"
    elif name == "fit":
        if value not in (None, "on", "off"):
            return False
        kw[name] = value != "off"
    elif name == "flash_attn" and value in ("on", "off", "auto"):
        kw[name] = value
    elif name == "load_mode" and flag in ("--load-mode", "-lm"):
        modes = {"none": "pinned", "mmap": "mmap", "mlock": "mlock", "mmap+mlock": "mlock"}
        if value not in modes:
            return False
        kw[name] = modes[value]
    elif name == "op_offload_min_batch":
        if flag == "--no-op-offload" and value is None:
            kw[name] = OFFLOAD_NEVER
        elif flag in ("-cuda", "--cuda-params") and value and _OFFLOAD_BATCH.match(value):
            kw[name] = int(_OFFLOAD_BATCH.match(value).group(1))
        else:
            return False
    else:
        return False
    return True



def backend_seen_in(args: Sequence[str], server: str = "llama-server") -> BackendInfo:
    """What a set of flags shows about the binary they were written for, when nothing else tells: the features
    they use (a mainline that knows ``--fit`` also knows ``--load-mode``; ``-cuda`` is ik_llama.cpp's)."""
    flags = {f for f, _v in split_flags(args) if f}
    seen = {"fit": {"--fit", "-fit"}, "load_mode": {"--load-mode", "-lm"}, "no_op_offload": {"--no-op-offload"},
            "metrics": {"--metrics"}, "numa": {"--numa"}, "cuda_params": {"-cuda", "--cuda-params"},
            "moe_cache": {"--moe-cache-mib"}, "moe_cache_cpu_misses": {"--moe-cache-cpu-misses"},
            "moe_cache_prefetch": {"--moe-cache-prefetch"}, "moe_cache_slots": {"--moe-cache-slots"},
            "moe_cache_prefill_ahead": {"--moe-cache-prefill-ahead"},
            "moe_cache_prefill_ahead_min_batch": {"--moe-cache-prefill-ahead-min-batch"}}
    feats = {name for name, spellings in seen.items() if flags & spellings}
    ik = "cuda_params" in feats
    if "fit" in feats and not ik:
        feats.add("load_mode")
    return BackendInfo(server=server, flavor=Flavor.IK if ik else Flavor.MAINLINE, features=frozenset(feats))
