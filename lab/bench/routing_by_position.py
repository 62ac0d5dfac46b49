#!/usr/bin/env python3
"""An LRU expert cache's hit rate by the position of the token in its context, from a decode-order routing trace.

    python lab/bench/routing_by_position.py MODEL.gguf [--tokens 1024] [--slots 46,38] [--sample T] [--threads N]
                                            [--gpu-layers N]

The routing profile the plan reads (`orchestrator model M --routing`) averages one context of 1024 tokens; the
bench's generation (tg128 at depth 0) decodes positions 1-128 of a fresh context, twice. Where a model's routing
is more local in some positions than in others, the two differ. This traces MODEL once (random token ids, or with
--sample the model's own tokens after one random id, as llama-server samples them) and prints, per slot count of a
layer's bank, the per-layer LRU hit rate over every position, over position windows, and over the windows' picks
that are not a layer's first use of an expert ("warm": what a cache that already held them would add), and how many
of its experts a token shares with the one before it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from orchestrator.model.routing_profile import Trace, lru_distances  # noqa: E402

WINDOWS = ((1, 129), (129, 257), (257, 513), (513, 1024))
COLD = np.iinfo(np.int64).max


def by_position(trace: Trace, slots: int, windows=WINDOWS) -> dict:
    """{"all": hit rate, "windows": [(start, end, hit rate, warm hit rate, overlap with the previous token)]} of an
    LRU per layer with ``slots`` slots over ``trace`` (windows past the trace's end left out)."""
    d = lru_distances(trace, "lru-layer")
    hit = d < slots
    warm = d != COLD
    ids = trace.ids
    k = trace.n_expert_used
    out = []
    for a, b in windows:
        if b > trace.n_tokens:
            continue
        h, w = hit[a:b], warm[a:b]
        shared = [len(set(ids[t, li]) & set(ids[t - 1, li])) / k for t in range(a, b) for li in range(ids.shape[1])]
        out.append((a, b, float(h.mean()), float(h[w].mean()) if w.any() else 1.0, float(np.mean(shared))))
    return {"all": float(hit.mean()), "windows": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--slots", default="", help="slots per layer, comma-separated (default: 30%% and 36%% of the experts)")
    ap.add_argument("--sample", type=float, help="temperature: the model's own tokens after one random id")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--gpu-layers", type=int, default=0, help="layers on the GPU (a CUDA build: a faster trace)")
    a = ap.parse_args()
    from orchestrator.errors import OrchestratorError
    from orchestrator.model import routing

    try:
        tr = routing.trace(a.model, tokens=a.tokens, sample=a.sample, threads=a.threads, ngl=a.gpu_layers)
    except OrchestratorError as e:
        raise SystemExit(str(e))
    slots = [int(s) for s in a.slots.split(",") if s] or [round(0.30 * tr.n_expert), round(0.36 * tr.n_expert)]
    print(f"{a.model}: {tr.n_tokens} tokens in decode order, MoE layers {list(tr.layers)}, {tr.n_expert} experts, "
          f"top {tr.n_expert_used}")
    for s in slots:
        r = by_position(tr, s)
        print(f"{s} slots a layer ({s / tr.n_expert:.1%}): every position {r['all']:.1%}")
        for lo, hi, h, w, ov in r["windows"]:
            print(f"  positions {lo:4d}-{hi - 1:4d}: hits {h:.1%} (not counting first uses {w:.1%}); "
                  f"experts shared with the token before {ov:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
