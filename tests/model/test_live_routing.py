"""Served traffic -> the model's routing profile, and the live hit rate against the predicted one.

The workers' side is a real HTTP server on 127.0.0.1 answering ``GET /router-trace`` as the patched llama-server
does (a trace in the routing tool's format, the counters in headers); what it serves is a trace of a stream with
locality, so the profile made from it must hit as a literal LRU replay of that stream does. The llama-server that
records the trace is in tests/backend/test_router_trace_rpc.py."""

from __future__ import annotations

import http.server
import threading

import numpy as np
import pytest

from orchestrator.cluster import live_routing as L
from orchestrator.errors import ModelError
from orchestrator.model import routing
from orchestrator.model import routing_profile as R
from tests.model.test_routing_profile import _literal_lru


def _local_trace(seed: int, tokens: int, nl: int = 3, e: int = 32, k: int = 4) -> R.Trace:
    """A stream whose tokens keep most of the previous token's experts (as decoding does)."""
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, nl, k), np.int32)
    for li in range(nl):
        cur = rng.choice(e, k, replace=False)
        for t in range(tokens):
            if rng.random() < 0.4:
                keep = cur[: k - 1]
                fresh = rng.choice(np.setdiff1d(np.arange(e), keep), 1)
                cur = np.concatenate([fresh, keep])
            ids[t, li] = cur
    return R.Trace(e, k, tuple(range(0, 2 * nl, 2)), ids)


def _lru(trace: R.Trace, slots: int) -> float:
    """The hit rate of a real LRU of ``slots`` per layer over ``trace``."""
    return _literal_lru(trace, slots, "lru-layer")


class _Worker:
    """An HTTP server on 127.0.0.1 answering GET /router-trace with what ``answer`` holds."""

    def __init__(self) -> None:
        self.answer: tuple[int, bytes, dict] = (503, b'{"error": {}}', {})
        self.auth: list[str | None] = []
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                me.auth.append(self.headers.get("Authorization"))
                status, body, headers = me.answer if self.path == L.TRACE_PATH else (404, b"", {})
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def serve(self, trace: R.Trace, recorded: int, skipped: int = 0) -> None:
        self.answer = (200, R.trace_bytes(trace), {"X-Router-Trace-Recorded": recorded,
                                                   "X-Router-Trace-Skipped": skipped})

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def workers():
    ws = [_Worker(), _Worker()]
    yield ws
    for w in ws:
        w.close()


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(4096))      # the profile cache keys on the file, never parses it here
    return path


def test_what_two_workers_served_becomes_the_models_profile(workers, model, tmp_path):
    cache = tmp_path / "cache"
    a, b = _local_trace(1, 400), _local_trace(2, 300)
    workers[0].serve(a, recorded=900, skipped=3)
    workers[1].serve(b, recorded=300)
    live = L.LiveRouting(str(model), api_key="k3y", cache=cache)
    out = live.harvest([w.url for w in workers])
    assert out["tokens"] == 700 and out["recorded"] == 1200 and out["skipped"] == 3 and not out["errors"]
    assert all(w.auth == ["Bearer k3y"] for w in workers)

    prof, settings = routing.load_profile(model, cache)
    assert settings == routing.served_settings(700, 2) and prof.n_tokens == 700
    assert "700 tokens generated in use by 2 worker(s)" in prof.source
    # the profile is that of the two streams one after the other: the LRU replay of exactly those tokens
    joined = R.Trace(a.n_expert, a.n_expert_used, a.layers, np.concatenate([a.ids, b.ids]))
    curve = prof.curve("lru-layer")
    for slots in (4, 8, 16):
        assert R.hit_rate(curve, slots / a.n_expert) == pytest.approx(_lru(joined, slots), abs=2e-5)   # (stored to 5 digits)
    assert _lru(joined, 8) > 2 * 8 / 32          # (the stream has locality: the check can tell streams apart)

    # nothing new generated: the profile is not made again
    (cache / "routing").joinpath(routing.profile_path(model, cache).name).unlink()
    again = live.harvest([w.url for w in workers])
    assert again["note"] == "nothing generated since the last profile"
    assert routing.load_profile(model, cache) is None


def test_no_profile_from_too_few_tokens_or_a_worker_with_nothing_yet(workers, model, tmp_path):
    cache = tmp_path / "cache"
    workers[0].serve(_local_trace(3, 100), recorded=100)     # workers[1] answers 503: on, nothing yet
    out = L.LiveRouting(str(model), cache=cache).harvest([w.url for w in workers])
    assert out["tokens"] == 100 and not out["errors"] and "fewer than 256" in out["note"]
    assert routing.load_profile(model, cache) is None


def test_a_bad_answer_is_an_error_of_that_worker_not_a_crash(workers, model, tmp_path):
    workers[0].answer = (200, b"EXPTRACE-not-really", {})
    workers[1].serve(_local_trace(4, 300), recorded=300)
    out = L.LiveRouting(str(model), cache=tmp_path / "c").harvest([w.url for w in workers] + ["http://127.0.0.1:9"])
    assert len(out["errors"]) == 2 and any("router-trace" in e for e in out["errors"])
    assert out["tokens"] == 300 and "profile" in out            # the good worker's trace still makes the profile


def test_traces_of_different_models_are_not_joined():
    with pytest.raises(ModelError, match="disagree on the model"):
        L.join_traces([_local_trace(1, 10, e=32), _local_trace(1, 10, e=64)])


def test_the_harvester_exists_only_for_workers_that_record(model):
    from orchestrator.launch.settings import WorkerSettings
    from orchestrator.launch.spec import LaunchSpec

    s = WorkerSettings(model_path=str(model))
    plain = LaunchSpec("w0", ("llama-server", "-m", str(model)), settings=s)
    tracing = LaunchSpec("w1", ("llama-server", "-m", str(model), "--router-trace", "2048"), settings=s)
    assert L.LiveRouting.from_specs([plain]) is None
    live = L.LiveRouting.from_specs([plain, tracing], "key")
    assert live.model_path == str(model) and live.api_key == "key"


def test_the_plan_adds_the_flag_only_to_a_server_that_has_it(model):
    from dataclasses import replace

    from orchestrator.backend.info import nominal_backend
    from orchestrator.launch.settings import WorkerSettings
    from orchestrator.launch.worker_spec import ROUTER_TRACE_TOKENS, spec_for_worker

    s = WorkerSettings(model_path=str(model), host="127.0.0.1", port=8081)
    backend = nominal_backend("mainline", cuda=False)
    with_flag = replace(backend, features=backend.features | {"router_trace"})
    argv = spec_for_worker("w0", s, with_flag, router_trace=ROUTER_TRACE_TOKENS).argv
    assert argv[argv.index("--router-trace") + 1] == str(ROUTER_TRACE_TOKENS)
    assert "--router-trace" not in spec_for_worker("w0", s, with_flag).argv
    assert "--router-trace" not in spec_for_worker("w0", s, backend, router_trace=ROUTER_TRACE_TOKENS).argv


def _status(live, hit_rate, streams=1, stream_hit_rate=0.0):
    chosen = {"hit_rate": hit_rate, "streams": streams, "stream_hit_rate": stream_hit_rate}
    return {"plan": {"workers": [{"name": "w0", "expert_cache": {"use_cache": True, "chosen": chosen}},
                                 {"name": "w1", "expert_cache": {"use_cache": False, "chosen": chosen}}]},
            "workers": [{"name": "w0", "metrics": {} if live is None else {"expert_cache_hit_ratio": live}},
                        {"name": "w1", "metrics": {"expert_cache_hit_ratio": 0.1}}]}


def test_status_says_when_the_live_hit_rate_differs_from_the_prediction():
    # as measured on the H200: 0.70 live serving four streams where one stream's prediction was 0.85
    (row,) = L.compare_hit_rates(_status(0.70, 0.85))            # w1 has no cache: no row
    assert row["differs"] and row["points"] == pytest.approx(15.0)
    (line,) = L.format_hit_rates([row])
    assert "live 70.0%, predicted 85.0%" in line and "differs by 15.0 points" in line
    assert "workers.live_routing: on" in line
    (close,) = L.compare_hit_rates(_status(0.82, 0.85))
    assert not close["differs"] and close["points"] == pytest.approx(3.0)
    assert "differs" not in L.format_hit_rates([close])[0]
    # a plan for four streams predicts a span: one stream's rate down to the four streams' rate
    (span,) = L.compare_hit_rates(_status(0.78, 0.85, streams=4, stream_hit_rate=0.72))
    assert not span["differs"] and span["points"] == 0.0
    (below,) = L.compare_hit_rates(_status(0.60, 0.85, streams=4, stream_hit_rate=0.72))
    assert below["differs"] and below["points"] == pytest.approx(12.0)
    (none,) = L.compare_hit_rates(_status(None, 0.85))
    assert none["live"] is None and not none["differs"]
    assert "no lookups sampled yet" in L.format_hit_rates([none])[0]


def test_the_controller_reads_its_workers_traces_and_makes_the_profile_at_the_stop(workers, model, tmp_path,
                                                                                     monkeypatch):
    """up's controller (stepped with the fake Ray of tests/cluster) with one worker that records: the worker's
    trace, read when it runs and again at the stop, becomes the model's cached profile, and status says so."""
    from orchestrator.launch.settings import WorkerSettings
    from orchestrator.launch.spec import LaunchSpec
    from tests.cluster.test_controller import make, tick

    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    w = workers[0]
    port = int(w.url.rsplit(":", 1)[1])
    spec = LaunchSpec("w0", ("llama-server", "--port", str(port), "--router-trace", "2048"), port=port,
                      settings=WorkerSettings(model_path=str(model)))
    c, _api, clock = make([spec])
    w.serve(_local_trace(5, 300), recorded=300)
    tick(c, clock, 6)
    assert c.live is not None and c.live._thread is not None    # read once the worker runs
    c.live._thread.join(30)
    assert c.status()["live_routing"]["note"] == "profile of 300 generated tokens saved"
    w.serve(_local_trace(6, 500), recorded=800)                 # it served more before the stop
    final = c.shutdown()
    assert final["live_routing"]["note"] == "profile of 500 generated tokens saved"
    prof, settings = routing.load_profile(model)
    assert prof.n_tokens == 500 and settings["input"] == routing.SERVED
