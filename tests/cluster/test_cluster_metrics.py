"""Worker metrics: llama-server's real /metrics page parsed, rates, memory, GPUs (fake NVML), NUMA balancing."""

from __future__ import annotations

import os
import subprocess
import time
from types import SimpleNamespace

import pytest

from orchestrator.cluster.metrics import (
    METRICS, TAG_KEYS, DictSink, NodeClaim, TokenRates, WorkerSampler, fetch_text, numa_balancing, parse_prometheus,
    sample_gpus, tree_rss, visible_gpus,
)
from orchestrator.hardware.nvml import Nvml

from cluster_support import free_port, llama_spec, post_json, wait_for


@pytest.fixture(scope="module")
def live_server(llama_server_path, tiny_gguf, tmp_path_factory):
    """A real llama-server with --metrics."""
    spec = llama_spec("m0", llama_server_path, tiny_gguf)
    p = subprocess.Popen(list(spec.argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, cwd=tmp_path_factory.mktemp("m0"))
    try:
        assert wait_for(lambda: fetch_text(spec.url, "/health", 1.0) is not None, 30), "llama-server did not start"
        yield spec, p
    finally:
        p.terminate()
        p.wait(10)


def test_parse_real_llama_server_metrics_and_rates(live_server):
    spec, proc = live_server
    page = fetch_text(spec.url, "/metrics", 5)
    m = parse_prometheus(page)
    for key in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:requests_processing"):
        assert key in m
    rates = TokenRates()
    t0 = time.monotonic()
    rates.update(m, t0)
    code, body = post_json(spec.url + "/v1/completions", {"prompt": "hello there", "max_tokens": 16})
    assert code == 200
    m2 = parse_prometheus(fetch_text(spec.url, "/metrics", 5))
    rates.update(m2, t0 + 2.0)
    generated = m2["llamacpp:tokens_predicted_total"] - m["llamacpp:tokens_predicted_total"]
    assert generated >= body["usage"]["completion_tokens"] > 0
    assert rates.generation_tps == pytest.approx(generated / 2.0)
    assert rates.prompt_tps == pytest.approx(
        (m2["llamacpp:prompt_tokens_total"] - m["llamacpp:prompt_tokens_total"]) / 2.0) and rates.prompt_tps > 0


def test_rates_reset_when_counters_go_back():
    r = TokenRates()
    r.update({"llamacpp:prompt_tokens_total": 100, "llamacpp:tokens_predicted_total": 50}, 0.0)
    r.update({"llamacpp:prompt_tokens_total": 5, "llamacpp:tokens_predicted_total": 2}, 1.0)   # a restart
    assert r.prompt_tps == 0.0 and r.generation_tps == 0.0
    r.update({"llamacpp:prompt_tokens_total": 15, "llamacpp:tokens_predicted_total": 12}, 3.0)
    assert r.prompt_tps == 5.0 and r.generation_tps == 5.0


def test_parse_ignores_comments_labels_and_garbage():
    text = "# HELP x y\n# TYPE x counter\nx 3\nlab{a=\"b\"} 4\nbad line\ny NaNx\nz 1e3\n"
    assert parse_prometheus(text) == {"x": 3.0, "z": 1000.0}


def test_tree_rss_counts_children():
    p = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        time.sleep(0.3)
        import psutil

        own = psutil.Process(p.pid).memory_info().rss
        assert tree_rss(p.pid) > own
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    assert tree_rss(p.pid) == 0


def test_numa_balancing_reads_under_a_root(tmp_path):
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/numa_balancing").write_text("1\n")
    assert numa_balancing(str(tmp_path)) == 1
    assert numa_balancing(str(tmp_path / "nope")) is None


def test_visible_gpus():
    uuids = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]
    assert visible_gpus(None, 3, uuids) == [0, 1, 2]
    assert visible_gpus("2,0", 3, uuids) == [2, 0]
    assert visible_gpus("0,7,1", 3, uuids) == [0]             # CUDA stops at the first invalid entry
    assert visible_gpus("GPU-bbbb,2", 3, uuids) == [1, 2]      # UUID prefixes
    assert visible_gpus("", 3, uuids) == [] and visible_gpus("-1", 3, uuids) == []


class FakeNvmlModule:
    """Just the NVML calls Nvml uses, with the units NVML returns (bytes, %, C, mW)."""

    def __init__(self):
        self.devs = [dict(uuid=b"GPU-0000", used=1 << 30, total=80 << 30, gpu=50, temp=60, mw=250000, procs=[]),
                     dict(uuid=b"GPU-1111", used=3 << 30, total=80 << 30, gpu=97, temp=71, mw=612500,
                          procs=[SimpleNamespace(pid=4242, usedGpuMemory=2 << 30),
                                 SimpleNamespace(pid=1, usedGpuMemory=1 << 30)])]

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.devs)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.devs[i]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=h["used"], total=h["total"], free=h["total"] - h["used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=h["gpu"])

    def nvmlDeviceGetTemperature(self, h, kind):
        return h["temp"]

    def nvmlDeviceGetPowerUsage(self, h):
        return h["mw"]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return h["procs"]


def test_sampler_writes_every_metric_with_tags(tmp_path):
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/numa_balancing").write_text("0\n")
    page = iter([
        "llamacpp:prompt_tokens_total 100\nllamacpp:tokens_predicted_total 40\nllamacpp:requests_processing 2\n"
        "llamacpp:requests_deferred 1\n",
        "llamacpp:prompt_tokens_total 300\nllamacpp:tokens_predicted_total 90\nllamacpp:requests_processing 1\n"
        "llamacpp:requests_deferred 0\n"])
    sink = DictSink()
    s = WorkerSampler("w0", "nodeA", "http://x", "1", sink, fetch=lambda url, path, t: next(page),
                      rss=lambda pid: 123 << 20, pids=lambda pid: [pid, 4242], nvml=Nvml(FakeNvmlModule()),
                      root=str(tmp_path))
    s.sample({"healthy": True, "pid": 4000, "restarts": 0}, 10.0)
    out = s.sample({"healthy": True, "pid": 4000, "restarts": 2}, 12.0)
    tags = {"worker": "w0", "node": "nodeA"}
    assert out["prompt_tps"] == 100.0 and out["generation_tps"] == 25.0
    assert sink.get("orchestrator_worker_prompt_tokens_per_second", **tags) == 100.0
    assert sink.get("orchestrator_worker_generation_tokens_per_second", **tags) == 25.0
    assert sink.get("orchestrator_worker_requests_in_flight", **tags) == 1.0
    assert sink.get("orchestrator_worker_resident_memory_bytes", **tags) == 123 << 20
    assert sink.get("orchestrator_worker_healthy", **tags) == 1.0
    assert sink.get("orchestrator_worker_restarts", **tags) == 2.0
    assert sink.get("orchestrator_node_numa_balancing", node="nodeA") == 0.0      # a node metric: no worker
    g = {**tags, "gpu": "1"}                                  # only the visible GPU (CUDA_VISIBLE_DEVICES=1)
    assert sink.get("orchestrator_gpu_memory_used_bytes", **g) == 3 << 30
    assert sink.get("orchestrator_gpu_utilization_percent", **g) == 97.0
    assert sink.get("orchestrator_gpu_temperature_celsius", **g) == 71.0
    assert sink.get("orchestrator_gpu_power_watts", **g) == 612.5
    assert sink.get("orchestrator_worker_vram_bytes", **g) == 2 << 30   # only the worker's own process
    assert sink.get("orchestrator_gpu_memory_used_bytes", **{**tags, "gpu": "0"}) is None
    # every metric the sampler writes is declared with its tag keys
    for (name, tagset) in sink.values:
        assert name in METRICS and tuple(sorted(TAG_KEYS[name])) == tuple(sorted(k for k, _ in tagset))


def test_node_metrics_come_from_one_worker_per_node_and_pass_on_when_it_dies(tmp_path):
    """Two workers of one node (each its own process and sink, as Ray actors are): only the one holding the
    node's claim writes node_numa_balancing; when its process dies, the other takes over at its next sample."""
    import signal
    import subprocess
    import sys

    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/numa_balancing").write_text("1\n")
    lock = tmp_path / "logs" / ".node-metrics-nodeA.lock"

    def sampler(name, sink, node="nodeA"):
        path = tmp_path / "logs" / f".node-metrics-{node}.lock"
        return WorkerSampler(name, node, "http://x", None, sink, fetch=lambda *a: None, rss=lambda pid: 0,
                             pids=lambda pid: [], nvml=SimpleNamespace(available=False), root=str(tmp_path),
                             node_claim=NodeClaim(path))

    a_sink, b_sink, other_sink = DictSink(), DictSink(), DictSink()
    a, b = sampler("w0", a_sink), sampler("w1", b_sink)
    other = sampler("w2", other_sink, "nodeB")             # another node: its own claim
    for t in (1.0, 2.0):
        for s in (a, b, other):
            out = s.sample({"healthy": False}, t)
            assert out["numa_balancing"] == 1                                 # each worker's status still has it
    assert a_sink.get("orchestrator_node_numa_balancing", node="nodeA") == 1.0
    assert not [k for k in b_sink.values if k[0] == "orchestrator_node_numa_balancing"]
    assert other_sink.get("orchestrator_node_numa_balancing", node="nodeB") == 1.0
    a.node_claim.release()                              # as the holder's death does
    b.sample({"healthy": False}, 3.0)
    assert b_sink.get("orchestrator_node_numa_balancing", node="nodeA") == 1.0
    # held by another process: not this one's, until that process is killed
    b.node_claim.release()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys
fd = os.open({str(lock)!r}, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        c_sink = DictSink()
        c = sampler("w3", c_sink)
        c.sample({"healthy": False}, 4.0)
        assert not [k for k in c_sink.values if k[0] == "orchestrator_node_numa_balancing"]
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        c.sample({"healthy": False}, 5.0)
        assert c_sink.get("orchestrator_node_numa_balancing", node="nodeA") == 1.0
    finally:
        holder.kill()


def test_the_restart_counter_exists_at_0_from_the_first_sample():
    """It used to appear only after a first restart, so a dashboard could not tell 0 from no data."""
    sink = DictSink()
    s = WorkerSampler("w0", "n", "http://x", None, sink, fetch=lambda *a: None, rss=lambda pid: 0,
                      pids=lambda pid: [], nvml=SimpleNamespace(available=False), root="/nonexistent")
    tags = {"worker": "w0", "node": "n"}
    s.sample({"healthy": False, "pid": None, "restarts": 0}, 1.0)
    assert sink.get("orchestrator_worker_restarts", **tags) == 0.0
    s.sample({"healthy": True, "pid": None, "restarts": 0}, 2.0)
    s.sample({"healthy": True, "pid": None, "restarts": 1}, 3.0)
    s.sample({"healthy": True, "pid": None, "restarts": 1}, 4.0)
    assert sink.get("orchestrator_worker_restarts", **tags) == 1.0
    # a sampler that starts on a worker with restarts behind it counts them once
    late = DictSink()
    s = WorkerSampler("w0", "n", "http://x", None, late, fetch=lambda *a: None, rss=lambda pid: 0,
                      pids=lambda pid: [], nvml=SimpleNamespace(available=False), root="/nonexistent")
    s.sample({"healthy": True, "pid": None, "restarts": 3}, 1.0)
    s.sample({"healthy": True, "pid": None, "restarts": 3}, 2.0)
    assert late.get("orchestrator_worker_restarts", **tags) == 3.0


def test_every_histogram_has_buckets_and_tag_keys():
    from orchestrator.cluster.metrics import BUCKETS

    hist = {n for n, (kind, _) in METRICS.items() if kind == "histogram"}
    assert hist and hist == set(BUCKETS)
    for name in hist:
        b = BUCKETS[name]
        assert list(b) == sorted(b) and b[0] > 0 and TAG_KEYS[name] == ("model", "replica")
    assert BUCKETS["orchestrator_gateway_time_to_first_token_seconds"][0] <= 0.01
    assert BUCKETS["orchestrator_gateway_time_to_first_token_seconds"][-1] >= 60


def test_sampler_exports_the_expert_cache_counters():
    pages = iter([
        # a build without the cache, then the cache, then more lookups, then a restart of llama-server
        "llamacpp:prompt_tokens_total 1\n",
        "llamacpp:moe_cache_active 1\nllamacpp:moe_cache_bytes 2.5e+09\nllamacpp:moe_cache_lookups_total 1000\n"
        "llamacpp:moe_cache_hits_total 900\nllamacpp:moe_cache_misses_total 100\n"
        "llamacpp:moe_cache_uploaded_bytes_total 8.8e+07\n",
        "llamacpp:moe_cache_active 1\nllamacpp:moe_cache_bytes 2.5e+09\nllamacpp:moe_cache_lookups_total 1500\n"
        "llamacpp:moe_cache_hits_total 1300\nllamacpp:moe_cache_misses_total 200\n"
        "llamacpp:moe_cache_uploaded_bytes_total 1.76e+08\nllamacpp:moe_cache_cpu_misses_total 30\n"
        "llamacpp:moe_cache_prefill_saved_bytes_total 3.5e+08\nllamacpp:moe_cache_prefill_copied_bytes_total 9e+08\n",
        "llamacpp:moe_cache_active 1\nllamacpp:moe_cache_bytes 2.5e+09\nllamacpp:moe_cache_lookups_total 10\n"
        "llamacpp:moe_cache_hits_total 5\nllamacpp:moe_cache_misses_total 5\n"
        "llamacpp:moe_cache_uploaded_bytes_total 4.4e+06\n",
    ])
    sink = DictSink()
    s = WorkerSampler("w0", "n", "http://x", None, sink, fetch=lambda *a: next(pages), rss=lambda pid: 0,
                      pids=lambda pid: [], nvml=SimpleNamespace(available=False), root="/nonexistent")
    tags = {"worker": "w0", "node": "n"}
    out = s.sample({"healthy": True, "pid": None, "restarts": 0}, 1.0)
    assert "expert_cache_hit_ratio" not in out
    assert sink.get("orchestrator_worker_expert_cache_lookups", **tags) is None
    out = s.sample({"healthy": True, "pid": None, "restarts": 0}, 2.0)
    assert out["expert_cache_hit_ratio"] == 0.9
    assert sink.get("orchestrator_worker_expert_cache_lookups", **tags) == 1000
    assert sink.get("orchestrator_worker_expert_cache_bytes", **tags) == 2.5e9
    out = s.sample({"healthy": True, "pid": None, "restarts": 0}, 3.0)
    assert out["expert_cache_hit_ratio"] == 0.8                   # 400 hits of the last 500 lookups
    assert sink.get("orchestrator_worker_expert_cache_lookups", **tags) == 1500
    assert sink.get("orchestrator_worker_expert_cache_misses", **tags) == 200
    assert sink.get("orchestrator_worker_expert_cache_uploaded_bytes", **tags) == 1.76e8
    assert sink.get("orchestrator_worker_expert_cache_cpu_misses", **tags) == 30   # a build that counts them
    # what prompts read from the slots instead of copying (a build whose prompts read them)
    assert sink.get("orchestrator_worker_expert_cache_prompt_saved_bytes", **tags) == 3.5e8
    assert sink.get("orchestrator_worker_expert_cache_prompt_copied_bytes", **tags) == 9e8
    out = s.sample({"healthy": True, "pid": None, "restarts": 0}, 4.0)   # restarted: counting starts again
    assert out["expert_cache_hit_ratio"] == 0.5
    assert sink.get("orchestrator_worker_expert_cache_lookups", **tags) == 1510
    for (name, tagset) in sink.values:
        assert name in METRICS and tuple(sorted(TAG_KEYS[name])) == tuple(sorted(k for k, _ in tagset))


def test_sampler_without_health_reports_zero_and_does_not_scrape():
    calls = []
    sink = DictSink()
    s = WorkerSampler("w0", "n", "http://x", None, sink, fetch=lambda *a: calls.append(a), rss=lambda pid: 0,
                      pids=lambda pid: [], nvml=SimpleNamespace(available=False), root="/nonexistent")
    out = s.sample({"healthy": False, "pid": None, "restarts": 0}, 1.0)
    assert calls == [] and out["generation_tps"] == 0.0
    assert sink.get("orchestrator_worker_healthy", worker="w0", node="n") == 0.0


def test_nvml_without_driver_is_unavailable():
    class Broken:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    n = Nvml(Broken())
    assert not n.available and sample_gpus(n, [0], []) == []


@pytest.mark.gpu
def test_nvml_reads_real_gpus():
    n = Nvml()
    assert n.available
    s = sample_gpus(n, range(n.count()), [os.getpid()])
    assert len(s) == n.count() and all(g.memory_total > 0 and g.temperature > 0 for g in s)


def test_fetch_text_of_nothing_is_none():
    assert fetch_text(f"http://127.0.0.1:{free_port()}", "/metrics", 1.0) is None
