"""llama-server's and numactl's vocabulary, for both flavors: settings to flags and variables and back.

llama-server's flags are declared once, in :mod:`orchestrator.backend.server_options` (spellings, values,
features, the settings field each renders); this module walks that table.
:func:`server_args` / :func:`server_env` render a :class:`~orchestrator.launch.settings.WorkerSettings` for a
:class:`~orchestrator.backend.info.BackendInfo` (what the binary offers decides the spelling: ``--load-mode none``
or ``--no-mmap``, ``--no-op-offload`` or ``-cuda offload-batch-size=N`` or ``GGML_OP_OFFLOAD_MIN_BATCH``);
:func:`parse_server_args` reads a user's flags (a bench ``--config``) back into settings, keeping what it does
not know as extra arguments; :func:`numactl_argv` renders a NUMA policy. Pure: the planner imports it.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from typing import Mapping, Sequence

from orchestrator.backend.info import BackendInfo, Flavor
from orchestrator.backend.server_options import (  # noqa: F401  (the offload constants: re-exported)
    BY_FLAG, IK_MARKERS, OFFLOAD_DEFAULT, OFFLOAD_ENV, OFFLOAD_NEVER, RENDERS, ServerOption, Switch,
    field_flags, long_flag, option,
)
from orchestrator.launch.numa import NumaPolicy
from orchestrator.launch.settings import WorkerSettings
from orchestrator.units import format_cpulist

# every spelling of the flags a WorkerSettings field stands for (the first is the one rendered)
FIELD_FLAGS: dict[str, tuple[str, ...]] = {name: field_flags(name) for name in RENDERS}
LOG_VERBOSITY = long_flag("-lv")      # how much llama-server logs (the bench reads its buffer sizes there)


def log_verbosity_args(level: int | str) -> tuple[str, ...]:
    return (option(LOG_VERBOSITY).flag, str(level))


_FLAG_FIELD = {f: name for name, flags in FIELD_FLAGS.items() for f in flags}
_NEGATIVE_NUMBER = re.compile(r"^-\d")
_DEFAULTS = {f.name: f.default for f in fields(WorkerSettings) if f.default is not MISSING}


def flags_of(*names: str) -> tuple[str, ...]:
    """Every spelling of the flags of these settings fields."""
    return tuple(f for n in names for f in FIELD_FLAGS[n])


# --- settings -> argv / env -------------------------------------------------------------------------------

def _passed(o: ServerOption, s: WorkerSettings, backend: BackendInfo) -> bool:
    """Whether option ``o`` (the one that renders its field) is on the command line of ``s`` for ``backend``."""
    if not o.value.passed(getattr(s, o.field), _DEFAULTS[o.field]):
        return False
    if (o.requires and not backend.has(o.requires)) or (backend.ik and not o.on_ik):
        return False
    return o.within is None or _passed(RENDERS[o.within], s, backend)


def server_args(s: WorkerSettings, backend: BackendInfo) -> tuple[str, ...]:
    """llama-server's own flags (no binary, no wrappers) for ``s`` on ``backend``: every field's option of the
    table (:mod:`orchestrator.backend.server_options`) in its order, then the user's own flags."""
    a: list[str] = []
    for name, o in RENDERS.items():
        if _passed(o, s, backend):
            a += o.value.render(getattr(s, name), o.flag, backend)
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


def canonical(flag: str) -> str:
    """One name for every spelling of a flag (the settings field it sets, or the flag itself)."""
    return _FLAG_FIELD.get(flag, flag)


def parse_server_args(args: Sequence[str], env: Mapping[str, str] | None = None) -> WorkerSettings:
    """A user's llama-server flags (and environment) read into settings. Flags without a field, and values this
    module cannot read back exactly, stay in ``extra_args`` in their order, so rendering runs the same server."""
    env = dict(env or {})
    kw: dict = {name: False for name, o in RENDERS.items() if isinstance(o.value, Switch)}   # absent = off
    extra: list[str] = []
    no_mmap = mlock = False
    for flag, value in split_flags(args):
        o = BY_FLAG.get(flag) if flag else None
        if o is not None and o.long == "--no-mmap" and value is None:
            no_mmap = True
        elif o is not None and o.long == "--mlock" and value is None:
            mlock = True
        elif o is not None and o.field is not None:
            try:
                kw[o.field] = o.value.parse(value, flag, kw.get(o.field))
            except ValueError:
                extra += [t for t in (flag, value) if t is not None]
        else:
            extra += [t for t in (flag, value) if t is not None]
    # --no-mmap and --mlock together: read, then locked
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


def backend_seen_in(args: Sequence[str], server: str = "llama-server") -> BackendInfo:
    """What a set of flags shows about the binary they were written for, when nothing else tells: the features
    they use (a mainline that knows ``--fit`` also knows ``--load-mode``; ``-cuda`` is ik_llama.cpp's)."""
    flags = {f for f, _v in split_flags(args) if f}
    feats = {BY_FLAG[f].feature for f in flags if f in BY_FLAG and BY_FLAG[f].feature}
    ik = bool(feats & IK_MARKERS)
    if "fit" in feats and not ik:
        feats.add("load_mode")
    return BackendInfo(server=server, flavor=Flavor.IK if ik else Flavor.MAINLINE, features=frozenset(feats))
