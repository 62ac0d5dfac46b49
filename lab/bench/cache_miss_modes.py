#!/usr/bin/env python3
"""The expert cache's two miss modes, by their own counters, without a GPU.

A llama-server whose "GPU" is a ggml-rpc-server on 127.0.0.1 (the CPU backend behind ggml's RPC device; see
tests/backend/expert_cache_support.py) runs a generated Qwen3-30B-A3B-shaped model (scale 0.125, q8_0, every
routed expert in host memory) with a cache of 15% and 30% of the experts, at routing locality 0, default and
high, once uploading every miss and once with --moe-cache-cpu-misses. Each run samples 384 tokens (temperature 1,
seed 7: a stream that does not loop) and prints, per expert lookup, the hits, the misses computed on the CPU and
the misses uploaded. Counts, not speed: the RPC device is the CPU.

usage: lab/bench/cache_miss_modes.py [--tokens 384] [--server PATH]   (default: the build cache's llama-server)
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "backend")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--server", help="llama-server built with the patch series and ggml-rpc-server beside it")
    a = ap.parse_args()

    from expert_cache_support import one_completion

    from orchestrator.backend.detect import find_llama_server
    from orchestrator.model import synth
    from orchestrator.model.reader import read_gguf

    server = a.server or find_llama_server(None)[0]
    rpc = str(Path(server).with_name("ggml-rpc-server"))
    with tempfile.TemporaryDirectory(prefix="cache-miss-modes-") as d:
        tmp = Path(d)
        print("locality  cache  slots | upload: hit / cpu / uploaded | cpu misses: hit / cpu / uploaded")
        for name, loc in (("0", 0.0), ("default", None), ("high", 0.92)):
            res = synth.write_model(tmp / f"m-{name}.gguf", "qwen3-30b-a3b", scale=0.125, quant="q8_0", seed=11,
                                    locality=loc, fsync=False)
            experts = [t for t in read_gguf(res.path).tensors
                       if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps", t.name)]
            n_expert = experts[0].shape[-1]
            expert_bytes = experts[0].nbytes // n_expert
            for frac in (0.15, 0.30):
                mib = int(frac * n_expert) * expert_bytes * len(experts) // 2**20
                cols, slots = [], 0
                for mode in ([], ["--moe-cache-cpu-misses"]):
                    _out, m, _log = one_completion(
                        server, rpc, res.path, tmp, "run", ["--moe-cache-mib", str(mib)] + mode,
                        sampling={"n_predict": a.tokens, "temperature": 1.0, "seed": 7, "n_probs": 0})
                    n = m["moe_cache_lookups_total"]
                    cpu = m.get("moe_cache_cpu_misses_total", 0.0)
                    cols.append(f"{m['moe_cache_hits_total'] / n:.3f} / {cpu / n:.3f} / "
                                f"{(m['moe_cache_misses_total'] - cpu) / n:.3f}")
                    slots = int(m["moe_cache_slots"])
                print(f"{name:8s}  {frac:4.0%}  {slots:5d} | {cols[0]:27s} | {cols[1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
