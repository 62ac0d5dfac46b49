"""Live routing through a real deployment: an embedded Ray head, a llama-server worker recording its router's
picks (``--router-trace``, what ``workers.live_routing: on`` adds), the gateway. Tokens generated through the
gateway, then ``down``: the controller reads the worker's trace a last time before the worker stops, and the
model's routing profile is then the served traffic's, where ``plan`` and ``up`` read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]
NS = "itest-live-routing"
TRACE = 512


# `up` in a process of its own, detached, as `orchestrator up --detach` leaves it: this process then only talks to
# the gateway and runs `orchestrator down` (an in-process driver would inherit whatever Ray state earlier tests left)
_UP = """
import dataclasses, json, sys
import cluster_support as S
from orchestrator.cluster import Deployment, RestartPolicy, up
from orchestrator.launch.settings import WorkerSettings

server, model, ns, trace = sys.argv[1:5]
spec = S.llama_spec("w0", server, model, extra=("--router-trace", trace))
spec = dataclasses.replace(spec, settings=WorkerSettings(model_path=model))
dep = Deployment(specs=(spec,), gateway_port=S.free_port(), dashboard_port=S.free_port(), namespace=ns,
                 plan_json={"demo": True},
                 restart=RestartPolicy(backoff_initial_s=0.5, health_timeout_s=5.0, load_timeout_s=120.0))
res = up(dep, foreground=False, say=lambda m: None)
print(json.dumps({"gateway": res.gateway_url}))
"""


def test_served_traffic_becomes_the_models_profile_through_up_and_down(tmp_path, llama_server_path, monkeypatch):
    help_text = subprocess.run([llama_server_path, "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--router-trace" not in help_text:
        pytest.skip(f"{llama_server_path} has no --router-trace (native/llama.cpp-patches/0005-router-trace.patch; "
                    "scripts/setup.sh builds the series)")
    monkeypatch.setenv("ORCHESTRATOR_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    from orchestrator.cluster import state
    from orchestrator.model import routing, synth

    model = synth.write_model(tmp_path / "moe.gguf", "qwen3-30b-a3b", scale=0.125, quant="q4_0", seed=21,
                              fsync=False).path
    assert routing.load_profile(model) is None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "cluster")])}
    generated = 0
    try:
        r = subprocess.run([sys.executable, "-c", _UP, llama_server_path, str(model), NS, str(TRACE)],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        gateway = json.loads(r.stdout.strip().splitlines()[-1])["gateway"]
        for seed in range(3):
            code, body = S.post_json(gateway + "/v1/completions",
                                     {"model": "tiny", "prompt": "The cache of experts", "max_tokens": 120,
                                      "temperature": 1.0, "seed": seed, "ignore_eos": True}, timeout=300)
            assert code == 200, body
            generated += body["usage"]["completion_tokens"]
        assert generated >= 256                      # what the controller needs for a profile
    finally:
        t = time.monotonic()
        if state.read(NS) is not None:
            d = subprocess.run([sys.executable, "-m", "orchestrator", "down", "-n", NS], capture_output=True,
                               text=True, timeout=180, env=env)
            assert d.returncode == 0, d.stderr[-3000:]
        stop_s = time.monotonic() - t
    assert state.read(NS) is None
    loaded = routing.load_profile(model)
    assert loaded is not None, "down did not leave a profile of the served traffic"
    prof, settings = loaded
    assert settings["input"] == "served" and settings["workers"] == 1
    # every generated token but each answer's first (it comes from the prompt's batch) was recorded
    assert generated - 3 <= settings["tokens"] <= generated, (settings, generated)
    assert prof.curve("lru-layer").source.startswith("measured")
    print(f"served {generated} tokens; profile of {settings['tokens']}; down took {stop_s:.1f} s")
