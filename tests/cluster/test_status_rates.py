"""``status`` and the exported gauges show the same tokens/s, and neither reads 0 while a deployment generates.

llama-server adds a request's tokens to its counters when the request ends, so a rate between two scrapes 2 s
apart was 0 while every stream was mid-generation; and ``status`` showed the worker actor's latest sample while
Prometheus read the gauge Ray had exported at another moment (0/0.0 in ``status`` against 762 t/s exported)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.cluster.metrics import RATE_WINDOW_S, DictSink, TokenRates, WorkerSampler
from orchestrator.cluster.view import format_status, worker_rows
from orchestrator.commands.status import add_recent_latency


def counters(prompt: float, generated: float) -> dict[str, float]:
    return {"llamacpp:prompt_tokens_total": prompt, "llamacpp:tokens_predicted_total": generated}


def test_the_rate_does_not_drop_to_zero_between_the_ends_of_long_requests():
    """16 streams of 10 s each end together every 10 s (the counters jump then); scraped every 2 s."""
    r = TokenRates()
    seen = []
    for k in range(0, 31):
        t = 2.0 * k
        ended = int(t // 10)                        # batches of 16 requests finished by now
        r.update(counters(16 * 100 * ended, 16 * 500 * ended), t)
        seen.append((t, r.generation_tps, r.prompt_tps))
    after_first = [(t, g) for t, g, _ in seen if t >= 10]
    assert all(g > 0 for _, g in after_first), after_first
    # once the window is full it holds about three batches of 8000 tokens in 30 s: the true 800 t/s
    steady = [g for t, g, _ in seen if t >= 10 + RATE_WINDOW_S]
    assert steady and all(700 <= g <= 1100 for g in steady), steady


def test_the_sampler_exports_the_windowed_rate_it_reports():
    pages = iter([counters(0, 0), counters(0, 0), counters(200, 1524), counters(200, 1524)])
    sink = DictSink()
    s = WorkerSampler("w0", "n0", "http://x", None, sink, fetch=lambda url, path, timeout: _page(next(pages)),
                      rss=lambda pid: 0, pids=lambda pid: [], nvml=type("N", (), {"available": False})())
    for t in (0.0, 2.0, 4.0, 6.0):
        out = s.sample({"healthy": True, "pid": None}, t)
    assert out["generation_tps"] == pytest.approx(1524 / 6, abs=0.01)
    assert out["prompt_tps"] == pytest.approx(200 / 6, abs=0.01)
    assert sink.get("orchestrator_worker_generation_tokens_per_second", worker="w0", node="n0") == \
        out["generation_tps"]


def _page(c: dict[str, float]) -> str:
    return "".join(f"{k} {v}\n" for k, v in c.items())


def test_status_shows_the_tokens_per_second_the_gauges_export():
    page = ('# TYPE ray_orchestrator_worker_generation_tokens_per_second gauge\n'
            'ray_orchestrator_worker_generation_tokens_per_second{Component="core_worker",WorkerId="ab",node="n0",'
            'worker="w0"} 762.0\n'
            'ray_orchestrator_worker_prompt_tokens_per_second{Component="core_worker",WorkerId="ab",node="n0",'
            'worker="w0"} 1234.5\n').encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # the worker actor's own latest sample read 0 (a scrape between request ends)
        st = {"namespace": "ns", "phase": "ready", "gateway": {},
              "metrics_url": f"http://127.0.0.1:{server.server_address[1]}/metrics",
              "workers": [{"name": "w0", "state": "ready", "metrics": {"prompt_tps": 0.0, "generation_tps": 0.0,
                                                                       "rss_bytes": 5}},
                          {"name": "w1", "state": "ready", "metrics": {"prompt_tps": 3.0, "generation_tps": 4.0}}]}
        add_recent_latency(st)
    finally:
        server.shutdown()
        server.server_close()
    rows = worker_rows(st["workers"])
    assert rows[0][7] == "1234/762.0" and rows[1][7] == "3/4.0"      # w1 has no exported series: its own
    assert st["workers"][0]["metrics"]["rss_bytes"] == 5
    assert "1234/762.0" in format_status(st)
