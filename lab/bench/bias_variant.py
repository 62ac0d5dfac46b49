#!/usr/bin/env python3
"""The plan with its experts' biases kept on the GPU, as a bench configuration (``orchestrator bench --config``).

    python3 lab/bench/bias_variant.py PLAN.json [NAME]

PLAN.json is `orchestrator plan ... --json`. The plan's -ot sends every routed-expert tensor of its host-resident
layers to host memory, gpt-oss's ``ffn_*_exps.bias`` too, and with the expert cache each bias's ADD_ID then runs on
the CPU between the layer's GPU splits (lab/bench/expert_bias_splits.py counts them). The variant anchors the
pattern at ``.weight``: the expert weights stay in host memory for the cache, the biases (a few MiB a layer) go to
the GPU with the rest of the layer. Everything else is the plan's (lab/device/plan-config.py renders it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def weights_only(pattern: str) -> str:
    """``blk\\.(0|1)\\.ffn_(...)_(ch|)exps=CPU`` -> ``blk\\.(0|1)\\.ffn_(...)_(ch|)exps\\.weight=CPU``."""
    rx, sep, buft = pattern.rpartition("=")
    if not sep or not rx.endswith("exps"):
        raise SystemExit(f"-ot {pattern!r}: not the plan's expert override (PATTERN_exps=BUFFER)")
    return f"{rx}\\.weight={buft}"


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    plan, name = Path(argv[0]), argv[1] if len(argv) > 1 else "plan-biases-gpu"
    try:
        args = json.loads(plan.read_text())["workers"][0]["args"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"{plan}: not a plan document with a worker ({e})")
    if "-ot" not in args:
        raise SystemExit(f"{plan}: the plan keeps every expert on the GPU (no -ot): nothing to vary")
    new = weights_only(args[args.index("-ot") + 1])
    out = subprocess.run([sys.executable, str(REPO / "lab" / "device" / "plan-config.py"), name, str(plan),
                          f"--replace=-ot={new}"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr.strip() or f"plan-config.py failed ({out.returncode})")
    print(out.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
