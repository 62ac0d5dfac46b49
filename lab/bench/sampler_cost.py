#!/usr/bin/env python3
"""What llama-server's sampler chain costs per generated token, by its settings, at Qwen3's vocabulary.

A generated Qwen3-30B-A3B-shaped model cut to one layer (vocabulary 151936, so the sampler sees the real number of
candidates while the model itself costs little) is served on the CPU; requests of N sampled tokens (temperature 1,
a seed each) alternate between sampler settings for several rounds, and llama-server's own
``timings.predicted_per_token_ms`` is compared with greedy decoding of the same model. The difference is what the
sampler adds to every token of any model with that vocabulary, on that CPU, whatever runs the layers.

Why it matters: ``top_k 0`` leaves every candidate to ``top_p``, which then sorts the whole vocabulary for each
token; with ``top_p 1`` (or llama-server's default ``top_k 40``) nothing is sorted.

usage: lab/bench/sampler_cost.py [--server PATH] [--threads N] [--tokens 64] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

SETTINGS = (
    ("greedy", {"temperature": 0.0}),
    ("server defaults (top_k 40, top_p 0.95, min_p 0.05)", {}),
    ("whole distribution (top_k 0, top_p 1, min_p 0)", {"top_k": 0, "top_p": 1.0, "min_p": 0.0}),
    ("top_k 0 (top_p 0.95 sorts the vocabulary)", {"top_k": 0}),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", help="llama-server (default: the build cache's)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="also print the samples as one JSON line")
    a = ap.parse_args()

    from lab.serverrun import free_port, post_json
    from orchestrator.backend.detect import find_llama_server
    from orchestrator.launch.process import start
    from orchestrator.launch.spec import LaunchSpec
    from orchestrator.model import synth

    server = a.server or find_llama_server(None)[0]
    with tempfile.TemporaryDirectory(prefix="sampler-cost-") as d:
        model = synth.write_model(Path(d) / "vocab-151936.gguf", "qwen3-30b-a3b", layers=1, quant="q4_0",
                                  seed=3).path
        port = free_port()
        argv = [server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "1024", "-np", "1",
                "-ngl", "0", "--no-warmup", *(["-t", str(a.threads)] if a.threads else [])]
        proc = start(LaunchSpec(name="sampler-cost", argv=tuple(argv), host="127.0.0.1", port=port),
                     Path(d) / "llama-server.log")
        try:
            deadline = time.monotonic() + 120
            while proc.health(timeout=2.0) != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    print(f"{server}: llama-server did not come up (log: {d}/llama-server.log)", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            samples: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
            seed = 1
            for _ in range(a.rounds):
                for name, extra in SETTINGS:
                    seed += 1
                    body = {"prompt": [11, 12, 13], "n_predict": a.tokens, "cache_prompt": False,
                            "ignore_eos": True, "temperature": 1.0, "seed": seed, **extra}
                    reply = post_json(f"http://127.0.0.1:{port}/completion", body, timeout=300)
                    samples[name].append(reply["timings"]["predicted_per_token_ms"])
        finally:
            proc.stop(grace=15.0)
    greedy = statistics.median(samples["greedy"])
    print(f"{a.tokens} tokens per request, {a.rounds} rounds interleaved; ms per token, median [min-max]")
    for name, _ in SETTINGS:
        v = samples[name]
        med = statistics.median(v)
        print(f"  {name:52s} {med:7.2f} [{min(v):.2f}-{max(v):.2f}]   sampler +{med - greedy:5.2f} ms")
    if a.json:
        print(json.dumps({"tokens": a.tokens, "rounds": a.rounds, "threads": a.threads, "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
