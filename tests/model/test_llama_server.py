"""End to end with the real llama-server: tiny real-architecture models written by the project's writer load, their
logged buffers match our reader and memory model, and one full micro-batch decodes."""

from __future__ import annotations

import pytest

from orchestrator.model import read_model
from orchestrator.bench.logparse import parse_load_log
from orchestrator.model.memory import ServerSettings, predict_memory
from lab.serverrun import run_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("arch,ctx,ub,np_", [("qwen3moe", 2048, 256, 1), ("deepseek2", 1024, 128, 2),
                                             ("gpt-oss", 4096, 512, 1), ("llama", 1024, 256, 3)])
def test_loads_and_matches_prediction(llama_server_path, tiny_models, arch, ctx, ub, np_):
    path = tiny_models[arch]
    args = ["-c", str(ctx), "-ub", str(ub), "-b", "2048", "-np", str(np_), "--no-kv-unified", "-fa", "on",
            "--no-warmup", "-lm", "none", "--fit", "off", "-t", "1"]
    run = run_server(llama_server_path, str(path), args, timeout=120, batch_tokens=ub if arch == "qwen3moe" else None,
                     n_vocab=320)
    assert run.loaded, run.error + "\n" + run.log[-3000:]
    rep = parse_load_log(run.log).by_device()["CPU"]
    m = read_model(path)
    pred = predict_memory(m, ServerSettings(n_ctx=ctx, n_parallel=np_, n_ubatch=ub))["CPU"]
    # llama.cpp logs MiB with two decimals: equal to within 0.01 MiB per buffer
    close = 3 * 10486
    assert abs(pred.kv - rep["kv"]) <= close
    assert abs(pred.weights - rep["model"]) <= close
    assert abs(pred.output - rep["output"]) <= 64 * 1024
    # tiny widths are far from the calibrated ones: the compute estimate must still be the right size
    assert 0.5 * rep["compute"] <= pred.compute <= 2.0 * rep["compute"], (pred.compute, rep["compute"])
    if arch == "qwen3moe":
        assert run.batch_ok, run.error
