#!/usr/bin/env python3
"""What one decode step of a cached MoE layer is made of, by where the expert biases lie: ggml's scheduler's splits
(GGML_SCHED_DEBUG=2) and the decode speed, without a GPU (ggml's RPC device stands in for one, as in
tests/backend/test_expert_cache_rpc.py).

    python lab/bench/expert_bias_splits.py [--tokens 64] [--dir DIR]
    python lab/bench/expert_bias_splits.py --plan PLAN.json [--config 'NAME=FLAGS'] [--dir DIR]

Servers with every routed expert tensor of every layer in host memory and an expert cache:
- a generated gpt-oss-20b shape (MXFP4 experts with biases) with --cpu-moe's placement, which sends the expert
  biases to host memory with the experts (``blk\\.(...)\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU``);
- the same with the biases kept on the device (the override anchored at ``.weight``, as the plan places a cached
  layer's experts);
- generated Qwen3-30B-A3B, DeepSeek-V3 (3 dense leading layers of 5) and GLM-4.5-Air (1 of 3) shapes (no expert
  biases) with the first override.
For each: the splits of the last graph (a decode step: one token), the ops the CPU runs there, and tokens/s over
``--tokens`` greedy tokens (a second start without the scheduler's debug output), whose text must not depend on
where the biases lie.

With --plan (a plan document, `orchestrator plan ... --json`, on the machine it was made for: the GPU machine) the
plan's own llama-server runs as the plan launches it, and with --config a bench configuration as
lab/bench/bias_variant.py prints it (its flags in place of the plan's): one completion of two tokens with the
scheduler's debug output, then its last graph's splits by backend, the ops the CPU runs and tokens/s over --tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.serverrun import free_port, post_json  # noqa: E402
from orchestrator.launch.process import launch, start  # noqa: E402
from orchestrator.launch.spec import LaunchSpec  # noqa: E402
from orchestrator.model import synth  # noqa: E402
from orchestrator.plan.placement import EXPERT_TENSOR_RX, layer_alternation  # noqa: E402

SHAPES = {"gpt-oss-20b": ("gpt-oss-20b", 0.1, 2), "qwen3-30b-a3b": ("qwen3-30b-a3b", 0.125, 2),
          "deepseek-v3": ("deepseek-v3", 0.05, 5), "glm-4.5-air": ("glm-4.5-air", 0.125, 3)}


def _greedy_completion(url: str, n_predict: int) -> dict:
    """``n_predict`` greedy tokens after a three-token prompt, the prompt cache off: llama-server's timings."""
    answer = post_json(url + "/completion", {"prompt": [1, 2, 3], "n_predict": n_predict, "temperature": 0.0,
                                             "ignore_eos": True, "cache_prompt": False}, timeout=1800)
    return {**answer["timings"], "content": answer["content"]}


def serve(bindir: Path, model: Path, overrides: list[str], log: Path, n_predict: int, debug: bool) -> dict:
    """One completion of ``n_predict`` greedy tokens on llama-server with the RPC device as its GPU; its timings."""
    rp, sp = free_port(), free_port()
    rpc = start(LaunchSpec(name="rpc", argv=(str(bindir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(rp),
                                             "-t", "1"), port=rp), log.with_suffix(".rpc.log"))
    try:
        time.sleep(1.0)
        argv = [str(bindir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(sp), "-c", "512",
                "-np", "1", "--rpc", f"127.0.0.1:{rp}", "-ngl", "999", "--no-repack", "--no-warmup", "-t", "1",
                "--moe-cache-mib", "4", "--moe-cache-max-batch", "4", "--metrics"]
        for o in overrides:
            argv += ["-ot", o]
        if debug:
            argv += ["-lv", "10"]
        return _completion(LaunchSpec(name="splits", argv=tuple(argv), port=sp, env=_debug_env(debug)), log,
                           n_predict, timeout=300)
    finally:
        rpc.stop(grace=30)


def _debug_env(debug: bool) -> dict:
    return {"GGML_SCHED_DEBUG": "2"} if debug else {}


def _completion(spec: LaunchSpec, log: Path, n_predict: int, timeout: float) -> dict:
    """``spec`` started by the product's launcher (its own process group, reaped), one greedy completion, stopped."""
    proc = launch(spec, log, timeout=timeout, grace=30)
    try:
        return _greedy_completion(spec.url, n_predict)
    finally:
        proc.stop(grace=30)


def last_graph(log: str) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """(splits: (index, backend), nodes: (op, name, backend)) of the last graph the scheduler printed."""
    block = "## SPLIT #0:" + log.split("## SPLIT #0:")[-1]
    splits = re.findall(r"## SPLIT #(\d+): (\S+) #", block)
    nodes = re.findall(r"node #\s*\d+ \(\s*([A-Z_]+)\):\s+(\S+) \(.{5}\) \[\s*(\S+)\s", block)
    return splits, nodes


def serve_plan(plan: Path, config: str | None, log: Path, n_predict: int, debug: bool) -> dict:
    """One completion of ``n_predict`` greedy tokens on the plan's worker 0 as it launches (or with ``config``'s
    flags and environment in place of the plan's); its timings."""
    import shlex

    w = json.loads(plan.read_text())["workers"][0]
    argv, env = list(w["argv"]), dict(w["env"])
    if config:
        words = shlex.split(config.partition("=")[2])
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            k, _, v = words.pop(0).partition("=")
            env[k] = v
        server = env.pop("LLAMA_SERVER", None) or argv[len(argv) - len(w["args"]) - 1]
        argv = [server, *words]
    port = free_port()
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    else:
        argv += ["--port", str(port)]
    if "--host" not in argv:
        argv += ["--host", "127.0.0.1"]
    if debug:
        argv += ["-lv", "10"]
    return _completion(LaunchSpec(name="plan", argv=tuple(argv), port=port, env={**env, **_debug_env(debug)}), log,
                       n_predict, timeout=900)


def plan_mode(a) -> int:
    tmp = a.dir or Path(tempfile.mkdtemp(prefix="plan-splits-"))
    tmp.mkdir(parents=True, exist_ok=True)
    name = (a.config or "plan=").partition("=")[0]
    log = tmp / f"{name}-debug.log"
    serve_plan(a.plan, a.config, log, 2, debug=True)
    splits, nodes = last_graph(log.read_text(errors="replace"))
    backends = {}
    for _i, b in splits:
        backends[b.split("[")[0]] = backends.get(b.split("[")[0], 0) + 1
    on_cpu = [(op, n) for op, n, b in nodes if b == "CPU"]
    t = serve_plan(a.plan, a.config, tmp / f"{name}-timed.log", a.tokens, debug=False)
    print(f"{name}: {len(splits)} splits in a decode step ({', '.join(f'{k} {v}' for k, v in backends.items())}); "
          f"{len(on_cpu)} ops on the CPU: {', '.join(sorted({op for op, _ in on_cpu}))}; "
          f"{t['predicted_per_second']:.1f} t/s over {t['predicted_n']} greedy tokens")
    print(f"logs: {tmp}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens timed per server")
    ap.add_argument("--dir", type=Path, help="where the models and logs go (default: a temporary folder)")
    ap.add_argument("--server", help="llama-server of a build with the expert cache and ggml's RPC server beside it")
    ap.add_argument("--plan", type=Path, help="a plan document: run its worker 0 as planned (on its machine)")
    ap.add_argument("--config", help="with --plan: a bench configuration NAME='[VAR=value ...] flags' to run instead")
    a = ap.parse_args()
    if a.plan:
        return plan_mode(a)
    if a.server:
        server = a.server
    else:
        from orchestrator.backend.detect import find_llama_server

        server, _ = find_llama_server(None)
    bindir = Path(server).parent
    if not (bindir / "ggml-rpc-server").exists():
        raise SystemExit(f"{bindir}: no ggml-rpc-server beside llama-server (orchestrator build makes both)")
    tmp = a.dir or Path(tempfile.mkdtemp(prefix="bias-splits-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rows, texts = [], {}
    for name, (like, scale, layers) in SHAPES.items():
        path = tmp / f"{name}.gguf"
        if not path.exists():
            synth.write_model(path, like, scale=scale, layers=layers, quant="q4_0", seed=4, fsync=False)
        every = f"blk\\.{layer_alternation(range(layers))}\\."
        variants = [("plan's -ot", [f"{every}{EXPERT_TENSOR_RX}=CPU"])]
        if name.startswith("gpt-oss"):
            variants.append(("biases on the device", [f"{every}{EXPERT_TENSOR_RX}\\.weight=CPU"]))
        for what, ot in variants:
            log = tmp / f"{name}-{len(rows)}.log"
            serve(bindir, path, ot, log, 2, debug=True)
            splits, nodes = last_graph(log.read_text(errors="replace"))
            on_cpu = [(op, n) for op, n, b in nodes if b == "CPU"]
            t = serve(bindir, path, ot, tmp / f"{name}-{len(rows)}-timed.log", a.tokens, debug=False)
            rows.append((name, what, len(splits), on_cpu, t["predicted_per_second"], t["predicted_ms"] / t["predicted_n"]))
            texts.setdefault(name, []).append(t["content"])
    print(f"{'model':16} {'expert tensors':22} {'splits':>6} {'CPU ops':>7} {'t/s':>7} {'ms/token':>8}  ops on the CPU")
    for name, what, n_splits, on_cpu, tps, ms in rows:
        ops = ", ".join(sorted({op for op, _ in on_cpu}))
        print(f"{name:16} {what:22} {n_splits:6d} {len(on_cpu):7d} {tps:7.2f} {ms:8.2f}  {ops}")
    for name, got in texts.items():
        if len(got) > 1:
            print(f"{name}: the greedy tokens with the biases on the device are "
                  f"{'the same' if len(set(got)) == 1 else 'NOT the same'} as with the plan's -ot")
    print(f"logs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
