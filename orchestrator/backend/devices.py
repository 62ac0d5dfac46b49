"""Device names: llama.cpp's own, the one spelling orchestrator uses for a device of a worker.

llama.cpp names the devices of one process by backend and index: ``CUDA0``, ``CUDA1`` (the GPUs the process sees,
in ``CUDA_VISIBLE_DEVICES`` order), ``RPC0``, ``RPC1`` (the devices of the ``--rpc`` servers, numbered across the
servers in the order ``--rpc`` lists them), and ``CPU``. Those are the names its logs, ``--list-devices``,
``--device`` and ``-ot`` show a user, and the names a plan writes (per-device memory, layer ranges, bytes read
per token). A worker's ``CUDA1`` is the second GPU it was given, not machine GPU 1: machine GPUs are NVML / PCI
indexes (``gpus`` in a plan and a topology), and the bench keys its per-GPU memory by them (:func:`machine_gpu_key`).

Buffer names in llama.cpp's load log are device names with a suffix: ``CUDA0_Split``; host buffers ``CPU``,
``CPU_Mapped``, ``CPU_REPACK``, ``CUDA_Host`` (pinned host memory); an RPC buffer is ``RPC<i>[HOST:PORT]`` with
``i`` the device's index on *that* server (two one-device servers both log ``RPC0[...]``), so it is told apart
by its endpoint (:func:`device_of_buffer`).

Lower-case spellings (``cuda0``, ``cpu``) are read for the calibration records written with them
(tests/fixtures/calibration); nothing writes them any more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

CPU = "CPU"
CUDA = "CUDA"
RPC = "RPC"
GPU_KINDS = (CUDA, RPC)

_NAME = re.compile(r"(CUDA|RPC|cuda|rpc)(\d+)")
_RPC_BUFFER = re.compile(r"RPC\d*\[([^\]]+)\]")
_CUDA_BUFFER = re.compile(r"CUDA(\d+)(?:_\w+)?")


@dataclass(frozen=True)
class Device:
    """One device of a llama-server process: ``kind`` CUDA, RPC or CPU and, for the first two, its index."""

    kind: str
    index: int | None = None

    @property
    def name(self) -> str:
        return CPU if self.kind == CPU else f"{self.kind}{self.index}"

    @property
    def is_gpu(self) -> bool:
        """A device that holds offloaded layers (a GPU, or a remote backend standing in for one)."""
        return self.kind in GPU_KINDS

    @property
    def pads_rows(self) -> bool:
        """CUDA pads the last row of a quantized weight to 512 elements; an RPC device stores tensors as its
        server's backend does, and the memory model reads RPC servers as the CPU backend they run here."""
        return self.kind == CUDA

    def __str__(self) -> str:
        return self.name


def gpu(index: int, kind: str = CUDA) -> str:
    """The name of a worker's ``index``-th offload device: ``gpu(1)`` -> ``"CUDA1"``, ``gpu(0, RPC)`` -> ``"RPC0"``."""
    if kind not in GPU_KINDS:
        raise ValueError(f"device kind {kind!r}: one of {', '.join(GPU_KINDS)}")
    return f"{kind}{int(index)}"


def parse(name: str) -> Device:
    """``"CUDA1"`` -> Device("CUDA", 1); ``"RPC0"``, ``"CPU"``; the recorded lower-case ``"cuda0"``/``"cpu"`` too."""
    s = str(name)
    if s in (CPU, "cpu"):
        return Device(CPU)
    m = _NAME.fullmatch(s)
    if not m:
        raise ValueError(f"device {s!r}: expected CPU, CUDA<n> or RPC<n>")
    return Device(m.group(1).upper(), int(m.group(2)))


def kind_of(name: str) -> str:
    """The backend of a device name or of a bare kind: ``"CUDA1"``, ``"cuda"`` -> ``"CUDA"``; ``"RPC0"`` ->
    ``"RPC"``; ``"CPU"``, ``"cpu"`` -> ``"CPU"``."""
    s = str(name)
    if s.upper() in (CPU, CUDA, RPC):
        return s.upper()
    return parse(s).kind


def canonical(name: str) -> str:
    """The one spelling of a device name (``"cuda0"`` -> ``"CUDA0"``, ``"cpu"`` -> ``"CPU"``)."""
    return parse(name).name


def is_gpu(name: str) -> bool:
    try:
        return parse(name).is_gpu
    except ValueError:
        return False


def device_of_buffer(buffer: str, rpc_endpoints: Sequence[str] = ()) -> str:
    """The device a llama.cpp buffer lives on: ``"CUDA0_Split"`` -> ``"CUDA0"``; ``"RPC0[127.0.0.1:50053]"`` ->
    ``"RPC1"`` when 127.0.0.1:50053 is the second of ``rpc_endpoints`` (the ``--rpc`` list; each server is taken
    to offer one device, as ``ggml-rpc-server`` on a one-GPU or CPU host does); every host buffer -> ``"CPU"``."""
    m = _RPC_BUFFER.fullmatch(buffer)
    if m:
        endpoint = m.group(1)
        if endpoint in rpc_endpoints:
            return gpu(list(rpc_endpoints).index(endpoint), RPC)
        return f"{RPC}[{endpoint}]"
    m = _CUDA_BUFFER.fullmatch(buffer)
    if m:
        return gpu(int(m.group(1)))
    return CPU


def machine_gpu_key(device: str, gpus: Sequence[int]) -> str:
    """The bench's key for a worker device's memory, by machine GPU: ``"CUDA1"`` of a worker on machine GPUs
    (4, 5) -> ``"gpu5"``, which the per-GPU memory the bench samples (NVML) is keyed by; ``"CPU"`` stays."""
    try:
        d = parse(device)
    except ValueError:
        return str(device)
    if not d.is_gpu:
        return CPU
    i = d.index or 0
    return f"gpu{gpus[i] if i < len(gpus) else i}"
