"""lab/bench/bias_variant.py: the plan with its experts' biases placed the other way, as a bench configuration."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from orchestrator.plan.placement import cpu_expert_override, matches

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lab" / "bench" / "bias_variant.py"


def _plan(tmp_path: Path, args: list[str]) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"workers": [{"args": args, "env": {"GGML_OP_OFFLOAD_MIN_BATCH": "32"},
                                             "argv": ["/opt/llama/bin/llama-server", *args]}]}))
    return path


def _variant(tmp_path: Path, pattern: str) -> tuple[str, list[str], str]:
    args = ["-m", "m.gguf", "--host", "127.0.0.1", "--port", "8081", "-ngl", "999", "-ot", f"{pattern}=CPU",
            "--moe-cache-mib", "6720", "--moe-cache-slots", "device", "-ub", "4096"]
    out = subprocess.run([sys.executable, str(SCRIPT), str(_plan(tmp_path, args))], capture_output=True, text=True,
                         check=True).stdout.strip()
    name, _, flags = out.partition("=")
    words = shlex.split(flags)
    new = words[words.index("-ot") + 1]
    rx, _, dev = new.rpartition("=")
    assert dev == "CPU"
    return name, words, rx


def test_a_cached_plans_variant_sends_the_biases_to_the_cpu_with_the_weights(tmp_path):
    (pattern, _buft), = cpu_expert_override([0, 1, 11], weights_only=True)
    name, words, rx = _variant(tmp_path, pattern)
    assert name == "plan-biases-cpu"
    assert words[words.index("--moe-cache-mib") + 1] == "6720"
    for layer in (0, 1, 11):
        for t in ("gate", "up", "down"):
            assert matches(rx, f"blk.{layer}.ffn_{t}_exps.weight") and matches(rx, f"blk.{layer}.ffn_{t}_exps.bias")
            assert not matches(pattern, f"blk.{layer}.ffn_{t}_exps.bias")   # the plan's own keeps them on the GPU
    assert not matches(rx, "blk.2.ffn_up_exps.bias")


def test_the_variant_keeps_the_biases_on_the_gpu_and_the_rest_of_the_plan(tmp_path):
    (pattern, buft), = cpu_expert_override([0, 1, 11])
    name, words, rx = _variant(tmp_path, pattern)
    assert name == "plan-biases-gpu"
    assert "GGML_OP_OFFLOAD_MIN_BATCH=32" in words and "--port" not in words
    assert words[words.index("--moe-cache-mib") + 1] == "6720" and words[words.index("-ub") + 1] == "4096"
    for layer in (0, 1, 11):
        for t in ("gate", "up", "down"):
            assert matches(rx, f"blk.{layer}.ffn_{t}_exps.weight")
            assert not matches(rx, f"blk.{layer}.ffn_{t}_exps.bias")
            assert matches(pattern, f"blk.{layer}.ffn_{t}_exps.bias")      # the plan's own sends them along
    assert not matches(rx, "blk.2.ffn_up_exps.weight")


def test_a_plan_without_host_experts_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), str(_plan(tmp_path, ["-m", "m.gguf", "-ngl", "999"]))],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().endswith("nothing to vary") and len(r.stderr.strip().splitlines()) == 1
