"""`orchestrator model PATH`: the table and the JSON, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.model import read_model
from orchestrator.model.memory import compute_buffer_bytes, kv_cache_bytes

REPO = Path(__file__).resolve().parents[2]


def orch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "model", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_json(tiny_models):
    path = tiny_models["deepseek2"]
    res = orch(str(path), "--json", "--ctx", "8192", "--parallel", "2", "--ubatch", "256", "--kv", "q8_0")
    assert res.returncode == 0, res.stderr
    j = json.loads(res.stdout)
    m = read_model(path)
    assert (j["arch"], j["n_layers"], j["n_experts"], j["n_experts_used"]) == ("deepseek2", 3, 8, 2)
    assert len(j["tensors"]) == len(m.tensors)
    assert {"name", "class", "layer", "bytes", "type"} <= set(j["tensors"][0])
    assert j["totals"]["routed_expert"] == sum(t.bytes for t in m.tensors if t.cls.value == "routed_expert")
    mem = j["memory"]
    assert mem["settings"] == {"n_ctx": 8192, "n_parallel": 2, "n_ubatch": 256, "type_k": "q8_0", "type_v": "q8_0",
                               "kv_unified": False, "flash_attn": True}
    assert mem["kv_cache"] == kv_cache_bytes(m, 8192, 2, "q8_0", "q8_0")
    assert mem["compute_cpu"] == compute_buffer_bytes(m, n_ubatch=256, n_ctx=8192, n_parallel=2, type_k="q8_0",
                                                      type_v="q8_0")
    assert mem["total_cpu"] == mem["weights"] + mem["kv_cache"] + mem["compute_cpu"] + mem["output"]


def test_table(tiny_models):
    res = orch(str(tiny_models["deepseek2"]), "--ctx", "4096")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for word in ("deepseek2", "MLA", "routed_expert", "shared_expert", "dense_ffn", "per layer", "KV cache",
                 "compute (CPU)", "one routed expert"):
        assert word in out, word
    # layer ranges: 0 is dense, 1-2 are MoE
    assert re.search(r"^\s+0\s+dense\s", out, re.M) and re.search(r"^\s+1-2\s+moe\s", out, re.M)   # per-layer rows


def test_json_without_tensors(tiny_models):
    res = orch(str(tiny_models["gpt-oss"]), "--json", "--no-tensors")
    j = json.loads(res.stdout)
    assert "tensors" not in j and j["swa_layers"] == [0, 2] and j["sliding_window"] == 128


def test_quantized_v_without_flash_attention_is_refused(tiny_models):
    res = orch(str(tiny_models["qwen3moe"]), "--kv", "q8_0", "--no-flash-attn")
    assert res.returncode == 2 and "needs flash attention" in res.stderr


@pytest.mark.parametrize("bad", [["--ctx", "0"], ["--kv", "q9_9"], ["--parallel", "x"]])
def test_bad_arguments(tiny_models, bad):
    res = orch(str(tiny_models["qwen3moe"]), *bad)
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_inferred_expert_count_warns_on_stderr(write_model, tiny_specs):
    def drop(md):
        del md["qwen3moe.expert_count"]
    (path,) = write_model(tiny_specs["qwen3moe"], metadata_edit=drop)
    res = orch(str(path), "--json", "--no-tensors")
    assert res.returncode == 0
    assert "warning" in res.stderr and str(path) in res.stderr
    assert json.loads(res.stdout)["n_experts"] == 8


def test_routing_input_choices_that_contradict_are_refused(tiny_models, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    res = orch(str(tiny_models["qwen3moe"]), "--routing", "--text", "--random")
    assert res.returncode == 2 and "not allowed with argument" in res.stderr and "Traceback" not in res.stderr
    res = orch(str(tiny_models["qwen3moe"]), "--routing", "--random", "--prompts", str(text))
    assert res.returncode == 2 and "either a text or random token ids" in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
