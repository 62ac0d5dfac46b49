"""The live routing profile end to end without a GPU: a real llama-server records its router's picks while it serves,
they become the model's routing profile, and the plan reads it.

llama-server runs with ``--rpc`` to a local ``ggml-rpc-server`` (a GPU-type device, as in
test_expert_cache_rpc.py), every routed expert in host memory, an expert cache of about a quarter of the experts and
``--router-trace`` (0005-router-trace.patch). It serves sampled completions; ``GET /router-trace`` returns the picks of every
token it generated, and :class:`orchestrator.cluster.live_routing.LiveRouting` caches their profile. The cache's own
counters over that traffic must be what the profile replays (within 5 points), and the lookups must be exactly one
token's picks per recorded token: the ring holds every decoded token and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest

from orchestrator.model import synth
from tests.backend.expert_cache_support import (
    N_PREDICT, PROMPT, _healthy, _listening, _port, _start, _stop, _wait, metrics_of, probs,
)

pytestmark = pytest.mark.integration

REQUESTS = [  # sampled, as a server's users see it: three prompts, 160 tokens each
    {"prompt": PROMPT, "seed": 7}, {"prompt": PROMPT[::-1], "seed": 8}, {"prompt": PROMPT[3:] + PROMPT[:3], "seed": 9}]
TOKENS = 160


@pytest.fixture(scope="module")
def rpc_server(llama_server_path) -> str:
    path = Path(llama_server_path).with_name("ggml-rpc-server")
    assert os.access(path, os.X_OK), f"{path}: not built (orchestrator's build of llama.cpp includes it)"
    return str(path)


@pytest.fixture(scope="module")
def traced(llama_server_path):
    from orchestrator.backend.detect import detect_backend

    if not detect_backend(llama_server_path).has("router_trace"):
        pytest.skip(f"{llama_server_path} has no --router-trace (native/llama.cpp-patches/0005-router-trace.patch; "
                    "scripts/setup.sh rebuilds llama.cpp with the whole series)")
    return llama_server_path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from orchestrator.model.reader import read_gguf

    res = synth.write_model(tmp_path_factory.mktemp("trace") / "served.gguf", "qwen3-30b-a3b", scale=0.125,
                            quant="q8_0", seed=11, fsync=False)
    info = read_gguf(res.path)
    experts = [t for t in info.tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps", t.name)]
    n_expert = experts[0].shape[-1]
    expert_bytes = experts[0].nbytes // n_expert
    mib = int(0.25 * n_expert) * expert_bytes * len(experts) // 2**20
    return {"path": res.path, "n_expert": n_expert, "n_tensors": len(experts), "mib": mib,
            "slots": mib * 2**20 // (expert_bytes * len(experts)),
            "n_used": info.metadata["qwen3moe.expert_used_count"]}


def _serve(server, rpc_server, model, tmp, name, extra, bodies, before=None, after=None):
    """A llama-server on a fresh ggml-rpc-server: ``before(url)``, the completions in turn, ``after(url)``; stop.
    Returns (answers, before's and after's results, log)."""
    rpc_port, port = _port(), _port()
    rpc = _start([rpc_server, "-H", "127.0.0.1", "-p", str(rpc_port), "-t", "1"], tmp / f"{name}-rpc.log")
    log = tmp / f"{name}.log"
    try:
        _wait(lambda: _listening(rpc_port), 60, "ggml-rpc-server", tmp / f"{name}-rpc.log", rpc)
        argv = [server, "-m", str(model["path"]), "--host", "127.0.0.1", "--port", str(port), "-c", "1024", "-np", "1",
                "--rpc", f"127.0.0.1:{rpc_port}", "-ngl", "999", "--cpu-moe", "--no-repack", "--metrics",
                "--no-warmup", "-t", "1", "--moe-cache-mib", str(model["mib"]), "--moe-cache-max-batch", "4", *extra]
        url = f"http://127.0.0.1:{port}"
        proc = _start(argv, log)
        try:
            _wait(lambda: _healthy(url), 300, "llama-server", log, proc)
            first = before(url) if before else None
            answers = []
            for body in bodies:
                req_body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0.0, "n_probs": 4, "ignore_eos": True,
                            "cache_prompt": False, "return_tokens": True, **body}
                req = urllib.request.Request(url + "/completion", data=json.dumps(req_body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    answers.append(json.loads(r.read()))
            last = after(url) if after else None
        finally:
            _stop(proc)
    finally:
        _stop(rpc)
    return answers, (first, last), log.read_text()


def test_what_the_server_served_becomes_the_profile_the_plan_reads(traced, rpc_server, model, tmp_path,
                                                                   monkeypatch):
    from orchestrator.backend.detect import detect_backend
    from orchestrator.cluster.live_routing import LiveRouting, fetch_trace
    from orchestrator.model import routing
    from orchestrator.model import routing_profile as R
    from orchestrator.resolve import routing_curve

    cache = tmp_path / "cache"
    live = LiveRouting(str(model["path"]), cache=cache)
    bodies = [{**b, "n_predict": TOKENS, "temperature": 1.0, "n_probs": 0} for b in REQUESTS]
    answers, (empty, (harvest, metrics)), log = _serve(
        traced, rpc_server, model, tmp_path, "served", ["--router-trace", "2048"], bodies,
        before=fetch_trace, after=lambda url: (live.harvest([url]), metrics_of(url)))
    assert empty.trace is None and not empty.error and empty.recorded == 0, log[-2000:]   # on, nothing yet: 503
    assert metrics.get("moe_cache_active") == 1 and metrics["moe_cache_slots"] == model["slots"], log[-3000:]
    assert all(len(a["tokens"]) == TOKENS for a in answers)

    # every token decoded after it was sampled (all but the last of each answer), and nothing else
    tokens = harvest["tokens"]
    assert harvest["recorded"] == tokens and harvest["skipped"] == 0 and not harvest["errors"], harvest
    assert tokens == len(REQUESTS) * (TOKENS - 1)
    # the cache looked up one token's picks in every bank per recorded token; beside them only a prompt's last row
    # in the last layer (the one row computed there, within the cache's batches) and one more token at the first
    # request, as the counters show without the trace too
    per_token = model["n_used"] * model["n_tensors"]
    assert tokens * per_token <= metrics["moe_cache_lookups_total"] <= (tokens + len(REQUESTS) + 1) * per_token

    # the profile is cached for the model, and it is what the plan reads
    prof, settings = routing.load_profile(model["path"], cache)
    assert settings["input"] == routing.SERVED and prof.n_tokens == tokens
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(cache))
    curve = routing_curve(str(model["path"]), detect_backend(traced))
    assert curve is not None and curve.source == prof.source and "generated in use by 1 worker(s)" in curve.source

    # the live counters hit as the profile replays the same traffic
    live_hit = metrics["moe_cache_hits_total"] / metrics["moe_cache_lookups_total"]
    predicted = R.hit_rate(curve, model["slots"] / model["n_expert"])
    print(f"{tokens} tokens served: hit rate {live_hit:.3f} live, {predicted:.3f} replayed from the recorded "
          f"routing ({model['slots']} of {model['n_expert']} experts per bank)")
    assert live_hit == pytest.approx(predicted, abs=0.05)
    assert live_hit > 1.5 * model["slots"] / model["n_expert"]        # local routing: the check tells it apart


def test_recording_changes_no_token_and_is_off_without_the_flag(traced, rpc_server, model, tmp_path):
    """The eval callback that reads the picks computes the same kernels: the same greedy tokens and probabilities
    as without it. Without --router-trace the endpoint says the trace is off."""
    from orchestrator.cluster.live_routing import fetch_trace

    with_trace, (_f, got), _log = _serve(traced, rpc_server, model, tmp_path, "on", ["--router-trace", "16"], [{}],
                                         after=fetch_trace)
    without, (_f2, off), _log2 = _serve(traced, rpc_server, model, tmp_path, "off", [], [{}], after=fetch_trace)
    assert with_trace[0]["tokens"] == without[0]["tokens"] and probs(with_trace[0]) == probs(without[0])
    # a ring of 16 keeps the last 16 of the N_PREDICT - 1 decoded tokens
    assert got.trace is not None and got.trace.n_tokens == 16 and got.recorded == N_PREDICT - 1
    assert off.trace is None and "HTTP 501" in off.error


@pytest.mark.parametrize("unified", [True, False], ids=["one-kv-stream", "a-kv-stream-per-slot"])
def test_two_slots_decoding_together_account_for_every_generated_token(traced, rpc_server, model, tmp_path, unified):
    """Two requests at once on two slots: every token a slot decoded after sampling it is in the trace or counted
    as skipped. With one KV stream every batch's rows are known (none skipped); with a stream per slot a batch that
    mixes one slot's prompt with the other's decoding is skipped, not guessed."""
    import threading

    from orchestrator.cluster.live_routing import fetch_trace

    bodies = [{"prompt": PROMPT, "seed": 1, "temperature": 1.0, "n_probs": 0},
              {"prompt": PROMPT[::-1], "seed": 2, "temperature": 1.0, "n_probs": 0}]
    answers: list = [None, None]

    def both(url):
        def ask(i):
            body = {"n_predict": N_PREDICT, "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                    **bodies[i]}
            req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                answers[i] = json.loads(r.read())
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return fetch_trace(url)

    extra = ["--router-trace", "512", "-np", "2", "-c", "2048"] + (["--kv-unified"] if unified else [])
    _none, (got, _last), log = _serve(traced, rpc_server, model, tmp_path, "two", extra, [], before=both)
    assert all(a is not None and len(a["tokens"]) == N_PREDICT for a in answers), log[-3000:]
    decoded = 2 * (N_PREDICT - 1)
    assert got.recorded + got.skipped == decoded, (got.recorded, got.skipped)
    assert got.trace is not None and got.trace.n_tokens == got.recorded
    if unified:
        assert got.skipped == 0
    print(f"two slots, {'one KV stream' if unified else 'a KV stream per slot'}: {got.recorded} recorded, "
          f"{got.skipped} skipped")
