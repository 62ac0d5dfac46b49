"""Benchmark of the model reader and memory model; prints numbers (for docs/benchmarks.md).

    python -m lab.modelbench [--calibration tests/fixtures/calibration/cpu ...]

1. Header read time of full-size models (sparse files, generated): DeepSeek-V3 (671 B parameters, 360 GiB at
   Q4_0/Q8_0) split into 9 shards, Qwen3-235B-A22B and gpt-oss-120b -- target: under 1 s.
2. Time to reject bad input (empty, text, truncated, absurd counts, directory, missing) -- target: under 1 s.
3. Predicted vs measured memory for every calibration case (target: within 3 % or 256 MiB per device).
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.errors import ModelError
from lab.calibmodels import PRESETS, build, variant
from orchestrator.model.reader import read_model
from orchestrator.model.writer import encode_preamble, encode_str, write_gguf, write_gguf_split


def _time(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_read(tmp: Path) -> list[tuple[str, str, float]]:
    rows = []
    for preset, shards in (("deepseek-v3", 9), ("qwen3-235b-a22b", 3), ("gpt-oss-120b", 1)):
        md, ts = build(PRESETS[preset])
        if shards > 1:
            paths = write_gguf_split(tmp / preset, md, ts, shards)
            first = paths[0]
        else:
            first = str(tmp / f"{preset}.gguf")
            write_gguf(first, md, ts)
        m = read_model(first)
        desc = (f"{len(m.paths)} file(s), {m.file_bytes / 2**30:.0f} GiB, {len(m.tensors)} tensors, "
                f"{m.params_total / 1e9:.1f} B params ({m.params_active / 1e9:.1f} B active)")
        rows.append((preset, desc, _time(lambda: read_model(first))))
    return rows


def bench_bad(tmp: Path) -> list[tuple[str, str, float]]:
    md, ts = build(variant(PRESETS["qwen3-30b-a3b"], layers=2, experts=4))
    good = tmp / "good.gguf"
    write_gguf(good, md, ts)
    data = good.read_bytes()[:4096]
    cases = {
        "empty": b"",
        "text": b"not a model\n" * 100,
        "truncated": data,
        "absurd tensor count": encode_preamble(1 << 60, 0),
        # a string array (type 9 of type 8) that claims 2^60 items
        "absurd array": encode_preamble(0, 1) + encode_str("tokenizer.ggml.tokens")
                        + struct.pack("<IIQ", 9, 8, 1 << 60),
    }
    rows = []
    for name, content in cases.items():
        p = tmp / f"bad-{name.replace(' ', '-')}.gguf"
        p.write_bytes(content)
        rows.append((name, _err(p), _time(lambda: _err(p))))
    for name, p in (("directory", tmp), ("missing", tmp / "missing.gguf")):
        rows.append((name, _err(p), _time(lambda: _err(p))))
    return rows


def _err(p: Path) -> str:
    try:
        read_model(p)
    except ModelError as e:
        return str(e).replace(str(p), "FILE")
    return "no error!"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.modelbench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", nargs="*", type=Path, default=[], help="calibration fixture directories")
    args = ap.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print("## Header read (median of 5)\n")
        print("| model | what | seconds |\n|---|---|---|")
        for name, desc, t in bench_read(tmp):
            print(f"| {name} | {desc} | {t:.3f} |")
            ok &= t < 1.0
        print("\n## Bad input rejected (median of 5)\n")
        print("| input | error | seconds |\n|---|---|---|")
        for name, err, t in bench_bad(tmp):
            print(f"| {name} | {err} | {t:.4f} |")
            ok &= t < 1.0 and err != "no error!"
    if args.calibration:
        from lab.calibrate import format_report, report

        print("\n## Predicted vs measured memory (MiB)\n")
        rows, cal_ok = report(args.calibration, model_dir=Path(tempfile.gettempdir()) / "orchestrator-calib-models")
        print("```")
        print(format_report(rows))
        print("```")
        n_ok = sum(1 for r in rows if r.get("ok"))
        print(f"\n{n_ok}/{len(rows)} device rows within max(3 %, 256 MiB)")
        ok &= cal_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
