#!/usr/bin/env python3
"""Benchmark: how fast `orchestrator synth-model` writes a full-size model, next to the disk's own speed.

Prints three numbers for the same byte count:
  dd          sequential write of zeros with `dd ... conv=fdatasync` (what the disk can do)
  synth-model the real writer: header, tokenizer, every tensor, fsync, rename (GB/s of file bytes)
  raw random  one random 64 MiB buffer written over and over, then fsync (the disk with non-zero bytes)
  generator   the same tensor data written to /dev/null (the writer's CPU-side ceiling)
Every file it writes is deleted afterwards (also on error or Ctrl-C).

usage: lab/bench/synth_write.py [--like qwen3-30b-a3b] [--quant q4_0] [--dir DIR] [--dd-bytes N]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.model import shapes, synth  # noqa: E402


def dd_speed(path: Path, nbytes: int) -> tuple[float, float]:
    """(GB/s, seconds) of a sequential dd write of ``nbytes`` with fdatasync at the end."""
    bs = 64 << 20
    count = max(1, nbytes // bs)
    argv = ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "conv=fdatasync"]
    try:
        t0 = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True)
        secs = time.monotonic() - t0
    finally:
        path.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise SystemExit(f"dd failed: {proc.stderr.strip()}")
    m = re.search(r"^(\d+) bytes", proc.stderr, re.M)
    written = int(m.group(1)) if m else bs * count
    return written / secs / 1e9, secs


def raw_random_speed(path: Path, nbytes: int) -> tuple[float, float]:
    """(GB/s, seconds) writing one 64 MiB random buffer over and over, then fsync: the disk with non-zero data
    (some virtual disks store zeros for free, which flatters dd)."""
    import numpy as np

    buf = np.random.default_rng(0).integers(0, 256, size=64 << 20, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.monotonic()
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(buf)[:min(left, len(buf))])
        os.fsync(fd)
        secs = time.monotonic() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return nbytes / secs / 1e9, secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default=None, help="q4_0 or q8_0 (default: the model's)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--dir", type=Path, default=Path("."), help="directory on the disk to measure (default .)")
    ap.add_argument("--dd-bytes", type=int, default=0, help="bytes for dd (default: the model's size)")
    ap.add_argument("--skip-dd", action="store_true")
    a = ap.parse_args()

    shape = shapes.scaled(shapes.get(a.like), a.scale, layers=a.layers)
    specs = shapes.tensor_specs(shape, a.quant)
    size = shapes.total_bytes(specs)
    print(f"model: {a.like} {a.quant or shape.default_quant} scale {a.scale} ({shapes.describe(shape)}), {size / 1e9:.2f} GB of tensors")
    print(f"disk:  {a.dir.resolve()} ({os.cpu_count()} CPUs)")

    # 1. generator alone
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        t0 = time.monotonic()
        n = synth.write_data(fd, specs)
        gen_s = time.monotonic() - t0
    finally:
        os.close(fd)
    gen = n / gen_s / 1e9

    # 2. the real writer
    out = a.dir / f".bench-synth-{os.getpid()}.gguf"
    try:
        res = synth.write_model(out, a.like, scale=a.scale, quant=a.quant, layers=a.layers)
        file_bytes = res.bytes
        real_s = res.seconds
    finally:
        out.unlink(missing_ok=True)
        Path(str(out) + ".part").unlink(missing_ok=True)
    real = file_bytes / real_s / 1e9

    # 3. dd, and the same with random bytes
    if not a.skip_dd:
        dd, dd_s = dd_speed(a.dir / f".bench-dd-{os.getpid()}.tmp", a.dd_bytes or file_bytes)
        rnd, rnd_s = raw_random_speed(a.dir / f".bench-raw-{os.getpid()}.tmp", a.dd_bytes or file_bytes)
    print()
    print(f"{'what':12} {'GB':>8} {'seconds':>9} {'GB/s':>7}")
    if not a.skip_dd:
        print(f"{'dd':12} {(a.dd_bytes or file_bytes) / 1e9:>8.2f} {dd_s:>9.1f} {dd:>7.2f}   (zeros, conv=fdatasync)")
        print(f"{'raw random':12} {(a.dd_bytes or file_bytes) / 1e9:>8.2f} {rnd_s:>9.1f} {rnd:>7.2f}"
              f"   (one random 64 MiB buffer rewritten, fsync)")
    print(f"{'synth-model':12} {file_bytes / 1e9:>8.2f} {real_s:>9.1f} {real:>7.2f}")
    print(f"{'generator':12} {n / 1e9:>8.2f} {gen_s:>9.1f} {gen:>7.2f}   (to /dev/null)")
    if not a.skip_dd:
        print(f"synth-model / dd = {real / dd:.2f}, synth-model / raw random = {real / rnd:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
