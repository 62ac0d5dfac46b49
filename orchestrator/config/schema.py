"""The topology.yaml schema: one frozen, strict model per concern.

Each field's docstring is its documentation (docs/topology.md is generated from it). A value the user leaves
out is ``"auto"`` (or None where noted): the plan decides it and ``orchestrator plan`` says what it chose and why.
Cross-field checks name the key to change and what to write instead.
"""


from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OWNED_FLAGS: the llama-server flags that topology keys own (each option of the table names its owner): giving
# them in workers.extra_args would fight the plan
from orchestrator.backend.server_options import OWNED_FLAGS
from orchestrator.config.keys import display_key, split_key
from orchestrator.config.types import (
    AUTO, Alias, ArgList, AutoBool, AutoDuration, AutoInt, AutoSize, AutoSizeList, Bool, Choice, CorsOrigins,
    Duration, EnvVarName, FilePath, GpuSelection, Host, Int, ModelPath, Name, Namespace, Port, RayAddress, Text, TiB, fail,
    is_auto, is_remote_model,
)
from orchestrator.units import MiB

# KV cache types llama.cpp accepts for -ctk/-ctv (common/arg.cpp kv_cache_types); q6_0 and q8_KV are
# ik_llama.cpp only (common/common.cpp kv_cache_type_from_str).
KV_TYPES_MAINLINE = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
KV_TYPES_IK_ONLY = ("q6_0", "q8_KV")
KV_TYPES_UNQUANTIZED = ("f32", "f16", "bf16")

MACHINE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".json")


def cross(key: str, message: str) -> None:
    """A cross-field error on ``key`` (dotted, relative to the model that raises it; ``nodes.1.name``)."""
    raise PydanticCustomError("config_cross", "{message}", {"message": message, "key": key})


class Section(BaseModel):
    """Base of every section: frozen, unknown keys are errors, an empty section (``gateway:``) is all defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, validate_default=False)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_defaults(cls, data: Any) -> Any:
        return {} if data is None else data

    def explicit(self, name: str) -> bool:
        """Whether the topology file set this key (rather than leaving the default)."""
        return name in self.model_fields_set


# ------------------------------------------------------------------------------------------------------ model


class ModelConfig(Section):
    """What to serve, and the llama-server settings that belong to the model. Required; `model: FILE.gguf` is
    short for `model: {path: FILE.gguf}`."""

    path: ModelPath("a .gguf file (relative to the topology file's folder), a model URL or a Hugging Face id")
    """The GGUF model file; a relative path is relative to the folder of the topology file. For a model split
    into parts (`…-00001-of-00004.gguf`) give the first part. Or a remote model: an `https://` URL,
    `hf://ORG/REPO/FILE.gguf`, or `ORG/REPO:QUANT` (that quantization's file(s) in a Hugging Face repository):
    `plan` reads only its header over the network; `up` (or `orchestrator pull`) downloads it into the cache
    first (docs/model.md)."""

    context: AutoInt(256, 16_777_216) = AUTO
    """Context size in tokens of each worker, shared by its parallel slots (llama-server `-c`). The plan never
    shrinks a number you give: if it cannot fit, `plan` refuses with the numbers. auto: 8192."""

    parallel: AutoInt(1, 256) = AUTO
    """Parallel request slots per worker (llama-server `-np`); each slot gets context / parallel tokens
    (unless the KV cache is unified). auto: 1."""

    cache_type_k: Choice(AUTO, *KV_TYPES_MAINLINE, *KV_TYPES_IK_ONLY) = AUTO
    """KV cache type for K (`-ctk`). q6_0 and q8_KV exist only in ik_llama.cpp. auto: f16, or q8_0 (with
    flash attention) when an f16 cache would not fit the GPUs."""

    cache_type_v: Choice(AUTO, *KV_TYPES_MAINLINE, *KV_TYPES_IK_ONLY) = AUTO
    """KV cache type for V (`-ctv`). A quantized V cache needs flash attention. auto: the same as K."""

    flash_attn: Choice(AUTO, "on", "off", bools=("on", "off")) = AUTO
    """Flash attention (`-fa on|off|auto`). auto leaves it to llama.cpp, which enables it where supported."""

    alias: Alias = None
    """The model name clients send in the OpenAI API (`"model": …`, listed by `/v1/models`). null: the model
    file's name without `.gguf`."""

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any) -> Any:
        return {"path": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.flash_attn == "off" and self.cache_type_v not in (AUTO, *KV_TYPES_UNQUANTIZED):
            cross("cache_type_v", f"a quantized V cache ({self.cache_type_v}) needs flash attention, but "
                                  "model.flash_attn is off: set flash_attn to on or auto, or cache_type_v to f16")
        return self


# ---------------------------------------------------------------------------------------------------- backend


class BackendConfig(Section):
    """Which llama-server runs the workers."""

    binary: FilePath("a path to a llama-server binary", words=(AUTO,)) = AUTO
    """Path to `llama-server` (mainline llama.cpp or ik_llama.cpp); relative to the topology file's folder.
    auto: `$LLAMA_SERVER`, then `llama-server` on PATH, then orchestrator's own build
    (`orchestrator build`)."""

    flavor: Choice(AUTO, "mainline", "ik_llama.cpp") = AUTO
    """Which llama.cpp the binary is. auto: read from `llama-server --help`. Setting it makes the plan
    refuse a binary of the other flavor, and lets `plan` check flavor-specific keys without the binary."""


# ------------------------------------------------------------------------------------------------------ nodes


class NodeConfig(Section):
    """The machines, one list item each. A node is a Ray node (or this machine); workers are placed on nodes.
    Default: `[{name: local}]`, this machine, discovered."""

    name: Name = "local"
    """A name for the node, unique in the topology; shown in `plan` and `status`."""

    address: Host("the Ray node's IP address or host name", nullable=True) = None
    """The IP address or host name of the Ray node this machine is, used to schedule its workers there. null:
    the machine running orchestrator (at most one node may leave it out)."""

    ray_resource: Text(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", "a Ray custom resource name", nullable=True) = None
    """A Ray custom resource only this node has (`ray start --resources='{"NAME": 1}'`); when set, workers are
    scheduled by it instead of by address. Needed when several Ray nodes share one IP address (e.g. two
    `ray start` on one machine)."""

    machine: FilePath("a recorded machine: a .tar.gz from `orchestrator inspect --save` or a .json from "
                      "`orchestrator inspect --json`", words=("live",), suffixes=MACHINE_SUFFIXES) = "live"
    """What the machine is. live: discovered on the node itself (sysfs, NVML). A path (relative to the topology
    file's folder): a machine recorded with `orchestrator inspect --save FILE.tar.gz` or
    `orchestrator inspect --json > FILE.json`, so a plan can be made for a machine you are not on."""

    gpus: GpuSelection = "all"
    """Which GPUs of this node to use, by NVML index: all, none, one index, a list like [0, 1] or a range like
    "0-3". An index the machine does not have is refused by `plan`."""

    vram_limit: AutoSizeList(256 * MiB, 4 * TiB) = AUTO
    """The most memory the plan may use on each GPU: one size for every GPU, or a list with one size per GPU
    in the order of `gpus`. auto: each GPU's free memory less `vram_reserve`."""

    vram_reserve: AutoSize(0, 1 * TiB) = AUTO
    """Memory left free on each GPU beyond what the memory model predicts (CUDA context and kernels are
    predicted; this is for fluctuation and fragmentation). auto: 256MiB."""

    ram_reserve: AutoSize(0, 64 * TiB) = AUTO
    """Host memory left free on the node for the OS and other processes. auto: 10% of the machine's RAM, at
    least 1GiB and at most 8GiB."""

    @model_validator(mode="after")
    def _check(self) -> "NodeConfig":
        if self.gpus == ():
            for key in ("vram_limit", "vram_reserve"):
                if not is_auto(getattr(self, key)):
                    cross(key, f"{key} is set but gpus is none: remove {key}, or choose GPUs with gpus")
        if isinstance(self.vram_limit, tuple) and isinstance(self.gpus, tuple):
            if len(self.vram_limit) != len(self.gpus):
                cross("vram_limit", f"gives {_count(len(self.vram_limit), 'size')} but gpus lists "
                                    f"{_count(len(self.gpus), 'GPU')} "
                                    "(give one size per GPU, or one size for all)")
        return self


# ---------------------------------------------------------------------------------------------------- workers


class WorkersConfig(Section):
    """How the llama-server workers are laid out and tuned, the same for every worker. Every auto is decided
    by the plan."""

    layout: Choice(AUTO, "machine", "socket", "gpu-group") = AUTO
    """One worker per machine, per CPU socket, or per group of GPUs (`gpu_group_size`). auto: the plan
    chooses from the machine and the model's size; CPU only, one replica per NUMA node or one per socket over
    its nodes, whichever gives the machine more memory bandwidth, when each holds the model."""

    gpu_group_size: AutoInt(1, 64) = AUTO
    """GPUs per worker with layout gpu-group. auto: the GPUs of one socket (by NUMA affinity) per worker."""

    replicas: AutoInt(1, 256) = AUTO
    """How many copies of the layout to run (data parallel; the gateway balances between them). Replicas on
    one machine are spread over its NUMA nodes: each gets its own nodes, their cores and memory, or, with more
    replicas than nodes, its own cores of a node; with fewer cores than replicas they share cores (the plan
    says so). They cannot share GPUs. auto: 1."""

    numa: Choice(AUTO, "bind", "interleave", "none") = AUTO
    """NUMA memory and CPU policy of each worker: bind (numactl --physcpubind to its CPUs + --membind to its
    node: the node nearest its GPU, or a CPU worker's own), interleave (numactl --physcpubind + --interleave over
    its nodes, or over every node when they cannot hold it), or none (no numactl at all: threads and pages
    where the kernel puts them). llama.cpp's --numa is never passed: it resets its threads' CPU affinity.
    auto: bind when the CPU-resident weights fit the node's free memory, else interleave."""

    smt: Choice(AUTO, "on", "off", bools=("on", "off")) = AUTO
    """Use the second hardware thread of each core: on, off (one thread per physical core). auto: off for
    generation threads, on for batch threads."""

    threads: AutoInt(1, 4096) = AUTO
    """Generation threads per worker (`-t`). auto: the physical cores of the bound node or socket."""

    threads_batch: AutoInt(1, 4096) = AUTO
    """Prompt-processing threads per worker (`-tb`). auto: all hardware threads of the bound node or
    socket."""

    disable_numa_balancing: AutoBool = AUTO
    """Turn the kernel's automatic NUMA balancing off while the workers run (restored afterwards; needs root,
    otherwise a warning). auto: on machines with more than one NUMA node."""

    op_offload_min_batch: AutoInt(1, 1 << 20, words=("off",)) = AUTO
    """Smallest batch for which llama.cpp copies CPU-resident weights to the GPU to compute there
    (`GGML_OP_OFFLOAD_MIN_BATCH`); off: never (`--no-op-offload`). auto: where copying over the measured PCIe
    bandwidth costs less than computing on the CPU."""

    batch: AutoInt(1, 1 << 17) = AUTO
    """Logical batch size (`-b`). auto: 2048, or the micro-batch when that is larger."""

    ubatch: AutoInt(1, 1 << 17) = AUTO
    """Physical micro-batch size (`-ub`), at most `batch`. auto: the one of 512, 1024, 2048, 4096 with the
    least predicted mean time for a 512- and a 4096-token prompt each answered with 256 tokens, the fastest
    generation among those within 1% of it (a bigger micro-batch speeds long prompts up, but its compute buffer
    takes VRAM that could hold experts or the expert cache); objective prompt or balanced weigh it as they say."""

    split_mode: Choice(AUTO, "none", "layer", "row", "tensor", "graph") = AUTO
    """How a worker with several GPUs splits the model (`-sm`): none, layer, row and tensor (mainline),
    graph (ik_llama.cpp). auto: the plan chooses for the detected flavor."""

    load_mode: Choice(AUTO, "mmap", "pinned", "mlock") = AUTO
    """How CPU-resident weights are loaded: mmap (page cache), pinned (read into pinned host buffers, no mmap;
    fastest GPU copies), mlock (mmap locked in RAM). auto: pinned when RAM allows, else mmap."""

    objective: Choice("generation", "balanced", "prompt") = "generation"
    """What the split of VRAM between whole expert layers and the expert cache, and the micro-batch, favour:
    generation (the fastest predicted generation within 3% of the best, then the most whole layers), prompt (the
    fastest predicted prompts: the most whole layers, unless prompts read the cached experts from the slots, when
    every split copies about the same and generation decides), or balanced (the best geometric mean of the two,
    each relative to its best). Generation is that of `model.parallel` streams decoding together: with several
    parallel slots, their aggregate tokens/s (they share the cache's slots, and a batch needs the union of their
    experts). `plan` prints one stream's and the streams' generation and the time to first token at 512 and 4096
    tokens."""

    expert_cache: AutoSize(MiB, 4 * TiB, words=("off",)) = AUTO
    """VRAM for the expert cache (`--moe-cache-mib`: GPU slots for the experts of layers whose experts stay in
    host memory, used for generation). off: no cache; a size: a cache of that size, whole expert layers in the
    rest. auto: when the llama-server has the cache and some expert layers stay in host memory, the plan splits
    the VRAM by the model's routing profile (`orchestrator model MODEL --routing`; a stated default curve
    without one), the measured PCIe bandwidth and the objective, and keeps no cache where it would lose."""

    expert_cache_misses: Choice(AUTO, "upload", "cpu") = "upload"
    """What the expert cache does with an expert a batch needs that is not in its slots: upload (copy it
    into a slot over PCIe), cpu (`--moe-cache-cpu-misses`: an expert not
    used recently enough to stay in a cache of this size is computed on the CPU from host memory while the GPU
    computes the cached ones; one used again soon enough is uploaded), or auto (whichever the plan predicts
    faster from the host-memory and PCIe bandwidths and the shares the model's routing profile replays; without
    a profile, upload). upload by default: where it was measured, over a fast PCIe link, the CPU path ran slower
    than uploading, and auto, which carries its measured costs, never chose it there (measured: docs/benchmarks.md,
    "Misses computed on the CPU"). The cache is this project's patch of
    llama.cpp; upstream has none merged (late 2026), and one that lands is driven through the flags its
    `--help` shows."""

    expert_cache_prefetch: Choice(AUTO, "on", "off", bools=("on", "off")) = AUTO
    """Uploads ahead of need (`--moe-cache-prefetch on`, this project's patch of llama.cpp; qwen3moe models):
    while a layer computes, the experts the next layer's router would pick from this layer's hidden state are
    uploaded into that layer's slots on a second CUDA stream. auto: on where the plan predicts it faster, from the
    share of misses it turns into hits, the uploads it adds and the share of their link time hidden behind
    compute, each measured (where they were measured, the hit rate rose but the uploads stayed on the critical path
    and generation was slower, so auto keeps them off there; the measured shares and their runs:
    orchestrator/_data/rates.json, `PREFETCH_*`). on / off force it where the cache is planned."""

    expert_cache_slots: Choice(AUTO, "device", "host") = AUTO
    """Where a decode step's experts are given cache slots (`--moe-cache-slots`, this project's patch of
    llama.cpp). host: llama-server reads each cached layer's expert ids back and assigns the slots on the CPU, a
    round trip to the host per layer and token. device: each layer's slot table lives in GPU memory and a CUDA
    kernel assigns the slots and copies the misses from pinned host memory, with no round trip (faster generation
    than host with the same hits; the measured costs per layer and their runs: orchestrator/_data/rates.json,
    `CACHE_LAYER_OVERHEAD_HOST_S` and `CACHE_LAYER_OVERHEAD_DEVICE_S`). auto: device where it
    can work (a CUDA build that has the option, one GPU per worker, weights in pinned memory: `load_mode` not mmap,
    misses uploaded, no uploads ahead of need), host otherwise. llama-server itself falls back to host, with a
    warning, where the device cannot."""

    expert_cache_staging: Choice(AUTO, "on", "off", bools=("on", "off")) = AUTO
    """Prompts' uncached experts copied ahead (`--moe-cache-prefill-ahead 2`, this project's patch of llama.cpp):
    when a prompt's micro-batch runs a host-resident expert layer on the GPU and uses nearly all its experts, the
    ones the cache's slots do not hold are copied into one of two staging buffers on a second CUDA stream while the
    layers before it compute, instead of when the layer starts. The buffers (one expert tensor's device copy each)
    come out of the cache's VRAM, so generation has a few slots fewer: against the same cache without it, prompts
    ran faster for about the same generation (measured: docs/benchmarks.md, "The whole workload"). A router
    repeats its picks across neighbouring tokens, so a short prompt uses fewer experts than uniform routing says,
    and staged it copies unused ones: a short prompt took longer staged. Where the model's routing was measured
    (`orchestrator model MODEL --routing`), micro-batches smaller than the window that uses all but a sixteenth of
    the experts under it are not staged (`--moe-cache-prefill-ahead-min-batch`, whose value `plan` prints).
    auto: on where the plan predicts it worth the slots for the objective (a CUDA build that has the option, one
    GPU per worker, weights in pinned memory, micro-batches large enough to use nearly every expert); on / off
    force it where the cache is planned."""

    live_routing: Choice("off", "on", bools=("on", "off")) = "off"
    """Learn the model's routing from what the deployment serves. on: every worker's llama-server keeps the
    experts its router picked for the last 2048 tokens it generated (`--router-trace 2048`, this project's patch
    of llama.cpp; a ring of 2048 x MoE layers x top-k x 2 bytes), and `up` reads them every 2 minutes and when it
    stops, and caches their routing profile as the model's: the next `plan` and `up` size the expert cache from
    it, as from `orchestrator model MODEL --routing`. `status` shows each worker's live hit rate beside the
    predicted one either way. Off by default: while it records, decoding waits for each layer's router picks
    (a synchronization per MoE layer and token) and `--moe-cache-cpu-misses` uploads every miss instead."""

    warmup: Bool = False
    """Before `up` starts the workers: drop the page cache (needs root; otherwise it is kept, with a note) and
    read the model once under each local worker's own NUMA policy, so memory-mapped weights land on the nodes
    that will read them. Off by default: dropping caches affects every process on the machine."""

    prefetch: Bool = True
    """While the Ray head starts, ask the kernel to read the model into the page cache, so a cold start does not
    wait for Ray and then for the disk. Skipped (with a note) for a memory-mapped model on several NUMA nodes,
    where the pages must land where the workers read them (use warmup), and for a model larger than 80% of the
    available memory. Pages already cached cost nothing."""

    early_start: Bool = True
    """Start each llama-server as soon as the plan is made, while the embedded Ray head and the actors start, so
    its load overlaps them; its worker actor then adopts it (a small keeper process holds it until then and stops
    it if `up` or that actor dies). Only with `ray.address: local`; otherwise the worker actor starts it."""

    host: Host("an IP address or host name", nullable=True) = None
    """Address each llama-server listens on. null: 127.0.0.1 when the worker runs where the gateway runs,
    else the node's address."""

    port_base: Port() = 8081
    """Port of the first worker on a node; the next ones use the following ports."""

    extra_args: ArgList = ()
    """Extra arguments appended to every llama-server command line, one list item per argument (never split by
    a shell). Flags that a topology key controls are refused here: set the key instead."""

    @model_validator(mode="after")
    def _check(self) -> "WorkersConfig":
        if isinstance(self.batch, int) and isinstance(self.ubatch, int) and self.ubatch > self.batch:
            cross("ubatch", f"ubatch {self.ubatch} is larger than batch {self.batch}: set ubatch ≤ batch")
        if not is_auto(self.gpu_group_size) and self.layout not in (AUTO, "gpu-group"):
            cross("gpu_group_size", f"only applies to layout gpu-group, but layout is {self.layout}: remove "
                                    "gpu_group_size or set layout: gpu-group")
        for i, arg in enumerate(self.extra_args):
            flag = arg.split("=", 1)[0] if arg.startswith("--") else arg
            if flag in OWNED_FLAGS:
                key = OWNED_FLAGS[flag]
                what = ("placement is decided by the plan; steer it with " if key.startswith("nodes[]")
                        else "set ")
                cross(f"extra_args.{i}", f"{flag} is controlled by the topology: {what}{key} instead")
        return self


# ---------------------------------------------------------------------------------------------------- gateway


class GatewayConfig(Section):
    """The one OpenAI-compatible endpoint in front of all workers."""

    host: Host() = "127.0.0.1"
    """Address the gateway listens on. Use 0.0.0.0 to serve other machines (set api_key_env then)."""

    port: Port() = 8080
    """Port the gateway listens on."""

    api_key_env: EnvVarName = None
    """Name of an environment variable holding the API key clients must send (`Authorization: Bearer KEY`);
    the key itself never goes in the topology. null: no key."""

    cors_origins: CorsOrigins = "localhost"
    """Web pages that may call the gateway from a browser (CORS): localhost (pages served by this machine), *
    (any page), or a comma-separated list of origins. null: none. A preflight is answered without the key."""

    processes: AutoInt(1, 64) = AUTO
    """Gateway processes sharing the port (SO_REUSEPORT; the kernel spreads connections over them), each
    balancing by its own in-flight counts. More than one helps only when one event loop cannot keep up with
    the replicas' streamed tokens (what one relays is measured in docs/benchmarks.md, "`orchestrator up` and the
    gateway"); where it was measured, four processes added latency (docs/benchmarks.md, "Choices of the planner").
    auto: 1."""


# -------------------------------------------------------------------------------------------------------- ray


class RayConfig(Section):
    """The Ray cluster that runs the controller, the workers and the gateway."""

    address: RayAddress = "local"
    """local: start a private Ray head on this machine (stopped by `down`). auto: the running cluster
    `ray start` made here. HOST:PORT or ray://HOST:PORT: that cluster."""

    dashboard_host: Host() = "127.0.0.1"
    """Address of the Ray dashboard of a local head (metrics are shown there)."""

    dashboard_port: Port() = 8265
    """Port of the Ray dashboard of a local head."""

    metrics_export_port: Port(auto=True) = AUTO
    """Port of the Prometheus metrics endpoint of a local head. auto: Ray picks a free one (shown by
    `status`)."""

    namespace: Namespace = "orchestrator"
    """Ray namespace of the controller and its actors; two deployments on one cluster need two namespaces."""

    start_timeout: AutoDuration(10, 86400) = AUTO
    """How long a local Ray head may take to start. The same scale sets how long an actor may wait to be placed
    (half of it) and Ray's own waits for its agents and raylet (a quarter each, through
    RAY_agent_register_timeout_ms and RAY_raylet_start_wait_time_s unless they are set). auto: 120s on an idle
    machine, longer in proportion to its load (the 1-minute load average per CPU, up to 10x). An emulated
    guest or a slow disk starts Ray slowly without a high load: give it a duration there, e.g. 10m."""

    @model_validator(mode="after")
    def _check(self) -> "RayConfig":
        if self.address != "local":
            for key in ("dashboard_host", "dashboard_port", "metrics_export_port"):
                if self.explicit(key):
                    cross(key, f"only applies to a local Ray head (ray.address: local), but address is "
                               f"{self.address!r}: the cluster's dashboard is set where it was started; "
                               f"remove {key}")
        return self


# ---------------------------------------------------------------------------------------------------- restart


class RestartConfig(Section):
    """How workers are watched (`/health`) and restarted when they crash or hang."""

    max_restarts: Int(0, 1000) = 5
    """Restarts of one worker before it is given up (its state and last error stay in `status`)."""

    reset_after: Duration(1, 86400) = 300.0
    """A worker healthy for this long has its restart count reset."""

    backoff_initial: Duration(0, 3600) = 1.0
    """Wait before the first restart; doubled after each failed start."""

    backoff_max: Duration(0, 3600) = 30.0
    """Longest wait between restarts."""

    startup_timeout: Duration(1, 86400) = 1800.0
    """How long llama-server may take to load the model and answer `/health`."""

    health_interval: Duration(0.1, 600) = 2.0
    """Time between `/health` checks of a running worker."""

    health_timeout: Duration(0.1, 600) = 5.0
    """A `/health` check slower than this fails."""

    health_failures: Int(1, 100) = 3
    """Consecutive failed checks after which a worker is deemed hung and restarted."""

    stop_timeout: Duration(0.1, 600) = 10.0
    """After SIGTERM, how long a worker may take to exit before SIGKILL."""

    @model_validator(mode="after")
    def _check(self) -> "RestartConfig":
        if self.backoff_initial > self.backoff_max:
            cross("backoff_initial", f"backoff_initial ({self.backoff_initial:g}s) is longer than backoff_max "
                                     f"({self.backoff_max:g}s): lower it or raise backoff_max")
        return self


# --------------------------------------------------------------------------------------------------- topology


class Topology(Section):
    """A whole deployment: the model, the machines, and how to run it (topology.yaml)."""

    model: ModelConfig
    """What to serve."""

    backend: BackendConfig = BackendConfig()
    """Which llama-server runs the workers."""

    nodes: tuple[NodeConfig, ...] = (NodeConfig(),)
    """The machines, each a Ray node. Default: this machine, discovered (`[{name: local}]`)."""

    workers: WorkersConfig = WorkersConfig()
    """How the llama-server workers are laid out and tuned."""

    gateway: GatewayConfig = GatewayConfig()
    """The OpenAI-compatible endpoint."""

    ray: RayConfig = RayConfig()
    """The Ray cluster."""

    restart: RestartConfig = RestartConfig()
    """Health checks and restarts."""

    _source: str | None = PrivateAttr(default=None)
    _locations: Any = PrivateAttr(default=None)

    @field_validator("nodes")
    @classmethod
    def _some_nodes(cls, nodes: tuple) -> tuple:
        if not nodes:
            fail("got an empty list (expected at least one node; leave nodes out to use this machine)")
        return nodes

    @model_validator(mode="after")
    def _check(self) -> "Topology":
        self._check_nodes()
        self._check_backend()
        self._check_ports()
        return self

    def _check_nodes(self) -> None:
        names: dict[str, int] = {}
        places: dict[tuple, int] = {}
        for i, node in enumerate(self.nodes):
            if node.name in names:
                cross(f"nodes.{i}.name", f"'{node.name}' is already the name of nodes[{names[node.name]}]: "
                                         "node names must be unique")
            names[node.name] = i
            place = (node.address, node.ray_resource)
            if place in places:
                j = places[place]
                if node.address is None and node.ray_resource is None:
                    cross(f"nodes.{i}.address", f"nodes[{j}] and nodes[{i}] both leave address out, so both "
                                                "mean this machine: give each node its Ray node's address")
                cross(f"nodes.{i}.address", f"nodes[{j}] has the same address"
                                            + ("" if node.ray_resource is None else " and ray_resource")
                                            + ": give each node its own address, or set ray_resource when two Ray "
                                              "nodes share an address")
            places[place] = i
        if len(self.nodes) > 1 and self.ray.address == "local":
            cross("ray.address", f"{len(self.nodes)} nodes need a Ray cluster, but ray.address is local (a private "
                                 "Ray on this machine): set ray.address to the cluster's HOST:PORT, or auto")
        if all(n.gpus == () for n in self.nodes):
            w = self.workers
            if w.layout == "gpu-group":
                cross("workers.layout", "gpu-group needs GPUs, but every node has gpus: none: use layout "
                                        "machine or socket, or give a node GPUs")
            if w.split_mode not in (AUTO, "none"):
                cross("workers.split_mode", f"split_mode {w.split_mode} splits a model across GPUs, but every "
                                            "node has gpus: none: remove split_mode")

    def _check_backend(self) -> None:
        flavor, w, m = self.backend.flavor, self.workers, self.model
        if w.split_mode == "graph" and flavor == "mainline":
            cross("workers.split_mode", "split_mode graph exists only in ik_llama.cpp, but backend.flavor is "
                                        "mainline: use tensor or layer, or an ik_llama.cpp binary")
        if w.split_mode in ("row", "tensor") and flavor == "ik_llama.cpp":
            cross("workers.split_mode", f"split_mode {w.split_mode} is mainline llama.cpp only, but "
                                        "backend.flavor is ik_llama.cpp: use graph or layer")
        if w.split_mode == "tensor" and m.flash_attn == "off":
            cross("model.flash_attn", "split_mode tensor needs flash attention, but model.flash_attn is off: "
                                      "set it to on or auto, or use another split_mode")
        if flavor == "mainline":
            for key in ("cache_type_k", "cache_type_v"):
                if getattr(m, key) in KV_TYPES_IK_ONLY:
                    cross(f"model.{key}", f"{getattr(m, key)} is an ik_llama.cpp cache type, but backend.flavor "
                                          f"is mainline: use one of {', '.join(KV_TYPES_MAINLINE)}")

    def _check_ports(self) -> None:
        g, w, r = self.gateway, self.workers, self.ray
        if g.port == w.port_base:
            cross("gateway.port", f"port {g.port} is also workers.port_base: give the gateway another port")
        if r.address == "local" and g.port == r.dashboard_port:
            cross("gateway.port", f"port {g.port} is also ray.dashboard_port: give the gateway another port")
        if r.address == "local" and w.port_base == r.dashboard_port:
            cross("workers.port_base", f"port {w.port_base} is also ray.dashboard_port: choose another "
                                       "port_base")

    # ------------------------------------------------------------------------------------------ public helpers

    @property
    def source(self) -> str | None:
        """The topology file this was read from (None when built in code)."""
        return self._source

    def where(self, key: str | tuple) -> str:
        """``FILE:LINE`` of a dotted key (``"nodes.0.gpus"``) or of its nearest ancestor the file spells out."""
        path = split_key(key)
        src = self._source or "<topology>"
        if self._locations is not None and self._locations.is_replaced(path):
            return f"{src} (from --set)"       # the value came from the command line, not from a line of the file
        line = self._locations.line_of(path) if self._locations is not None else None
        return f"{src}:{line}" if line else src

    def error(self, key: str | tuple, message: str):
        """A ConfigError pointing at ``key``: for checks that need the machine or the model (a GPU index the
        machine lacks, a context that cannot fit), made by the planner: ``raise topo.error("nodes.0.gpus",
        "GPU 3 does not exist (the machine has GPUs 0-1)")``."""
        from orchestrator.errors import ConfigError

        return ConfigError(f"{self.where(key)}: {display_key(split_key(key))}: {message}")

    def check_files(self) -> None:
        """Raise ConfigError for the first file the topology names that does not exist (the model, a recorded
        machine, an explicit binary). Separate from loading, so a topology can be checked elsewhere."""
        import os

        wanted: list[tuple[str, str, str]] = [] if is_remote_model(self.model.path) else [
            ("model.path", self.model.path, "model file")]   # a remote model is downloaded by up / pull
        if self.backend.binary != AUTO:
            wanted.append(("backend.binary", self.backend.binary, "llama-server binary"))
        for i, node in enumerate(self.nodes):
            if node.machine != "live":
                wanted.append((f"nodes.{i}.machine", node.machine, "recorded machine"))
        for key, path, what in wanted:
            if not os.path.exists(path):
                raise self.error(key, f"{what} {path} does not exist")
            if os.path.isdir(path):
                raise self.error(key, f"{what} {path} is a directory, not a file")
        if self.backend.binary != AUTO and not os.access(self.backend.binary, os.X_OK):
            raise self.error("backend.binary", f"{self.backend.binary} is not executable")

    def override(self, changes: "dict[str, Any]") -> "Topology":
        """A new Topology with dotted keys changed (``{"nodes.0.vram_limit": "12GiB", "workers.threads": 8}``),
        validated exactly like the file: for bench sweeps and command-line overrides. Keys the file left out
        stay decided by the plan. Raises ConfigError naming the key."""
        from orchestrator.config.validation import validate_changes

        return validate_changes(self, changes)

    def to_dict(self) -> dict:
        """Plain JSON-able dict (sizes in bytes, durations in seconds, paths absolute); loading it again
        (as YAML or through ``Topology.model_validate``) gives an equal Topology."""
        return self.model_dump(mode="json")

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig, "backend": BackendConfig, "nodes": NodeConfig, "workers": WorkersConfig,
    "gateway": GatewayConfig, "ray": RayConfig, "restart": RestartConfig,
}
