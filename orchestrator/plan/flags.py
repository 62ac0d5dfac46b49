"""llama-server flags for a planned worker, mainline llama.cpp or ik_llama.cpp (chosen from the detected flavor)."""

from __future__ import annotations

from orchestrator.backend.detect import BackendInfo
from orchestrator.plan.placement import Placement


def render_args(*, backend: BackendInfo, model_path: str, n_ctx: int, parallel: int, placement: Placement,
                n_gpus: int, override: str, main_gpu: int | None, threads: int, threads_batch: int, n_batch: int,
                n_ubatch: int, flash_attn: str, type_k: str, type_v: str, load_mode: str, numa_flag: str,
                op_offload_min_batch: int | None, host: str, port: int, alias: str,
                extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    ik = backend.ik
    a: list[str] = ["-m", model_path, "--alias", alias, "--host", host, "--port", str(port),
                    "-c", str(n_ctx), "-np", str(parallel)]
    if n_gpus:
        n_layers = len(placement.layer_gpu)
        a += ["-ngl", "999" if placement.n_gpu_layers > n_layers else str(placement.n_gpu_layers)]
        if n_gpus > 1:
            a += ["-sm", placement.split_mode]
            if placement.tensor_split:
                a += ["-ts", ",".join(str(x) for x in placement.tensor_split)]
            if main_gpu is not None:
                a += ["-mg", str(main_gpu)]
        if override:
            a += ["-ot", override]
        if op_offload_min_batch is not None and op_offload_min_batch >= (1 << 30) and backend.has("no_op_offload"):
            a.append("--no-op-offload")
        elif ik and op_offload_min_batch is not None and backend.has("cuda_params"):
            a += ["-cuda", f"offload-batch-size={op_offload_min_batch}"]
    else:
        a += ["-ngl", "0"]
    if backend.has("fit") and not ik:
        a += ["--fit", "off"]  # the plan has decided: llama.cpp must not re-fit it
    a += ["-t", str(threads), "-tb", str(threads_batch), "-b", str(n_batch), "-ub", str(n_ubatch)]
    if flash_attn != "auto":
        a += ["-fa", flash_attn]  # both flavors take on|off
    if type_k != "f16":
        a += ["-ctk", type_k]
    if type_v != "f16":
        a += ["-ctv", type_v]
    if load_mode in ("pinned", "mlock"):
        if backend.has("load_mode"):
            a += ["--load-mode", "none" if load_mode == "pinned" else "mlock"]
        else:
            a += ["--no-mmap"] + (["--mlock"] if load_mode == "mlock" else [])
    if numa_flag and backend.has("numa"):
        a += ["--numa", numa_flag]
    if backend.has("metrics"):
        a.append("--metrics")
    a += list(extra)
    return tuple(a)
