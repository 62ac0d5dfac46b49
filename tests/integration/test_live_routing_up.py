"""Live routing through a real deployment: an embedded Ray head, a llama-server worker recording its router's
picks (``--router-trace``, what ``workers.live_routing: on`` adds), the gateway. Tokens generated through the
gateway, then ``down``: the controller reads the worker's trace a last time before the worker stops, and the
model's routing profile is then the served traffic's, where ``plan`` and ``up`` read it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NS = "itest-live-routing"
TRACE = 512


def test_served_traffic_becomes_the_models_profile_through_up_and_down(tmp_path, llama_server_path, monkeypatch):
    help_text = subprocess.run([llama_server_path, "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--router-trace" not in help_text:
        pytest.skip(f"{llama_server_path} has no --router-trace (native/llama.cpp-patches/0004-router-trace.patch; "
                    "scripts/setup.sh builds the series)")
    monkeypatch.setenv("ORCHESTRATOR_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    from orchestrator.cluster import Deployment, RestartPolicy, down, state, up
    from orchestrator.launch.settings import WorkerSettings
    from orchestrator.model import routing, synth

    model = synth.write_model(tmp_path / "moe.gguf", "qwen3-30b-a3b", scale=0.125, quant="q4_0", seed=21,
                              fsync=False).path
    spec = S.llama_spec("w0", llama_server_path, model, extra=("--router-trace", str(TRACE)))
    spec = dataclasses.replace(spec, settings=WorkerSettings(model_path=str(model)))
    dep = Deployment(specs=(spec,), gateway_port=S.free_port(), dashboard_port=S.free_port(), namespace=NS,
                     plan_json={"demo": True},
                     restart=RestartPolicy(backoff_initial_s=0.5, health_timeout_s=5.0, load_timeout_s=120.0))
    assert routing.load_profile(model) is None
    res = up(dep, foreground=False, say=lambda m: None)
    generated = 0
    try:
        for seed in range(3):
            code, body = S.post_json(res.gateway_url + "/v1/completions",
                                     {"model": "tiny", "prompt": "The cache of experts", "max_tokens": 120,
                                      "temperature": 1.0, "seed": seed, "ignore_eos": True}, timeout=300)
            assert code == 200, body
            generated += body["usage"]["completion_tokens"]
        assert generated >= 256                      # what the controller needs for a profile
    finally:
        t = time.monotonic()
        if state.read(NS) is not None:
            down(NS, say=lambda m: None)
        stop_s = time.monotonic() - t
    loaded = routing.load_profile(model)
    assert loaded is not None, "down did not leave a profile of the served traffic"
    prof, settings = loaded
    assert settings["input"] == "served" and settings["workers"] == 1
    # every generated token but each answer's first (it comes from the prompt's batch) was recorded
    assert generated - 3 <= settings["tokens"] <= generated, (settings, generated)
    assert prof.curve("lru-layer").source.startswith("measured")
    print(f"served {generated} tokens; profile of {settings['tokens']}; down took {stop_s:.1f} s")
