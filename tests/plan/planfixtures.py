"""Planner fixtures: real model headers and real (recorded or described-on-recorded) machines.

Models: full-size architectures are written as a real GGUF header + tensor index (synth-model's own header
writer) with a *sparse* data region of the real length, so ``read_model`` reads a 400 GB DeepSeek-V3 exactly as
it would the real file while the disk holds a few MB.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from orchestrator.backend.info import BackendInfo, parse_help
from orchestrator.hardware.dump import load_machine
from orchestrator.model import read_model
from orchestrator.model import synth

FIX = Path(__file__).resolve().parents[1] / "fixtures"
MACHINES = FIX / "machines"
_cache: dict = {}


def shape_model(tmp_root: Path, like: str, quant: str = "q4_0", *, scale: float = 1.0, layers: int | None = None):
    key = (like, quant, scale, layers)
    if key in _cache:
        return _cache[key]
    path = tmp_root / f"{like}-{quant}-{scale}-{layers}.gguf"
    synth.write_header_only(path, like, scale=scale, quant=quant, layers=layers)  # sparse: no data on disk
    info = read_model(path)
    _cache[key] = info
    return info


def backend(flavor: str = "mainline", cuda: bool = True) -> BackendInfo:
    text = (FIX / "backend" / ("mainline-llama-server-help.txt" if flavor == "mainline"
                               else "ik-llama-server-help.txt")).read_text()
    fl, feats, modes, gpu = parse_help(text)
    if flavor == "ik_llama.cpp":
        # The recorded help is of a CPU build: ik_llama.cpp prints -ngl/-sm/-ts/-mg only when the build can offload
        # (common.cpp: `if (llama_supports_gpu_offload())`), and never lists -ot although its parser takes it.
        # A CUDA build of the same source offers -sm none|graph|layer.
        feats = feats | {"sm_none", "sm_graph", "sm_layer", "override_tensor"}
        modes, gpu = ("none", "graph", "layer"), True
    return BackendInfo(server="/opt/llama/bin/llama-server", flavor=fl, version="test", cuda=cuda,
                       gpu_offload=gpu, features=feats, split_modes=modes)


def machine(name: str):
    """A machine file under tests/fixtures/machines (recorded, or described/<name>.json)."""
    p = MACHINES / "described" / f"{name}.json"
    if not p.exists():
        p = MACHINES / name
    return load_machine(p)


def with_gpu_free(m, free_bytes: int):
    """The same machine with every GPU's free memory set (a VRAM budget as the bench holds it)."""
    return dataclasses.replace(m, gpus=tuple(dataclasses.replace(g, memory_free_bytes=free_bytes) for g in m.gpus))
