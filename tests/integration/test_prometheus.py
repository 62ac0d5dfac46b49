"""Monitoring out of the box: a real Prometheus (Debian's package), started here on 127.0.0.1 with the shipped scrape
config (docs/monitoring/prometheus.yml, its target set to this deployment's port), scrapes a real `up --detach` of
the demo topology over a tiny model while streamed requests go through the gateway; every panel of the shipped
Grafana dashboard (docs/monitoring/grafana-dashboard.json) is then asked of Prometheus' HTTP API and must answer
with series (the GPU panels only where there is a GPU), and `status` shows the gateway's time to first token.

Without the prometheus binary the test fails under CI (CI=true: scripts/setup.sh installs it there) and is
skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "topologies" / "demo.yaml"
MONITORING = REPO / "docs" / "monitoring"
NS = "itest-prom"
pytestmark = [pytest.mark.integration, pytest.mark.slow]
GPU_ONLY = ("ray_orchestrator_gpu_", "ray_orchestrator_worker_vram_bytes")


def prometheus_binary() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        why = "the prometheus binary is not installed (Debian package `prometheus`; scripts/setup.sh installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return exe


def orchestrator(*args: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def has_data(result: list[dict]) -> bool:
    """A series with a number: a quantile of a histogram with no observation in its range is NaN, no data."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the shipped dashboard; Grafana's rate interval as 1 minute."""
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"].replace("$__rate_interval", "1m")) for p in dash["panels"] for t in p["targets"]]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, llama_server_path):
    prom_exe = prometheus_binary()
    tmp = tmp_path_factory.mktemp("prom")
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": llama_server_path,
           "ORCHESTRATOR_STATE": str(tmp / "state")}
    model = S.write_tiny_llama(tmp / "tiny.gguf")
    metrics_port = S.free_port()
    sets = {"model.path": model, "model.context": 1024, "gateway.port": S.free_port(),
            "ray.dashboard_port": S.free_port(), "ray.metrics_export_port": metrics_port,
            "workers.port_base": S.free_port_base(4), "ray.namespace": NS}
    argv = ["up", str(DEMO), "--detach"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    prom = None
    try:
        up = orchestrator(*argv, env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        # the shipped scrape config, pointed at this deployment's port and scraped every second
        config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
        assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:8090"]
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
        config["global"]["scrape_interval"] = "1s"
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = S.free_port()
        prom = subprocess.Popen([prom_exe, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"))
        prom_url = f"http://127.0.0.1:{prom_port}"

        def ready():
            try:
                return urllib.request.urlopen(prom_url + "/-/ready", timeout=2).status == 200
            except OSError:
                return False
        assert S.wait_for(ready, 60, 0.5), (tmp / "prometheus.log").read_text()[-2000:]
        yield {"env": env, "prom": prom_url, "gateway": f"http://127.0.0.1:{sets['gateway.port']}", "tmp": tmp}
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(20)
        orchestrator("down", "-n", NS, env=env)


def test_every_dashboard_panel_has_data_and_status_shows_time_to_first_token(deployment):
    from orchestrator.hardware.nvml import Nvml

    gw, prom = deployment["gateway"], deployment["prom"]
    stop = threading.Event()
    codes: list[int] = []

    def load():
        while not stop.is_set():
            code, events, done = S.stream_completion(gw + "/v1/chat/completions",
                                                     {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 16})
            codes.append(code if done else -code)
            time.sleep(0.1)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    [t.start() for t in threads]
    gpu = Nvml().available
    queries = panel_queries()
    assert len(queries) >= 12
    results: dict[str, list[dict]] = {}
    try:
        def all_answer():
            for title, expr in queries:
                results[expr] = query(prom, expr)
            return all(has_data(results[e]) for _, e in queries if gpu or not any(m in e for m in GPU_ONLY))
        answered = S.wait_for(all_answer, 120, 2.0)
    finally:
        stop.set()
        [t.join(60) for t in threads]
    empty = [t for t, e in queries if not has_data(results.get(e, [])) and (gpu or not any(m in e for m in GPU_ONLY))]
    assert answered and not empty, f"panels without data: {empty}"
    assert codes and set(codes) == {200}, codes
    for title, expr in queries:                       # the query output the docs show
        values = ", ".join(f"{r['metric']}={float(r['value'][1]):.4g}" for r in results[expr]) or "(no data)"
        print(f"{title} | {expr}\n    {values}")
    # what the panels say is what the load did: streams of 16 tokens, both workers up, no restart
    p95 = [float(r["value"][1]) for r in results[queries[1][1]]]
    assert p95 and all(0 < v < 10 for v in p95 if math.isfinite(v)) and any(map(math.isfinite, p95)), p95
    restarts = results["max by (worker) (ray_orchestrator_worker_restarts_total)"]
    assert sorted(r["metric"]["worker"] for r in restarts) == ["local-0", "local-1"]
    assert all(float(r["value"][1]) == 0 for r in restarts)
    healthy = results["max by (worker) (ray_orchestrator_worker_healthy)"]
    assert [float(r["value"][1]) for r in healthy] == [1.0, 1.0]

    st = orchestrator("status", "-n", NS, env=deployment["env"], timeout=60)
    assert st.returncode == 0, st.stdout + st.stderr
    print(st.stdout)
    assert "ttft p50/p95" in st.stdout and "last 5 minutes" in st.stdout
    rows = [ln for ln in st.stdout.splitlines() if ln.startswith("local-")]
    assert len(rows) == 2 and any(" ms " in r for r in rows), st.stdout
    js = json.loads(orchestrator("status", "-n", NS, "--json", env=deployment["env"], timeout=60).stdout)
    streams = sum((w.get("latency") or {}).get("streams", 0) for w in js["workers"])
    assert streams >= 4 and all((w.get("latency") or {}).get("streams", 0) == 0 or
                                0 < w["latency"]["ttft_p50_s"] <= w["latency"]["ttft_p95_s"] for w in js["workers"])
