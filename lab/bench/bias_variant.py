#!/usr/bin/env python3
"""The plan with its experts' biases placed the other way, as a bench configuration (``orchestrator bench --config``).

    python3 lab/bench/bias_variant.py PLAN.json [NAME]

PLAN.json is `orchestrator plan ... --json`. With the expert cache the plan's -ot moves only the weights of its
host-resident layers' routed experts (``..._exps\\.weight=CPU``): gpt-oss's ``ffn_*_exps.bias`` stay on the GPU, so
each bias's ADD_ID runs there. The variant of such a plan is llama.cpp's --cpu-moe placement, every routed-expert
tensor in host memory, biases too: each ADD_ID then runs on the CPU between the layer's GPU splits
(lab/bench/expert_bias_splits.py counts them); its default name is plan-biases-cpu. A plan whose -ot moves every
routed-expert tensor (no cache) gets the weights-only pattern instead (plan-biases-gpu). Everything else is the
plan's (lab/device/plan-config.py renders it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "\\.weight"


def toggled(pattern: str) -> tuple[str, str]:
    """The plan's expert override with the biases' placement the other way, and the variant's default name."""
    rx, sep, buft = pattern.rpartition("=")
    if rx.endswith("exps" + WEIGHTS):
        return f"{rx[:-len(WEIGHTS)]}={buft}", "plan-biases-cpu"
    if not sep or not rx.endswith("exps"):
        raise SystemExit(f"-ot {pattern!r}: not the plan's expert override (PATTERN_exps[\\.weight]=BUFFER)")
    return f"{rx}{WEIGHTS}={buft}", "plan-biases-gpu"


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    plan = Path(argv[0])
    try:
        args = json.loads(plan.read_text())["workers"][0]["args"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"{plan}: not a plan document with a worker ({e})")
    if "-ot" not in args:
        raise SystemExit(f"{plan}: the plan keeps every expert on the GPU (no -ot): nothing to vary")
    new, name = toggled(args[args.index("-ot") + 1])
    name = argv[1] if len(argv) > 1 else name
    out = subprocess.run([sys.executable, str(REPO / "lab" / "device" / "plan-config.py"), name, str(plan),
                          f"--replace=-ot={new}"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr.strip() or f"plan-config.py failed ({out.returncode})")
    print(out.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
