"""orchestrator synth-model: write a synthetic GGUF shaped like a real MoE model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from orchestrator.sigutil import terminate_as_interrupt

HELP = "Write a synthetic GGUF shaped like a real MoE model (random weights, real routing behaviour)"
DESCRIPTION = """\
Write OUT.gguf with exactly the tensor names, shapes, types and metadata of a real MoE model's Q4_0/Q8_0 file
(--like), random but sane weights whose routing spreads over the experts like a trained model's, and a
byte-level BPE tokenizer llama-server accepts. --scale shrinks width and depth for tests; --layers sets the
depth at full width (a big model's per-layer shape on a small disk). The file is written as OUT.gguf.part and
renamed when complete; nothing is left behind on error or Ctrl-C. Shapes: qwen3-30b-a3b, qwen3-235b-a22b
(qwen3moe), deepseek-v3, kimi-k2 (deepseek2: MLA, dense leading layers, shared expert, sigmoid routing with
a correction bias, expert groups for DeepSeek-V3), gpt-oss-120b, gpt-oss-20b (gpt-oss: MXFP4 experts,
attention sinks, sliding window), glm-4.5-air, glm-4.5 (glm4moe: q/k/v biases, partial RoPE, sigmoid routing,
shared expert, dense leading layers). --locality sets how much consecutive tokens share experts (every
family; the default is calibrated so that an LRU expert cache hits like it does on Qwen3-30B-A3B; 0: every
token routes independently)."""


def _locality(text: str) -> float:
    from orchestrator.model.synth import LOCALITY_LEVELS

    if text in LOCALITY_LEVELS:
        return LOCALITY_LEVELS[text]
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {', '.join(LOCALITY_LEVELS)} or a number in [0, 1), "
                                         f"got {text!r}") from None
    if not (0.0 <= v < 1.0):
        raise argparse.ArgumentTypeError(f"expected 0 <= L < 1, got {text}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0.0 < v <= 1.0):
        raise argparse.ArgumentTypeError(f"expected 0 < scale <= 1, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, nargs="?", metavar="OUT.gguf", help="file to write")
    p.add_argument("--like", metavar="NAME", help="real model to imitate (see --list)")
    p.add_argument("--scale", type=_positive_float, default=1.0, metavar="F",
                   help="shrink width and depth by F (0 < F <= 1; default 1: the full-size shape)")
    p.add_argument("--layers", type=int, metavar="N", help="number of layers (after --scale); full width kept")
    p.add_argument("--quant", choices=["q4_0", "q8_0"], default=None,
                   help="type of the quantized weights (default: q4_0; gpt-oss: q8_0 around its MXFP4 experts, "
                        "as in the released file)")
    p.add_argument("--expert-quant", choices=["q4_0", "q8_0", "mxfp4"], default=None,
                   help="type of the routed experts where it differs from --quant's (default: --quant; gpt-oss: "
                        "mxfp4), e.g. gpt-oss's experts in q4_0 beside its q8_0 attention")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed and options: same file)")
    p.add_argument("--dry-run", action="store_true", help="print the shape and the file size, write nothing")
    p.add_argument("--list", action="store_true", help="list the model shapes and exit")
    p.add_argument("--check-routing", action="store_true",
                   help="afterwards, measure expert routing through llama.cpp (512 and 8 random tokens)")
    p.add_argument("--threads", type=int, help="CPU threads for --check-routing (default: all)")
    p.add_argument("--locality", type=_locality, default=None, metavar="L",
                   help="routing locality in time: off (0, tokens route independently), default (Qwen3-30B-A3B's "
                        "LRU hit rates within 3 points at full width; at an eighth of the width more local), high, or "
                        "a number in [0, 1): about the share of the "
                        "router's input that comes from a slowly varying context component (default: 'default')")


def run(args: argparse.Namespace) -> int:
    from orchestrator.errors import ModelError
    from orchestrator.model import shapes
    from orchestrator.units import fmt_bytes

    if args.list:
        for name in shapes.names():
            print(f"{name:18} {shapes.describe(shapes.SHAPES[name])}")
        return 0
    if not args.like:
        raise ModelError(f"--like is required; valid names: {', '.join(shapes.names())}")
    if args.out is None and not args.dry_run:
        raise ModelError("give the output file name (OUT.gguf)")
    shape = shapes.with_expert_quant(shapes.scaled(shapes.get(args.like), args.scale, layers=args.layers),
                                     args.expert_quant)
    from orchestrator.model import synth

    locality = synth.default_locality(shape) if args.locality is None else args.locality
    synth.locality_plan(shape, locality)   # a locality this shape cannot have is an error before any work
    specs = shapes.tensor_specs(shape, args.quant)
    size = shapes.total_bytes(specs)
    print(f"{shape.like}: {shapes.describe(shape)}; {len(specs)} tensors, {fmt_bytes(size)} of weights; "
          f"routing locality {locality:g}", file=sys.stderr)
    if args.dry_run:
        print(size)
        return 0

    tty = sys.stderr.isatty()
    t0 = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < (0.5 if tty else 10.0) and done < total:
            return
        last[0] = now
        rate = done / max(now - t0, 1e-6) / 1e9
        msg = f"writing {args.out.name}: {100 * done // max(total, 1)}% ({fmt_bytes(done)}, {rate:.2f} GB/s)"
        print(("\r" + msg.ljust(70)) if tty else msg, end="" if tty else "\n", file=sys.stderr, flush=True)

    try:
        # SIGTERM and SIGHUP clean up like Ctrl-C: the partial file is removed
        with terminate_as_interrupt():
            res = synth.write_model(args.out, args.like, scale=args.scale, quant=args.quant, seed=args.seed,
                                    layers=args.layers, progress=progress, locality=locality,
                                    expert_quant=args.expert_quant)
    finally:
        if tty:
            print(file=sys.stderr)
    print(f"wrote {res.path} ({fmt_bytes(res.bytes)}) in {res.seconds:.1f}s, {res.gbps:.2f} GB/s", file=sys.stderr)
    print(res.path)
    if args.check_routing:
        from orchestrator.model import routing

        rep = routing.measure(res.path, threads=args.threads)
        print(routing.format_report(rep), file=sys.stderr)
        problems = routing.check(rep)
        for p in problems:
            print(f"routing: {p}", file=sys.stderr)
        if problems:
            raise ModelError(f"{res.path}: routing check failed in {len(problems)} layer(s)")
        print("routing check: ok", file=sys.stderr)
    return 0
