"""VRAM ballast: the allocation loop on fake devices; the child process lifecycle for real (simulated device);
and, marked gpu, the real thing through the CUDA driver on GPU 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.bench.ballast import DEFAULT_TOLERANCE, GRANULARITY, BallastError, VramBallast, fill_to_budget
from orchestrator.errors import HardwareError
from orchestrator.units import GiB, MiB

REPO = Path(__file__).resolve().parents[2]


class FakeGpu:
    """total/used bytes; each allocation costs its size rounded to 2 MiB plus ``overhead``; allocations larger
    than ``max_single`` fail (fragmentation); ``thief`` bytes vanish at every free() read after the first."""

    def __init__(self, total, used=0, overhead=0, max_single=None, thief=0):
        self.total, self.used, self.overhead, self.max_single, self.thief = total, used, overhead, max_single, thief
        self.live = {}
        self.n = 0
        self.reads = 0
        self.calls = []

    def free(self):
        self.reads += 1
        if self.thief and self.reads > 1:
            self.used += self.thief
        return self.total - self.used

    def alloc(self, n):
        self.calls.append(n)
        cost = -(-n // GRANULARITY) * GRANULARITY + self.overhead
        if cost > self.total - self.used or (self.max_single and n > self.max_single):
            return None
        self.n += 1
        self.live[self.n] = cost
        self.used += cost
        return self.n

    def release(self, h):
        self.used -= self.live.pop(h)


def test_cuda_bus_id_from_nvml():
    from orchestrator.bench.ballast import cuda_bus_id

    assert cuda_bus_id("00000000:65:00.0") == "0000:65:00.0"
    assert cuda_bus_id("00000001:E3:00.0") == "0001:e3:00.0"
    assert cuda_bus_id("0000:65:00.0") == "0000:65:00.0"


def _within(free, budget, tol=DEFAULT_TOLERANCE):
    return budget - tol <= free <= budget + tol


def test_fills_an_h200_down_to_the_budget():
    dev = FakeGpu(total=140 * GiB, used=600 * MiB)
    r = fill_to_budget(dev, 12 * GiB)
    assert _within(dev.total - dev.used, 12 * GiB)
    assert r["free"] == dev.total - dev.used and r["ballast"] == sum(dev.live.values())
    assert all(n % GRANULARITY == 0 for n in dev.calls)


def test_allocation_overhead_above_the_tolerance_is_learned_not_looped():
    dev = FakeGpu(total=80 * GiB, used=GiB, overhead=48 * MiB)
    fill_to_budget(dev, 8 * GiB)
    assert _within(dev.total - dev.used, 8 * GiB)
    assert len(dev.calls) < 60


def test_failed_big_allocations_are_retried_smaller():
    dev = FakeGpu(total=40 * GiB, max_single=GiB + 10 * MiB)
    fill_to_budget(dev, 4 * GiB, chunk=16 * GiB)
    assert _within(dev.total - dev.used, 4 * GiB)
    assert max(dev.live.values()) <= GiB + 10 * MiB


def test_budget_at_free_allocates_nothing_and_above_free_is_refused():
    dev = FakeGpu(total=24 * GiB, used=4 * GiB)
    r = fill_to_budget(dev, 20 * GiB)
    assert r["ballast"] == 0 and dev.calls == []
    with pytest.raises(BallastError, match=r"only 20.0 GiB free, less than the budget of 21.0 GiB"):
        fill_to_budget(FakeGpu(total=24 * GiB, used=4 * GiB), 21 * GiB)


def test_another_process_eating_memory_ends_in_an_error_not_a_loop():
    dev = FakeGpu(total=80 * GiB, thief=GiB)
    with pytest.raises(BallastError, match="another process"):
        fill_to_budget(dev, 12 * GiB)
    assert dev.live == {}                      # everything of ours was released on the way down


# --- the child process, for real (simulated device) -------------------------------------------------------------

def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_ballast_process_holds_until_stopped():
    b = VramBallast(12 * GiB, gpus=[0], simulate="80GiB:1GiB:1MiB")
    with b:
        pid = b.children[0].pid
        assert b.alive() and psutil.pid_exists(pid)
        st = b.status()
        assert st["budget"] == 12 * GiB
        g = st["gpus"]["0"]
        assert _within(g["free"], 12 * GiB) and g["device"] == "simulated" and g["ballast"] > 60 * GiB
    assert _gone(pid) and b.children == {}


def test_ballast_released_on_ctrl_c():
    b = VramBallast(2 * GiB, gpus=[0, 1], simulate="16GiB")
    pids = []
    with pytest.raises(KeyboardInterrupt):
        with b:
            pids = [p.pid for p in b.children.values()]
            raise KeyboardInterrupt
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_ballast_that_cannot_reach_the_budget_is_an_error_and_leaves_nothing():
    b = VramBallast(12 * GiB, gpus=[0, 1], simulate="8GiB")
    with pytest.raises(HardwareError, match=r"VRAM budget on GPU 0: only 8.0 GiB free, less than the budget of 12.0 GiB"):
        b.start()
    assert b.children == {}


def test_ballast_child_dies_with_its_parent(tmp_path):
    """SIGKILL the process holding the ballast: its child must not keep the memory."""
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from orchestrator.bench.ballast import VramBallast
        b = VramBallast(1 << 30, gpus=[0], simulate="4GiB").start()
        print(b.children[0].pid, flush=True)
        time.sleep(60)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        child = int(holder.stdout.readline())
        assert psutil.pid_exists(child)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert _gone(child)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


@pytest.mark.gpu
def test_real_ballast_on_gpu0_leaves_the_budget_free_and_gives_it_back():
    """Device counterpart: run on the GPU machine (`pytest tests/bench -m gpu`)."""
    from orchestrator.hardware.nvml import Nvml

    nv = Nvml.open()
    assert nv is not None
    try:
        free_before = nv.memory(0)[2]
        budget = min(8 * GiB, free_before // 2)
        with VramBallast(budget, gpus=[0]) as b:
            free_held = nv.memory(0)[2]
            st = b.status()["gpus"]["0"]
            print(f"GPU0 free before {free_before / GiB:.2f} GiB, held at {free_held / GiB:.3f} GiB "
                  f"(budget {budget / GiB:.2f} GiB; cuda_free {st['cuda_free'] / GiB:.3f} GiB)")
            assert _within(free_held, budget)
        deadline = time.monotonic() + 10
        while nv.memory(0)[2] < free_before - 256 * MiB and time.monotonic() < deadline:
            time.sleep(0.2)
        assert nv.memory(0)[2] >= free_before - 256 * MiB
    finally:
        nv.close()


def test_without_a_gpu_the_budget_is_a_clear_error(tmp_path):
    from orchestrator.hardware.nvml import Nvml

    if Nvml.open() is not None:
        pytest.skip("this machine has a GPU: the real ballast test covers it")
    with pytest.raises(HardwareError, match="--vram-budget needs an NVIDIA GPU"):
        VramBallast(GiB).start()
