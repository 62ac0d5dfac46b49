"""Routing of generated models, measured through llama.cpp: the router's top-k of every MoE layer is read with
native/expert_usage.cpp (built against the libraries `orchestrator build` keeps) over 512 and 8 random tokens.

Over 512 tokens every MoE layer must use at least 90% of its experts, over 8 tokens more than n_expert_used
distinct experts -- as a trained model does. The naive generator (positive scales, full-size attn_output) is
measured too, and must fail the same check: the check can tell the difference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import ModelError
from orchestrator.model import routing, synth

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]

THREADS = max(1, min(os.cpu_count() or 1, 8))

# full depth, narrow width: deep residual streams are where routing collapses. DeepSeek-V3 and gpt-oss-120b without
# routing locality: 512 tokens are 16 picks per expert (256 experts, top 8; 128, top 4), and tokens that share
# experts with their neighbours leave more than a tenth of them unvisited (their locality is measured in
# tests/integration/test_family_routing.py)
CASES = [
    ("qwen3-30b-a3b", 0.125, 48, None),
    ("deepseek-v3", 0.05, 61, 0.0),
    ("gpt-oss-120b", 0.1, 36, 0.0),
]


@pytest.fixture(scope="module")
def tool():
    return routing.build_tool()


@pytest.mark.parametrize("like,scale,layers,locality", CASES, ids=[c[0] for c in CASES])
def test_generated_model_routes_like_a_trained_one(tmp_path, tool, like, scale, layers, locality):
    res = synth.write_model(tmp_path / f"{like}.gguf", like, scale=scale, layers=layers, seed=5, locality=locality)
    rep = routing.measure(res.path, lengths=(512, 8), threads=THREADS, tool=tool)
    shape = res.shape
    assert rep.n_expert == shape.n_expert and rep.n_expert_used == shape.n_expert_used
    long, short = rep.run(512), rep.run(8)
    # every MoE layer was seen (deepseek's leading dense layers have no router)
    assert [u.layer for u in long.layers] == list(shape.moe_layers())
    assert [u.layer for u in short.layers] == list(shape.moe_layers())
    for u in long.layers:
        assert sum(u.counts) == 512 * shape.n_expert_used
    problems = routing.check(rep)
    assert problems == [], "\n" + routing.format_report(rep)
    # and no expert hogs the tokens: a trained model's busiest expert takes a few percent
    assert max(u.max_share for u in long.layers) < 0.1, routing.format_report(rep)


def test_naive_weights_fail_the_check(tmp_path, tool):
    res = synth.write_model(tmp_path / "naive.gguf", "qwen3-30b-a3b", scale=0.125, layers=12, seed=5, style="naive")
    rep = routing.measure(res.path, lengths=(512, 8), threads=THREADS, tool=tool)
    problems = routing.check(rep)
    assert len(problems) >= 6, routing.format_report(rep)
    assert rep.run(512).min_distinct() < 0.5 * rep.n_expert


def test_measure_reports_a_bad_model_file(tmp_path, tool):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelError, match="bad.gguf"):
        routing.measure(bad, tool=tool)


def test_cli_check_routing(tmp_path, tool):
    out = tmp_path / "m.gguf"
    res = subprocess.run([sys.executable, "-m", "orchestrator", "synth-model", str(out), "--like", "qwen3-30b-a3b",
                          "--scale", "0.05", "--check-routing", "--threads", str(THREADS)],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr
    assert "routing check: ok" in res.stderr
    assert res.stdout.strip() == str(out)


def test_tool_is_built_once(tool):
    import time

    t0 = time.monotonic()
    assert routing.build_tool() == tool
    assert time.monotonic() - t0 < 1.0  # cached: no compiler run


# --------------------------------------------------------------------------------------------------------------
# locality in time: decode-order traces (one token per llama_decode, random non-repeating token ids)

# public Qwen3-30B-A3B points as shares of a layer's 128 experts (routing_profile.DEFAULT_CURVE says where from)
QWEN3_FACTS = {73 / 3 / 128: 0.741, 146 / 3 / 128: 0.894, 244 / 3 / 128: 0.962}


def _demo(tmp_path, locality, seed=11):
    return synth.write_model(tmp_path / "demo.gguf", "qwen3-30b-a3b", scale=0.125, quant="q8_0", seed=seed,
                             locality=locality, fsync=False)


def test_default_locality_hits_like_qwen3_through_llama_cpp(tmp_path, tool):
    from orchestrator.model import routing_profile as R

    res = _demo(tmp_path, None)
    tr = routing.trace(res.path, tokens=1024, threads=THREADS, tool=tool)
    assert tr.n_tokens == 1024 and tr.layers == tuple(res.shape.moe_layers()) and tr.ids.shape[2] == 8
    assert len({tuple(x) for x in tr.ids[:, 0, :].tolist()}) > 900      # not a loop
    p = R.profile(tr)
    # the demo-sized model is more local than Qwen3-30B-A3B where the cache is small (tests/fixtures/routing)
    (small, *rest) = QWEN3_FACTS
    assert QWEN3_FACTS[small] < R.hit_rate(p.curve(), small) < QWEN3_FACTS[small] + 0.13, R.format_profile(p)
    for f in rest:
        assert R.hit_rate(p.curve(), f) == pytest.approx(QWEN3_FACTS[f], abs=0.05), R.format_profile(p)
    # and the spread of a trained model stays: most experts over 512 tokens
    assert routing.check(routing.measure(res.path, lengths=(512, 8), threads=THREADS, tool=tool)) == []


def test_locality_zero_routes_independently_through_llama_cpp(tmp_path, tool):
    from orchestrator.model import routing_profile as R

    res = _demo(tmp_path, 0.0)
    p = R.profile(routing.trace(res.path, tokens=512, threads=THREADS, tool=tool))
    for f in (0.15, 0.30, 0.50):
        assert R.hit_rate(p.curve(), f) == pytest.approx(f, abs=0.04), R.format_profile(p)


def test_sampled_generation_routes_like_the_random_stream(tmp_path, tool):
    """Tokens sampled from the model (temperature 1, seeded: what a server generates) hit the cache as the
    random-id stream does: the locality is the model's, not the stream's."""
    from orchestrator.model import routing_profile as R

    res = _demo(tmp_path, None)
    sampled = R.profile(routing.trace(res.path, tokens=768, sample=1.0, seed=4, threads=THREADS, tool=tool))
    plain = R.profile(routing.trace(res.path, tokens=768, seed=4, threads=THREADS, tool=tool))
    for f in (0.05, 0.15, 0.30, 0.50):
        assert R.hit_rate(sampled.curve(), f) == pytest.approx(R.hit_rate(plain.curve(), f), abs=0.03)
    with pytest.raises(ModelError, match="temperature must be > 0"):
        routing.trace(res.path, tokens=8, sample=0.0, tool=tool)


def test_trace_of_a_text_file_and_bad_arguments(tmp_path, tool):
    res = _demo(tmp_path, None)
    text = tmp_path / "prompts.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    tr = routing.trace(res.path, tokens=4096, prompts=text, threads=THREADS, tool=tool)
    assert 8 < tr.n_tokens < 4096          # the text's own tokens, fed in order
    with pytest.raises(ModelError, match="at least 2 tokens"):
        routing.trace(res.path, tokens=1, tool=tool)
    # -ngl reaches llama.cpp; without a GPU it keeps every layer on the CPU, so the picks are the same
    a = routing.trace(res.path, tokens=48, threads=THREADS, tool=tool)
    b = routing.trace(res.path, tokens=48, threads=THREADS, tool=tool, ngl=99)
    assert a.n_tokens == b.n_tokens == 48 and (a.ids == b.ids).all()
    with pytest.raises(ModelError, match="missing.txt"):
        routing.trace(res.path, prompts=tmp_path / "missing.txt", tool=tool)


def test_model_routing_command_measures_once_and_caches(tmp_path, tool):
    import json

    res = _demo(tmp_path, None)
    cache_file = routing.profile_path(res.path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "orchestrator", "model", str(res.path), "--routing", "--tokens", "256", "--json",
            "--no-tensors"]
    try:
        first = subprocess.run(argv, capture_output=True, text=True, env=env)
        assert first.returncode == 0, first.stderr
        r = json.loads(first.stdout)["routing"]
        assert r["cached"] is False and r["n_tokens"] == 256 and r["cache_file"] == str(cache_file)
        assert len(r["curves"]["lru-layer"]["hits"]) == 129 and len(r["layers"]) == res.shape.n_layer
        # a generated model traces random ids unless asked otherwise, and the profile says so
        assert r["traced"] == {"tokens": 256, "seed": 1, "input": "random", "prompts": None, "sample": None}
        assert "random token ids" in r["source"]
        # what it is doing goes to stderr while it runs (stdout stays the JSON)
        assert "routing: tracing 256 tokens of demo.gguf" in first.stderr and "random token ids" in first.stderr
        assert "routing: traced in" in first.stderr and str(cache_file) in first.stderr
        again = subprocess.run(argv, capture_output=True, text=True, env=env)
        assert json.loads(again.stdout)["routing"]["cached"] is True
        assert "measured before with these settings" in again.stderr and "tracing" not in again.stderr
        # where the layers ran is not a property of the profile: asked with --gpu-layers, the cached one answers
        gpu = subprocess.run(argv + ["--gpu-layers", "99"], capture_output=True, text=True, env=env)
        assert gpu.returncode == 0 and json.loads(gpu.stdout)["routing"]["cached"] is True, gpu.stderr
        prof, settings = routing.load_profile(res.path)
        assert settings["tokens"] == 256 and settings["input"] == "random"
        assert prof.curve().hits == pytest.approx(r["curves"]["lru-layer"]["hits"], abs=1e-4)
        text = subprocess.run(argv[:-2], capture_output=True, text=True, env=env)
        assert "per-layer LRU" in text.stdout and "cached:" in text.stdout
        assert "traced: random token ids, 256 tokens" in text.stdout
        # a changed file is another model: no profile until measured
        res.path.write_bytes(res.path.read_bytes() + b"\0" * 32)
        assert routing.load_profile(res.path) is None
    finally:
        cache_file.unlink(missing_ok=True)


def test_model_routing_traces_text_then_the_models_own_continuation(tmp_path, tool):
    """--text on a generated model: the built-in corpus decoded as a prompt (the generated tokenizer makes it
    longer than 192 tokens, so all of them are text); a short text of one's own, then tokens the model samples
    at llama-server's temperature until --tokens: more tokens than the text has. The profile records which."""
    import json

    res = _demo(tmp_path, None)
    cache_file = routing.profile_path(res.path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    base = [sys.executable, "-m", "orchestrator", "model", str(res.path), "--routing", "--json", "--no-tensors"]
    short = tmp_path / "short.txt"
    short.write_text("User: Wie spät ist es?\nAssistant:")
    try:
        corpus = subprocess.run(base + ["--text", "--tokens", "192"], capture_output=True, text=True, env=env)
        assert corpus.returncode == 0, corpus.stderr
        r = json.loads(corpus.stdout)["routing"]
        assert r["n_tokens"] == 192 and r["cached"] is False
        assert r["traced"]["input"] == "text" and r["traced"]["sample"] == 0.8
        assert r["traced"]["prompts"]["path"] == str(routing.CORPUS)
        assert "the text of the built-in corpus (chat turns, prose, code, German)" in r["source"]
        assert "built-in corpus" in corpus.stderr
        # its own text, continued by the model: 128 tokens from a prompt of a few dozen
        own = subprocess.run(base + ["--prompts", str(short), "--tokens", "128"], capture_output=True, text=True,
                             env=env)
        assert own.returncode == 0, own.stderr
        o = json.loads(own.stdout)["routing"]
        assert o["n_tokens"] == 128 and o["traced"]["prompts"]["name"] == "short.txt" and o["cached"] is False
        assert "then past its end the model's own tokens sampled at temperature 0.8" in o["source"]
        fed = routing.trace(res.path, tokens=128, prompts=short, threads=THREADS, tool=tool)
        assert 4 < fed.n_tokens < 64                  # the text alone is that short
        # --random and --prompts contradict each other: one line, exit 2
        bad = subprocess.run(base + ["--random", "--prompts", str(short)], capture_output=True, text=True, env=env)
        assert bad.returncode == 2 and "either a text or random" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        cache_file.unlink(missing_ok=True)
