"""Models written by `orchestrator synth-model` (the product's own generator, another writer than ours and
gguf's): our reader agrees with gguf.GGUFReader, and our predictions with what the real llama-server logs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from orchestrator.model import ServerSettings, TensorClass, predict_memory, read_model
from orchestrator.bench.logparse import parse_load_log
from lab.serverrun import run_server

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def synth_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for like in ("qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b"):
        path = d / f"{like}.gguf"
        res = subprocess.run([sys.executable, "-m", "orchestrator", "synth-model", str(path), "--like", like,
                              "--scale", "0.0625"], capture_output=True, text=True, cwd=REPO, timeout=600)
        assert res.returncode == 0, res.stderr
        out[like] = path
    return out


@pytest.mark.parametrize("like,arch", [("qwen3-30b-a3b", "qwen3moe"), ("deepseek-v3", "deepseek2"),
                                       ("gpt-oss-20b", "gpt-oss")])
def test_synth_model_read_and_predicted(llama_server_path, synth_models, like, arch):
    path = synth_models[like]
    m = read_model(path)
    ref = gguf.GGUFReader(path)
    assert m.arch == arch
    assert [(t.name, t.bytes, t.offset) for t in m.tensors] == \
        [(t.name, int(t.n_bytes), int(t.data_offset)) for t in ref.tensors]
    assert m.moe_layers and m.bytes_by_class()[TensorClass.ROUTED_EXPERT] > 0
    run = run_server(llama_server_path, str(path), ["-c", "8192", "-ub", "1024", "-np", "1", "-fa", "on",
                                                    "--no-warmup", "-lm", "none", "--fit", "off", "-t", "1"],
                     timeout=120)
    assert run.loaded, run.error
    rep = parse_load_log(run.log).by_device()["CPU"]
    pred = predict_memory(m, ServerSettings(n_ctx=8192, n_ubatch=1024))["CPU"]
    close = 3 * 10486        # llama.cpp logs MiB with two decimals
    assert abs(pred.kv - rep["kv"]) <= close
    assert abs(pred.weights - rep["model"]) <= close
    # widths 1/16 of the real ones: the compute estimate is conservative there, never short
    assert 0.98 * rep["compute"] <= pred.compute <= 1.6 * rep["compute"]
