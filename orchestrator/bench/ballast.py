"""VRAM budget: stand in for a smaller GPU on a big one by holding a ballast allocation.

One child process per GPU allocates device memory through the CUDA driver API (ctypes on ``libcuda.so.1``;
``libcudart.so`` as a fallback; no torch) until only the budget is free, checks NVML's view of free memory, says
``ready`` on stdout and then holds the memory until it is told to go (stdin closed or SIGTERM), or its parent
dies (PR_SET_PDEATHSIG and stdin EOF): the memory is released when the process exits, whatever happens.

The plan must see the same budget: pass ``VramBallast.budget`` (or the CLI's ``--vram-budget``) as the topology's
``vram_limit``.

    with VramBallast(12 * GiB, gpus=[0]) as ballast:   # raises HardwareError when it cannot
        ...                                           # only 12 GiB free on GPU 0
    # released (also on Ctrl-C)

Standalone (the device check): ``python -m orchestrator.bench.ballast --budget 12GiB --gpu 0 --hold 10``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Protocol, Sequence

from orchestrator.errors import HardwareError
from orchestrator.units import GiB, MiB, fmt_bytes, parse_size

DEFAULT_TOLERANCE = 32 * MiB
GRANULARITY = 2 * MiB          # CUDA allocates device memory in 2 MiB pages
CHUNK = 4 * GiB


class BallastError(Exception):
    pass


class Device(Protocol):
    def free(self) -> int: ...                      # free bytes on the device, as verified (NVML)
    def alloc(self, n: int) -> Any | None: ...      # a handle, or None when the allocation fails
    def release(self, handle: Any) -> None: ...


def _align_down(n: int) -> int:
    return n - n % GRANULARITY


def fill_to_budget(dev: Device, budget: int, *, tolerance: int = DEFAULT_TOLERANCE, chunk: int = CHUNK,
                   settle: float = 0.0, max_steps: int = 10_000) -> dict:
    """Allocate on ``dev`` until its free memory is within ``tolerance`` of ``budget``; return what was done.

    Allocations are chunks of at most ``chunk`` bytes (2 MiB aligned). When an allocation costs more than asked
    (page rounding, driver bookkeeping) and free memory drops below the budget, the last chunk is released and
    asked again smaller by the overshoot. A failed allocation is retried at half the size. The result must
    still hold on a second read ``settle`` seconds later. Raises BallastError
    when the device has less free memory than the budget or cannot be brought to it.
    """
    if budget < 0:
        raise BallastError(f"budget must not be negative, got {budget}")
    allocs: list[tuple[Any, int]] = []
    start_free = dev.free()
    if start_free < budget - tolerance:
        raise BallastError(f"only {fmt_bytes(start_free)} free, less than the budget of {fmt_bytes(budget)}")
    shrink = 0                  # how much less to ask for next time, learned from an overshoot
    for _ in range(max_steps):
        free = dev.free()
        excess = free - budget
        if -tolerance <= excess <= tolerance:
            if settle:
                time.sleep(settle)
            if not -tolerance <= dev.free() - budget <= tolerance:      # not stable: someone else allocates
                continue
            return {"budget": budget, "free_before": start_free, "free": free, "ballast": sum(n for _, n in allocs),
                    "allocations": len(allocs)}
        if excess > tolerance:
            n = _align_down(min(chunk, excess - shrink))
            if n < GRANULARITY:
                n = GRANULARITY
            h = dev.alloc(n)
            if h is None:
                chunk = _align_down(n // 2)
                if chunk < GRANULARITY:
                    raise BallastError(f"cannot allocate: {fmt_bytes(free)} free, budget {fmt_bytes(budget)}, "
                                       f"even a {fmt_bytes(GRANULARITY)} allocation failed")
                continue
            allocs.append((h, n))
        else:
            if not allocs:
                raise BallastError(f"free memory fell to {fmt_bytes(free)}, below the budget of {fmt_bytes(budget)}, "
                                   f"with nothing of ours to release (another process is allocating?)")
            h, n = allocs.pop()
            dev.release(h)
            shrink += -excess + GRANULARITY
    raise BallastError(f"free memory did not settle within {fmt_bytes(tolerance)} of the budget")


# --- the CUDA device (ctypes) ----------------------------------------------------------------------------------

class CudaDevice:
    """One GPU through the CUDA driver API (context on the device with ``pci_bus_id``); free memory from NVML
    when ``nvml_free`` is given, else from the driver."""

    def __init__(self, pci_bus_id: str, nvml_free=None):
        self._nvml_free = nvml_free
        self._lib, self._api = self._load()
        if self._api == "driver":
            cu = self._lib
            self._check(cu.cuInit(0), "cuInit")
            dev = ctypes.c_int()
            self._check(cu.cuDeviceGetByPCIBusId(ctypes.byref(dev), pci_bus_id.encode()), "cuDeviceGetByPCIBusId")
            ctx = ctypes.c_void_p()
            self._check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
            cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        else:
            rt = self._lib
            dev = ctypes.c_int()
            self._check(rt.cudaDeviceGetByPCIBusId(ctypes.byref(dev), pci_bus_id.encode()), "cudaDeviceGetByPCIBusId")
            self._check(rt.cudaSetDevice(dev), "cudaSetDevice")
            self._check(rt.cudaFree(ctypes.c_void_p(0)), "cudaFree(0)")         # creates the context
            rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            rt.cudaFree.argtypes = [ctypes.c_void_p]
            rt.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]

    @staticmethod
    def _load():
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                return ctypes.CDLL(name), "driver"
            except OSError:
                pass
        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
            try:
                return ctypes.CDLL(name), "runtime"
            except OSError:
                pass
        raise BallastError("neither libcuda.so.1 (the NVIDIA driver) nor libcudart.so can be loaded")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise BallastError(f"{what} failed with CUDA error {rc}")

    def cuda_free(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        fn = self._lib.cuMemGetInfo_v2 if self._api == "driver" else self._lib.cudaMemGetInfo
        self._check(fn(ctypes.byref(free), ctypes.byref(total)), "MemGetInfo")
        return int(free.value)

    def free(self) -> int:
        return int(self._nvml_free()) if self._nvml_free else self.cuda_free()

    def alloc(self, n: int):
        if self._api == "driver":
            p = ctypes.c_uint64()
            return p.value if self._lib.cuMemAlloc_v2(ctypes.byref(p), n) == 0 else None
        p = ctypes.c_void_p()
        return p.value if self._lib.cudaMalloc(ctypes.byref(p), n) == 0 else None

    def release(self, handle) -> None:
        if self._api == "driver":
            self._lib.cuMemFree_v2(handle)
        else:
            self._lib.cudaFree(ctypes.c_void_p(handle))


class SimulatedDevice:
    """A pretend GPU for tests of the process lifecycle on machines without one: ``total`` bytes, ``used``
    already taken, each allocation rounded up to 2 MiB plus ``overhead`` bytes of bookkeeping."""

    def __init__(self, total: int, used: int = 0, overhead: int = 0):
        self.total, self.used, self.overhead = total, used, overhead
        self._live: dict[int, int] = {}
        self._next = 1

    def free(self) -> int:
        return self.total - self.used

    def alloc(self, n: int):
        cost = -(-n // GRANULARITY) * GRANULARITY + self.overhead
        if cost > self.free():
            return None
        self.used += cost
        self._live[self._next] = cost
        self._next += 1
        return self._next - 1

    def release(self, handle) -> None:
        self.used -= self._live.pop(handle)

    def cuda_free(self) -> int:
        return self.free()


def cuda_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:65:00.0`` (8-digit domain) as CUDA's ``[domain]:[bus]:[device].[function]`` with the
    4-digit domain (``0000:65:00.0``), the form cuDeviceGetByPCIBusId documents."""
    dom, sep, rest = nvml_bus_id.strip().partition(":")
    if not sep:
        return nvml_bus_id
    try:
        return f"{int(dom, 16):04x}:{rest.lower()}"
    except ValueError:
        return nvml_bus_id


# --- the child process -----------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def child_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.bench.ballast",
                                 description="Hold GPU memory so that only BUDGET stays free on one GPU.")
    ap.add_argument("--budget", required=True, help="free memory to leave, e.g. 12GiB")
    ap.add_argument("--gpu", type=int, default=0, help="machine GPU index (NVML order)")
    ap.add_argument("--tolerance", default=str(DEFAULT_TOLERANCE), help="how close to the budget (default 32MiB)")
    ap.add_argument("--hold", type=float, default=None,
                    help="seconds to hold, then exit (default: until stdin closes or SIGTERM)")
    ap.add_argument("--simulate", default=None, help=argparse.SUPPRESS)   # TOTAL[:USED[:OVERHEAD]] for tests
    a = ap.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))   # the driver frees everything on exit
    try:
        budget, tol = parse_size(a.budget), parse_size(a.tolerance)
        nvml_free = None
        info: dict[str, Any] = {"gpu": a.gpu}
        if a.simulate:
            parts = [parse_size(x) for x in a.simulate.split(":")]
            dev: Any = SimulatedDevice(*parts)
            info["device"] = "simulated"
        else:
            from orchestrator.hardware.nvml import Nvml

            nv = Nvml()                                # held until this process exits
            if nv.error is not None:
                raise nv.error
            bus = cuda_bus_id(nv.pci_bus_id(a.gpu))
            info["device"] = nv.name(a.gpu)
            info["pci_bus_id"] = bus

            def nvml_free() -> int:
                return nv.memory(a.gpu)[2]

            dev = CudaDevice(bus, nvml_free)
        result = fill_to_budget(dev, budget, tolerance=tol, settle=0.0 if a.simulate else 0.3)
        result.update(info)
        result["cuda_free"] = dev.cuda_free()
        if nvml_free is not None:
            result["nvml_free"] = nvml_free()
        _emit({"event": "ready", **result})
    except (BallastError, Exception) as e:        # noqa: BLE001 - reported to the parent as one line
        _emit({"event": "error", "gpu": a.gpu, "message": str(e) or type(e).__name__})
        return 1
    if a.hold is not None:
        time.sleep(a.hold)
        return 0
    try:
        while sys.stdin.buffer.read(4096):     # until the parent closes stdin or dies
            pass
    except (OSError, KeyboardInterrupt):
        pass
    return 0


# --- the parent side -------------------------------------------------------------------------------------------

class VramBallast:
    """Holds ballast on ``gpus`` (machine indexes; default all) so that ``budget`` bytes stay free on each."""

    def __init__(self, budget: int, gpus: Sequence[int] | None = None, *, tolerance: int = DEFAULT_TOLERANCE,
                 timeout: float = 120.0, python: str = sys.executable, simulate: str | None = None):
        self.budget = int(budget)
        self.gpus = list(gpus) if gpus is not None else None
        self.tolerance = tolerance
        self.timeout = timeout
        self.python = python
        self.simulate = simulate
        self.children: dict[int, subprocess.Popen] = {}
        self.ready: dict[int, dict] = {}

    def _resolve_gpus(self) -> list[int]:
        if self.gpus is not None:
            return self.gpus
        if self.simulate:
            return [0]
        from orchestrator.hardware.nvml import Nvml

        nv = Nvml.open()
        if nv is None:
            raise HardwareError("--vram-budget needs an NVIDIA GPU: NVML reports none on this machine")
        try:
            return list(range(nv.count()))
        finally:
            nv.close()

    def start(self) -> "VramBallast":
        gpus = self._resolve_gpus()
        from orchestrator.paths import pythonpath_with_package

        env = {**os.environ, "PYTHONPATH": pythonpath_with_package()}
        env.pop("CUDA_VISIBLE_DEVICES", None)     # GPUs are named by NVML index / PCI bus id: all must be visible
        try:
            for g in gpus:
                cmd = [self.python, "-m", "orchestrator.bench.ballast", "--budget", str(self.budget),
                       "--gpu", str(g), "--tolerance", str(self.tolerance)]
                if self.simulate:
                    cmd += ["--simulate", self.simulate]
                self.children[g] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, env=env, start_new_session=True)
            for g, p in self.children.items():
                self.ready[g] = self._wait_ready(g, p)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, gpu: int, p: subprocess.Popen) -> dict:
        deadline = time.monotonic() + self.timeout
        buf = b""
        while time.monotonic() < deadline:
            r, _, _ = select.select([p.stdout], [], [], 0.2)
            if r:
                chunk = os.read(p.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        ev = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if ev.get("event") == "ready":
                        return ev
                    if ev.get("event") == "error":
                        raise HardwareError(f"VRAM budget on GPU {gpu}: {ev.get('message')}")
            elif p.poll() is not None:
                break
        err = b""
        if p.poll() is not None and p.stderr is not None:
            err = p.stderr.read() or b""
        tail = " ".join(err.decode("utf-8", "replace").strip().splitlines()[-2:])
        if p.poll() is None:
            raise HardwareError(f"VRAM budget on GPU {gpu}: the ballast process was not ready within {self.timeout:g} s")
        raise HardwareError(f"VRAM budget on GPU {gpu}: the ballast process exited with status {p.returncode}"
                            + (f": {tail}" if tail else ""))

    def alive(self) -> bool:
        return bool(self.children) and all(p.poll() is None for p in self.children.values())

    def stop(self) -> None:
        """Release every ballast: close stdin, SIGTERM, then SIGKILL; reaped. Idempotent."""
        for p in self.children.values():
            try:
                if p.stdin:
                    p.stdin.close()
            except OSError:
                pass
        for p in self.children.values():
            if p.poll() is None:
                try:
                    p.terminate()
                except ProcessLookupError:
                    pass
        for p in self.children.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for f in (p.stdout, p.stderr):
                try:
                    if f:
                        f.close()
                except OSError:
                    pass
        self.children.clear()

    def status(self) -> dict:
        return {"budget": self.budget, "tolerance": self.tolerance,
                "gpus": {str(g): {k: v for k, v in ev.items() if k != "event"} for g, ev in self.ready.items()}}

    def __enter__(self) -> "VramBallast":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    raise SystemExit(child_main())
