"""llama-server's options, each declared once: the table every other place reads.

One :class:`ServerOption` per llama-server flag this project writes, reads or recognizes: its spellings (the first
is the one rendered), how its value is written and read back (:class:`Value`, with its unit), the ``--help`` text
that shows a binary has it (``feature``: the name :class:`~orchestrator.backend.info.BackendInfo` carries), the
:class:`~orchestrator.launch.settings.WorkerSettings` field its value comes from, when it is passed, and the
topology key that owns it. Derived from this table:

* :func:`orchestrator.launch.llama_args.server_args` / ``parse_server_args``: settings -> argv -> settings, the
  options in table order (the first option of a field renders it; later ones of that field are the other
  spellings its value writes per flavor, read back by the parser);
* :data:`orchestrator.backend.info.FEATURES`: feature detection from ``llama-server --help``;
* :data:`OWNED_FLAGS`: the flags a topology's ``workers.extra_args`` may not give (a topology key decides them);
* :func:`field_flags`, :func:`long_flag`: every spelling of a settings field, one name per flag.

Pure data and pure functions: no imports from the rest of the package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

ALL_LAYERS = 999              # -ngl value meaning "every layer" (more than any model has)
OFFLOAD_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"
OFFLOAD_DEFAULT = 32          # llama.cpp's op-offload threshold when nothing sets it
OFFLOAD_NEVER = 1 << 30       # larger than any batch: host-resident weights are never copied to the GPU
SLOT_ASSIGNMENTS = ("host", "device")   # --moe-cache-slots: where the expert cache gives a batch's experts slots
PLACEMENT = "nodes[].gpus / nodes[].vram_limit"   # the owner of the flags that place weights: the plan decides


class Binary(Protocol):
    """What rendering needs to know of a binary (a :class:`~orchestrator.backend.info.BackendInfo`)."""

    @property
    def ik(self) -> bool: ...

    def has(self, feature: str) -> bool: ...


# --- values: how one option's value is written on the command line and read back --------------------------------

@dataclass(frozen=True)
class Value:
    """A value written as the word after the flag (``-c 8192``). ``unit``: what the number counts."""

    unit: str = ""

    def passed(self, v: Any, default: Any) -> bool:
        """Whether a settings value is passed at all: anything but the field's default (llama.cpp's own applies)."""
        return v != default

    def render(self, v: Any, flag: str, binary: Binary) -> tuple[str, ...]:
        return (flag, str(v))

    def parse(self, text: str | None, flag: str, current: Any) -> Any:
        """The settings value of ``flag text``; ValueError when this module cannot read it back exactly (the flag
        then stays in ``extra_args``). ``current``: what earlier flags of the same field set."""
        if text is None:
            raise ValueError(f"{flag} needs a value")
        return text


@dataclass(frozen=True)
class Int(Value):
    def parse(self, text, flag, current):
        return int(super().parse(text, flag, current))


@dataclass(frozen=True)
class Layers(Int):
    """-ngl: a count, or "all" (read as :data:`ALL_LAYERS`)."""

    def parse(self, text, flag, current):
        return ALL_LAYERS if text == "all" else super().parse(text, flag, current)


@dataclass(frozen=True)
class Choice(Value):
    choices: tuple[str, ...] = ()

    def parse(self, text, flag, current):
        if text not in self.choices:
            raise ValueError(f"{flag} takes {'|'.join(self.choices)}")
        return text


@dataclass(frozen=True)
class Switch(Value):
    """A flag without a value, passed when its field is true."""

    def passed(self, v, default):
        return bool(v)

    def render(self, v, flag, binary):
        return (flag,)

    def parse(self, text, flag, current):
        if text is not None:
            raise ValueError(f"{flag} takes no value")
        return True


@dataclass(frozen=True)
class OnOff(Value):
    """A boolean written ``on``/``off``; ``bare``: the flag alone means on."""

    bare: bool = False

    def render(self, v, flag, binary):
        return (flag, "on" if v else "off")

    def parse(self, text, flag, current):
        if text is None and self.bare:
            return True
        if text not in ("on", "off"):
            raise ValueError(f"{flag} takes on|off")
        return text == "on"


@dataclass(frozen=True)
class Numbers(Value):
    """-ts: numbers separated by commas (or slashes, read back)."""

    def render(self, v, flag, binary):
        return (flag, ",".join(str(int(x)) if float(x).is_integer() else str(x) for x in v))

    def parse(self, text, flag, current):
        return tuple(float(x) for x in re.split(r"[,/]", super().parse(text, flag, current)) if x)


@dataclass(frozen=True)
class Overrides(Value):
    """-ot: ``pattern=buffer`` pairs separated by commas; every occurrence adds to the list (the first match wins)."""

    def render(self, v, flag, binary):
        return (flag, ",".join(f"{pattern}={buft}" for pattern, buft in v))

    def parse(self, text, flag, current):
        pairs = [item.rsplit("=", 1) for item in super().parse(text, flag, current).split(",") if item]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{flag} takes PATTERN=BUFFER pairs")
        return tuple(current or ()) + tuple((p, b) for p, b in pairs)


@dataclass(frozen=True)
class LoadMode(Value):
    """How weights are read (``mmap`` | ``pinned`` | ``mlock``): ``--load-mode none|mlock`` where the binary has
    it, else ``--no-mmap`` and ``--mlock`` (read back together by the parser)."""

    WORDS = {"none": "pinned", "mmap": "mmap", "mlock": "mlock", "mmap+mlock": "mlock"}

    def render(self, v, flag, binary):
        if binary.has("load_mode"):
            return (flag, "none" if v == "pinned" else "mlock")
        return ("--no-mmap",) + (("--mlock",) if v == "mlock" else ())

    def parse(self, text, flag, current):
        if text not in self.WORDS:
            raise ValueError(f"{flag} takes {'|'.join(self.WORDS)}")
        return self.WORDS[text]


@dataclass(frozen=True)
class OffloadBatch(Value):
    """The batch from which host-resident weights are copied to the GPU: ``--no-op-offload`` for never where the
    binary has it, ik_llama.cpp's ``-cuda offload-batch-size=N``, else only the environment
    (:data:`OFFLOAD_ENV`, written by ``llama_args.server_env``)."""

    def render(self, v, flag, binary):
        if v >= OFFLOAD_NEVER and binary.has("no_op_offload"):
            return (flag,)
        if binary.ik and binary.has("cuda_params"):
            return ("-cuda", f"offload-batch-size={v}")
        return ()

    def parse(self, text, flag, current):
        if text is not None:
            raise ValueError(f"{flag} takes no value")
        return OFFLOAD_NEVER


@dataclass(frozen=True)
class CudaParams(Value):
    """ik_llama.cpp's ``-cuda`` list: only ``offload-batch-size=N`` alone is read back."""

    def parse(self, text, flag, current):
        m = re.fullmatch(r"offload-batch-size=(\d+)", text or "")
        if not m:
            raise ValueError(f"{flag} {text}: only offload-batch-size=N is read back")
        return int(m.group(1))


@dataclass(frozen=True)
class Unread(Value):
    """A spelling of a field that is never read back (it stays in ``extra_args`` as written)."""

    def parse(self, text, flag, current):
        raise ValueError(f"{flag} is not read back")


# --- the table ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerOption:
    """One llama-server flag.

    ``flags``: its spellings, the rendered one first. ``field``: the WorkerSettings field it writes (None: the
    project recognizes it but does not render it from settings). ``value``: how its value is written and read
    back. ``feature``: the BackendInfo feature its presence in ``--help`` sets (``help``: the text that shows it,
    default the first long spelling). ``requires``: the feature a binary must have for it to be passed;
    ``on_ik``: False when ik_llama.cpp is never told it; ``within``: the field whose option must be passed too
    (the expert cache's own options go only with a cache). ``ik_only``: only ik_llama.cpp has it, so seeing it
    tells the flavor. ``owner``: the topology key that decides it (``extra_args`` may not give it).
    """

    flags: tuple[str, ...]
    field: str | None = None
    value: Value = Value()
    feature: str | None = None
    help: str | None = None
    requires: str | None = None
    on_ik: bool = True
    within: str | None = None
    ik_only: bool = False
    owner: str | None = None

    @property
    def flag(self) -> str:
        """The spelling rendered."""
        return self.flags[0]

    @property
    def long(self) -> str:
        """One name for every spelling: the first long one."""
        return next((f for f in self.flags if f.startswith("--")), self.flags[0])

    @property
    def help_text(self) -> str:
        return self.help or self.long


def _opt(*flags: str, **kw: Any) -> ServerOption:
    return ServerOption(tuple(flags), **kw)


_CACHE = {"within": "expert_cache_mib"}   # the expert cache's own options go only with a cache

# In rendering order: the order here is the order of the argv (tests/plan/golden holds it).
OPTIONS: tuple[ServerOption, ...] = (
    # the model and the endpoint
    _opt("-m", "--model", field="model_path", owner="model.path"),
    _opt("--alias", "-a", field="alias", owner="model.alias"),
    _opt("--host", field="host", owner="workers.host"),
    _opt("--port", field="port", value=Int(), owner="workers.port_base"),
    _opt("-c", "--ctx-size", field="context", value=Int("tokens"), owner="model.context"),
    _opt("-np", "--parallel", field="parallel", value=Int("slots"), owner="model.parallel"),
    # placement: the plan decides it
    _opt("-ngl", "--n-gpu-layers", "--gpu-layers", field="n_gpu_layers", value=Layers("layers"), owner=PLACEMENT),
    _opt("-sm", "--split-mode", field="split_mode", owner="workers.split_mode"),
    _opt("-ts", "--tensor-split", field="tensor_split", value=Numbers("proportions"), owner=PLACEMENT),
    _opt("-mg", "--main-gpu", field="main_gpu", value=Int("GPU"), owner=PLACEMENT),
    _opt("-ot", "--override-tensor", field="tensor_overrides", value=Overrides(), feature="override_tensor",
         owner=PLACEMENT),
    _opt("--cpu-moe", "-cmoe", field="cpu_moe", value=Switch(), feature="cpu_moe", owner=PLACEMENT),
    _opt("--n-cpu-moe", "-ncmoe", field="n_cpu_moe", value=Int("layers"), feature="n_cpu_moe", owner=PLACEMENT),
    _opt("--no-op-offload", field="op_offload_min_batch", value=OffloadBatch("tokens"), feature="no_op_offload",
         owner="workers.op_offload_min_batch"),
    _opt("--op-offload", field="op_offload_min_batch", value=Unread(), owner="workers.op_offload_min_batch"),
    _opt("-cuda", "--cuda-params", field="op_offload_min_batch", value=CudaParams("tokens"), feature="cuda_params",
         ik_only=True),
    # the expert cache (this project's patch series, native/llama.cpp-patches)
    _opt("--moe-cache-mib", field="expert_cache_mib", value=Int("MiB"), feature="expert_cache",
         requires="expert_cache", owner="workers.expert_cache"),
    _opt("--moe-cache-max-batch", field="expert_cache_max_batch", value=Int("tokens"), owner="workers.expert_cache",
         **_CACHE),
    _opt("--moe-cache-cpu-misses", field="expert_cache_cpu_misses", value=Switch(), feature="expert_cache_cpu_misses",
         requires="expert_cache_cpu_misses", owner="workers.expert_cache_misses", **_CACHE),
    _opt("--moe-cache-prefetch", field="expert_cache_prefetch", value=OnOff(), feature="expert_cache_prefetch",
         requires="expert_cache_prefetch", owner="workers.expert_cache_prefetch", **_CACHE),
    _opt("--moe-cache-slots", field="expert_cache_slots", value=Choice(choices=SLOT_ASSIGNMENTS),
         feature="expert_cache_slots", requires="expert_cache_slots", owner="workers.expert_cache_slots", **_CACHE),
    _opt("--moe-cache-prefill-ahead", field="expert_cache_stage_buffers", value=Int("staging buffers"),
         feature="expert_cache_staging", requires="expert_cache_staging", owner="workers.expert_cache_staging",
         **_CACHE),
    _opt("--moe-cache-prefill-ahead-min-batch", field="expert_cache_stage_min_batch", value=Int("tokens"),
         feature="expert_cache_stage_min_batch", requires="expert_cache_stage_min_batch",
         within="expert_cache_stage_buffers", owner="workers.expert_cache_staging"),
    _opt("--moe-cache-prefill", feature="expert_cache_slot_reads"),
    # llama.cpp's own automatic placement (mainline only)
    _opt("--fit", "-fit", field="fit", value=OnOff(bare=True), feature="fit", requires="fit",
         on_ik=False, owner=PLACEMENT),
    _opt("--fit-ctx", "-fitc", field="fit_ctx", value=Int("tokens"), requires="fit", on_ik=False),
    _opt("-fitt", "--fit-target", feature="fit_target", owner=PLACEMENT),
    _opt("--fit-margin", feature="fit_margin"),
    _opt("-dev", "--device", owner=PLACEMENT),
    # CPU side, batches, the KV cache
    _opt("-t", "--threads", field="threads", value=Int("threads"), owner="workers.threads"),
    _opt("-tb", "--threads-batch", field="threads_batch", value=Int("threads"), feature="threads_batch",
         owner="workers.threads_batch"),
    _opt("-b", "--batch-size", field="n_batch", value=Int("tokens"), owner="workers.batch"),
    _opt("-ub", "--ubatch-size", field="n_ubatch", value=Int("tokens"), owner="workers.ubatch"),
    _opt("-fa", "--flash-attn", field="flash_attn", value=Choice(choices=("on", "off", "auto")),
         feature="flash_attn", owner="model.flash_attn"),
    _opt("-ctk", "--cache-type-k", field="type_k", owner="model.cache_type_k"),
    _opt("-ctv", "--cache-type-v", field="type_v", owner="model.cache_type_v"),
    _opt("--load-mode", "-lm", field="load_mode", value=LoadMode(), feature="load_mode", owner="workers.load_mode"),
    _opt("--mmap", field="load_mode", value=Unread(), owner="workers.load_mode"),
    _opt("--no-mmap", field="load_mode", value=Unread(), feature="no_mmap", owner="workers.load_mode"),
    _opt("--mlock", field="load_mode", value=Unread(), feature="mlock", owner="workers.load_mode"),
    _opt("--numa", field="numa_flag", feature="numa", requires="numa", owner="workers.numa"),
    _opt("--metrics", field="metrics", value=Switch(), feature="metrics", requires="metrics"),
    _opt("-C", "--cpu-mask"),
    _opt("--cpu-range", feature="cpu_range"),
    _opt("--no-host", feature="no_host"),
    _opt("--kv-unified", feature="kv_unified"),
    # the endpoint's key: the gateway's
    _opt("--api-key", owner="gateway.api_key_env"),
    _opt("--api-key-file", owner="gateway.api_key_env"),
    # rendered by their own callers (the deployment, the bench)
    _opt("--router-trace", value=Int("tokens"), feature="router_trace", owner="workers.live_routing"),
    _opt("-lv", "--log-verbosity", "--verbosity", value=Int()),
    # ik_llama.cpp's own: any of them tells the flavor
    _opt("--mla-use", feature="mla", ik_only=True),
    _opt("--merge-qkv", feature="merge_qkv", ik_only=True),
    _opt("--attention-max-batch", feature="attn_max_batch", ik_only=True),
    _opt("--graph-reuse", feature="graph_reuse", ik_only=True),
    _opt("--split-mode-graph-scheduling", feature="split_mode_graph_scheduling", ik_only=True),
    _opt("--offload-policy", feature="offload_policy"),
)

BY_FLAG: dict[str, ServerOption] = {f: o for o in OPTIONS for f in o.flags}
BY_FEATURE: dict[str, ServerOption] = {o.feature: o for o in OPTIONS if o.feature}
# the option that renders each field: its first in the table
RENDERS: dict[str, ServerOption] = {}
for _o in OPTIONS:
    if _o.field is not None:
        RENDERS.setdefault(_o.field, _o)
del _o
IK_MARKERS = frozenset(o.feature for o in OPTIONS if o.ik_only)
OWNED_FLAGS: dict[str, str] = {f: o.owner for o in OPTIONS if o.owner for f in o.flags}


def option(flag: str) -> ServerOption:
    """The option of a spelling; KeyError for a flag the table does not hold."""
    return BY_FLAG[flag]


def field_flags(field: str) -> tuple[str, ...]:
    """Every spelling of the flags that write settings field ``field``, the rendered one first."""
    return tuple(f for o in OPTIONS if o.field == field for f in o.flags)


def long_flag(flag: str) -> str:
    """The long spelling of a flag (``-ngl`` -> ``--n-gpu-layers``); a flag the table does not hold stays itself."""
    o = BY_FLAG.get(flag)
    return o.long if o else flag


def help_pattern(o: ServerOption) -> str:
    """The regular expression that finds ``o``'s ``--help`` text as a flag of its own (not inside a longer one)."""
    return r"(?:^|[\s,])" + re.escape(o.help_text) + r"(?![\w-])"
