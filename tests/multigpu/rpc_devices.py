"""Two GPUs without a GPU: a described machine whose GPUs are local ``ggml-rpc-server`` processes.

llama.cpp's RPC backend presents each device of a ``ggml-rpc-server`` as an offload device (``RPC0``, ``RPC1``, in
``--rpc`` order); a server on 127.0.0.1 runs ggml's CPU backend behind it. ``-sm layer``, ``-ts``, ``-mg``, ``-ot``,
op offload (``GGML_OP_OFFLOAD_MIN_BATCH``) and the expert cache treat them as they treat CUDA0 and CUDA1.

The plan is made for a described machine with two GPUs (the recorded dev-vm's CPUs and memory, two H200s
described on top) and a backend that says it offloads: the plan is the one a CUDA build gets. Each GPU's memory
is the CUDA context and pool the memory model charges a GPU at the plan's micro-batch plus ``stand_in`` bytes: a
stand-in of that size for the VRAM, which the plan must place within. ``ggml-rpc-server`` of the pinned llama.cpp
has no memory limit of its own (its device reports the host's memory): the limit is the plan's, and the tests
check what each server really allocated against it.

What each server holds is read three ways: llama.cpp's load log (buffers per device, ``-v``: the device of every
layer's KV cache, i.e. the layer ranges), the server process's resident memory, and the bytes its TCP connection
received (``ss``), which grow with every expert the cache uploads into that device's slots.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.backend.detect import detect_backend
from orchestrator.bench.logparse import parse_load_log
from orchestrator.hardware.dump import load_machine
from orchestrator.hardware.topology import Gpu, Machine
from orchestrator.model.info import ModelInfo
from orchestrator.model.routing_profile import HitCurve
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan import buffers as M
from tests.backend.expert_cache_support import PROMPT, _healthy, _listening, _port, _start, _stop, _wait, metrics_of

FIX = Path(__file__).resolve().parents[1] / "fixtures"
MiB = 1 << 20
N_PREDICT = 64
UBATCH = 512                 # fixed, so the CUDA overhead the machine's GPUs carry is the one the plan charges
STAND_IN_GPU = "NVIDIA H200"  # whose rates (memory bandwidth, FLOPs) the plan uses for the stand-ins
STAND_IN = 90 * MiB        # per GPU: room for the always-used weights, KV, compute, 3 of 12 expert layers and a cache
# A routing profile as local in time as real models' (the default curve has the same shape): the test model is so
# small that the plan's per-layer costs, fitted on an H200, would otherwise keep the cache off. The tokens do not
# depend on it; it makes the plan choose a cache, as it does for real models at real sizes.
LOCAL_ROUTING = HitCurve((0.0, 0.1, 0.25, 1.0), (0.0, 0.9, 0.97, 1.0), "stated: local routing for the RPC tests")


def described_machine(model: ModelInfo, n_gpus: int, stand_in: int) -> Machine:
    """The dev VM's CPUs, NUMA and memory with ``n_gpus`` described GPUs of ``stand_in`` usable bytes each."""
    m = load_machine(FIX / "machines" / "dev-vm.tar.gz")
    vram = M.cuda_overhead(model, UBATCH) + stand_in
    node = m.numa_nodes[0]
    gpus = tuple(Gpu(index=i, name=STAND_IN_GPU, uuid=None, pci=f"0000:{0x41 + 0x10 * i:02x}:00.0", vendor="nvidia",
                     numa_node=node.id, memory_bytes=vram, memory_free_bytes=vram, pcie_gen=5, pcie_width=16,
                     pcie_gen_max=5, pcie_width_max=16, local_cpus=node.cpus, compute_capability="9.0",
                     source="described: a ggml-rpc-server stands in") for i in range(n_gpus))
    return dataclasses.replace(m, gpus=gpus, hostname=f"rpc-x{n_gpus}")


def offloading_backend(server: str):
    """The real binary's facts, offloading as a CUDA build's would (the RPC devices are its GPUs)."""
    return dataclasses.replace(detect_backend(server), cuda=True)


def plan_for(model: ModelInfo, server: str, n_gpus: int, stand_in: int):
    """The plan's one worker for ``n_gpus`` stand-in GPUs of ``stand_in`` bytes each (1024 tokens, -ub 512)."""
    req = PlanRequest(context=1024, ubatch=UBATCH, nodes=(NodeRequest(name="rpc", vram_reserve=0),))
    machine = described_machine(model, n_gpus, stand_in)
    return make_plan(machines={"rpc": machine}, model=model, request=req, backend=offloading_backend(server),
                     routing=LOCAL_ROUTING).workers[0]


@dataclass
class RpcDevice:
    endpoint: str
    proc: subprocess.Popen
    log: Path

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024

    def bytes_received(self) -> int:
        """Bytes the server's client connections received so far (TCP_INFO bytes_received, read by ``ss``)."""
        out = subprocess.run(["ss", "-tinH", "state", "established", "sport", "=", f":{self.port}"],
                             capture_output=True, text=True, check=True).stdout
        return sum(int(x) for x in re.findall(r"bytes_received:(\d+)", out))


@contextmanager
def rpc_devices(rpc_server: str, n: int, tmp: Path):
    """``n`` fresh ggml-rpc-servers on 127.0.0.1 (one CPU thread each), stopped on exit."""
    assert shutil.which("ss"), "ss (iproute2) is needed to read the RPC connections' byte counters"
    devs: list[RpcDevice] = []
    try:
        for i in range(n):
            port = _port()
            log = tmp / f"rpc{i}.log"
            proc = _start([rpc_server, "-H", "127.0.0.1", "-p", str(port), "-t", "1"], log)
            devs.append(RpcDevice(f"127.0.0.1:{port}", proc, log))
        for d in devs:
            _wait(lambda: _listening(d.port), 60, "ggml-rpc-server", d.log, d.proc)
        yield devs
    finally:
        for d in devs:
            _stop(d.proc)


@dataclass
class Run:
    """One llama-server run of a plan's argv on RPC devices: its answer and what each device held and received."""

    answer: dict
    metrics: dict
    log: str
    endpoints: list[str]
    rss_before: list[int]
    rss_loaded: list[int]
    received: list[int]                      # bytes each device received while the completion ran
    layer_device: dict[int, str] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.answer["tokens"]

    def buffers(self) -> dict[str, dict[str, int]]:
        """Per device (RPC0, RPC1, CPU): bytes of weights, KV and compute buffers as llama.cpp logged them."""
        return parse_load_log(self.log).by_device(self.endpoints)

    def cache_bytes(self) -> int:
        r = parse_load_log(self.log)
        return r.expert_cache["bytes"] if r.expert_cache else 0


_KV_DEV = re.compile(r"llama_kv_cache: layer\s+(\d+): dev = (\S+)")


def rpc_argv(server: str, args: list[str] | tuple[str, ...], endpoints: list[str], port: int) -> list[str]:
    """A plan's llama-server argv on RPC devices: the plan's flags as they are (its port replaced), then
    ``--rpc`` (the devices, in the plan's device order), ``--no-repack`` (without it llama.cpp repacks the
    host-resident weights for the CPU into a buffer the expert cache does not read from; a CUDA build keeps them
    in CUDA_Host, pinned, instead), ``-v`` (the device of every layer) and ``--no-warmup``."""
    a = list(args)
    a[a.index("--port") + 1] = str(port)
    return [server, *a, "--rpc", ",".join(endpoints), "--no-repack", "-v", "--no-warmup"]


def run_plan(server: str, args, env: dict, devs: list[RpcDevice], tmp: Path, name: str,
             n_predict: int = N_PREDICT) -> Run:
    """Start the plan's llama-server on ``devs``, answer one greedy completion of PROMPT, stop it."""
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"{name}.log"
    endpoints = [d.endpoint for d in devs]
    rss_before = [d.rss() for d in devs]
    # the plan's env (the op-offload threshold) as it is; CUDA_VISIBLE_DEVICES means nothing to a CPU build
    with open(log, "w") as lf:
        proc = subprocess.Popen(rpc_argv(server, args, endpoints, port), stdout=lf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **env}, start_new_session=True)
    try:
        _wait(lambda: _healthy(url), 300, "llama-server", log, proc)
        rss_loaded = [d.rss() for d in devs]
        before = [d.bytes_received() for d in devs]
        body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0.0, "n_probs": 0, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.loads(r.read())
        received = [d.bytes_received() - b for d, b in zip(devs, before)]
        metrics = metrics_of(url)
        rss_after = [d.rss() for d in devs]
    finally:
        _stop(proc)
    text = log.read_text()
    run = Run(answer, metrics, text, endpoints, rss_before, [max(a, b) for a, b in zip(rss_loaded, rss_after)],
              received)
    run.layer_device = {int(i): dev for i, dev in _KV_DEV.findall(text)}
    return run
