"""Resource sampling: the reduction on a fake NVML, the process-tree RSS for real, and (gpu) real NVML reads."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from orchestrator.bench.sampler import Nvml, ResourceSampler, gpu_free, process_tree_rss

GiB = 1 << 30


class FakeNvml:
    def __init__(self):
        self.used = {0: 10 * GiB, 1: 1 * GiB}
        self.power = {0: 100.0, 1: 50.0}
        self.temp = {0: 40.0, 1: 30.0}
        self.procs = {0: {}, 1: {}}

    def count(self):
        return 2

    def memory(self, i):
        return 80 * GiB, self.used[i], 80 * GiB - self.used[i]

    def power_w(self, i):
        return self.power[i]

    def temperature_c(self, i):
        return self.temp[i]

    def process_memory(self, i):
        return self.procs[i]


def test_peaks_over_the_run_power_and_temperature_over_measuring_only():
    nv = FakeNvml()
    rss = {"v": 0}
    s = ResourceSampler(nv, rss_reader=lambda pid: (rss["v"], {pid, pid + 1}))
    s.baseline()                                      # ballast + others: 10 GiB on GPU 0
    s.attach(4242)
    s.phase("load")
    nv.used[0] = 19 * GiB
    nv.power[0] = 500.0                               # load-phase power is not what is compared
    nv.procs[0] = {4243: 8 * GiB, 999: 1 * GiB}       # a child of the server and a stranger
    rss["v"] = 3 * GiB
    s.sample()
    s.phase("measure")
    nv.used[0] = 18 * GiB
    nv.power[0], nv.temp[0] = 300.0, 60.0
    s.sample()
    nv.power[0], nv.temp[0] = 200.0, 65.0
    rss["v"] = 2 * GiB
    s.sample()
    s.phase("stop")
    nv.power[0] = 999.0
    s.sample()
    out = s.summary()
    g0 = out["gpus"]["0"]
    assert g0["baseline_used"] == 10 * GiB and g0["peak_used"] == 19 * GiB and g0["peak_delta"] == 9 * GiB
    assert g0["peak_process"] == 8 * GiB
    assert g0["power_mean_w"] == 250.0 and g0["power_max_w"] == 300.0
    assert g0["temp_max_c"] == 65.0
    assert out["gpus"]["1"]["peak_delta"] == 0
    assert out["rss_peak"] == 3 * GiB and out["samples"] == 4
    assert gpu_free(nv, [0, 1]) == {"0": 62 * GiB, "1": 79 * GiB}


def test_without_nvml_only_host_memory():
    s = ResourceSampler(None, rss_reader=lambda pid: (123, {pid}))
    s.baseline()
    s.attach(1)
    s.sample()
    assert s.summary() == {"gpus": {}, "rss_peak": 123, "samples": 1}
    assert gpu_free(None, [0]) == {}


def test_process_tree_rss_counts_children_for_real():
    code = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {code!r}]); "
                               "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        total, pids = 0, set()
        while time.monotonic() < deadline:
            total, pids = process_tree_rss(parent.pid)
            if len(pids) == 2 and total > 64 << 20:
                break
            time.sleep(0.1)
        assert len(pids) == 2 and parent.pid in pids
        assert total > 64 << 20                       # the child's 64 MiB are counted
    finally:
        import psutil

        for c in psutil.Process(parent.pid).children(recursive=True):
            c.kill()
        parent.kill()
        parent.wait()
    assert process_tree_rss(parent.pid) == (0, set())


def test_thread_samples_on_its_own():
    s = ResourceSampler(None, interval=0.01, rss_reader=lambda pid: (os.getpid(), {pid}))
    s.attach(1)
    with s:
        time.sleep(0.2)
    assert s.summary()["samples"] >= 5


@pytest.mark.gpu
def test_real_nvml_reads():
    nv = Nvml.open()
    assert nv is not None and nv.count() >= 1 and nv.uuid(0).startswith("GPU-") and nv.utilization(0) >= 0
    try:
        total, used, free = nv.memory(0)
        assert total > 0 and used + free <= total + (1 << 30)
        assert nv.power_w(0) is None or nv.power_w(0) > 0
        assert nv.temperature_c(0) is None or 0 < nv.temperature_c(0) < 120
        assert nv.name(0) and ":" in nv.pci_bus_id(0)
    finally:
        nv.close()
