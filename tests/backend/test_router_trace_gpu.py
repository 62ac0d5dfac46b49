"""The live routing profile on a GPU: what a CUDA llama-server served becomes the profile, whose replay hits as the
cache's counters did; and with four streams the ring attributes every generated token.

Needs an NVIDIA GPU and a CUDA llama-server built with our patch series, its router trace included ($LLAMA_SERVER, else the
suite's). On the device: `pytest --noconftest -m gpu tests/backend/test_router_trace_gpu.py -s`; skipped in CI (no
GPU), and skipped with the reason where the server has no --router-trace. tests/backend/test_router_trace_rpc.py is
the same path on the RPC device, in CI.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import urllib.request

import pytest

from orchestrator.model import synth
from tests.backend.expert_cache_support import PROMPT, _healthy, _start, _stop, _wait, metrics_of, server_path

pytestmark = pytest.mark.gpu

TOKENS = 256


@pytest.fixture(scope="module")
def server() -> str:
    from orchestrator.backend.detect import detect_backend

    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no NVIDIA GPU here")
    path = server_path()
    info = detect_backend(path)
    if not info.cuda or not info.has("router_trace"):
        pytest.skip(f"{path}: needs a CUDA llama-server with --router-trace (0005-router-trace.patch)")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from orchestrator.model.reader import read_gguf

    res = synth.write_model(tmp_path_factory.mktemp("w1") / "w1-small.gguf", "qwen3-30b-a3b", scale=0.25,
                            quant="q4_0", seed=21)
    info = read_gguf(res.path)
    experts = [t for t in info.tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps", t.name)]
    n_expert = experts[0].shape[-1]
    expert_bytes = experts[0].nbytes // n_expert
    mib = int(0.25 * n_expert) * expert_bytes * len(experts) // 2**20
    return {"path": res.path, "n_expert": n_expert, "mib": mib,
            "slots": mib * 2**20 // (expert_bytes * len(experts))}


def _serving(server, model, tmp, name, parallel, bodies):
    """A CUDA llama-server with the cache and the trace: ``bodies`` answered ``parallel`` at a time; returns the
    answers, the harvest of its trace and its /metrics."""
    from orchestrator.cluster.live_routing import LiveRouting

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [server, "-m", str(model["path"]), "--host", "127.0.0.1", "--port", str(port), "-c", str(2048 * parallel),
            "-np", str(parallel), "--kv-unified", "-ngl", "999", "--cpu-moe", "-fa", "on", "--metrics", "--no-warmup",
            "-t", "8", "--moe-cache-mib", str(model["mib"]), "--moe-cache-max-batch", "8", "--router-trace", "4096"]
    log = tmp / f"{name}.log"
    proc = _start(argv, log)
    answers: list = [None] * len(bodies)

    def ask(i):
        body = {"prompt": PROMPT, "n_predict": TOKENS, "temperature": 1.0, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, **bodies[i]}
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answers[i] = json.loads(r.read())

    try:
        _wait(lambda: _healthy(url), 300, "llama-server", log, proc)
        for start in range(0, len(bodies), parallel):
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(start, min(start + parallel, len(bodies)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        live = LiveRouting(str(model["path"]), cache=tmp / "cache")
        harvest = live.harvest([url])
        metrics = metrics_of(url)
    finally:
        _stop(proc)
    return answers, harvest, metrics, log.read_text()


def test_one_stream_served_hits_as_its_recorded_routing_replays(server, model, tmp_path):
    from orchestrator.model import routing
    from orchestrator.model import routing_profile as R

    bodies = [{"seed": s, "prompt": PROMPT[s:] + PROMPT[:s]} for s in range(3)]
    answers, harvest, m, log = _serving(server, model, tmp_path, "one", 1, bodies)
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert all(len(a["tokens"]) == TOKENS for a in answers)
    assert harvest["skipped"] == 0 and harvest["tokens"] == harvest["recorded"] >= 3 * (TOKENS - 1), harvest
    prof, _settings = routing.load_profile(model["path"], tmp_path / "cache")
    predicted = R.hit_rate(prof.curve("lru-layer"), model["slots"] / model["n_expert"])
    live = m["moe_cache_hits_total"] / m["moe_cache_lookups_total"]
    print(f"one stream, {harvest['tokens']} tokens: hit rate {live:.3f} live, {predicted:.3f} replayed")
    assert live == pytest.approx(predicted, abs=0.05)


def test_four_streams_record_every_generated_token(server, model, tmp_path):
    bodies = [{"seed": s, "prompt": PROMPT[s:] + PROMPT[:s]} for s in range(4)]
    answers, harvest, m, log = _serving(server, model, tmp_path, "four", 4, bodies)
    assert all(len(a["tokens"]) == TOKENS for a in answers), log[-3000:]
    # one KV stream: every batch's rows are known, also when a prompt joins the streams' decoding
    assert harvest["skipped"] == 0 and harvest["tokens"] == harvest["recorded"] >= 4 * (TOKENS - 1), harvest
    live = m["moe_cache_hits_total"] / m["moe_cache_lookups_total"]
    print(f"four streams, {harvest['tokens']} tokens: hit rate {live:.3f} live ({harvest})")
