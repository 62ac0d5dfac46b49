"""The PCIe probe without a compiler: the CUDA runtime (libcudart) called through ctypes.

Same measurement and same output as ``native/pcie_bw.cu`` (one JSON object per line): host buffer mmap'ed,
bound to a NUMA node with mbind(2), touched, pinned with ``cudaHostRegister``, copied with
``cudaMemcpyAsync`` and timed with CUDA events, so Python's own overhead is outside the timed interval.
Run as ``python -m orchestrator.hardware.cudart_probe --node 0:0-7 [--devices all] [--bytes N] [--reps N]
[--alloc register|hostalloc]``
(in a child process: it pins its thread and binds memory). Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import json
import os
import platform
import statistics
import sys
import time
import types

# syscall numbers (mbind, move_pages) per architecture
_SYSCALLS = {"x86_64": (237, 279), "aarch64": (235, 239), "ppc64le": (259, 301), "ppc64": (259, 301)}
MPOL_BIND = 2
H2D, D2H = 1, 2
PORTABLE = 1


def cudart_candidates() -> list[str]:
    out = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            out += sorted(glob.glob(os.path.join(os.environ[env], "lib64", "libcudart.so*")), reverse=True)
    out += sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so*"), reverse=True)
    out += sorted(glob.glob("/usr/local/cuda-*/lib64/libcudart.so*"), reverse=True)
    lib = ctypes.util.find_library("cudart")
    if lib:
        out.append(lib)
    for p in sys.path:  # pip wheels: nvidia-cuda-runtime-cu12 / cu13, torch
        out += sorted(glob.glob(os.path.join(p, "nvidia", "cuda_runtime", "lib", "libcudart.so*")), reverse=True)
        out += sorted(glob.glob(os.path.join(p, "nvidia", "cu1*", "lib", "libcudart.so*")), reverse=True)
        out += sorted(glob.glob(os.path.join(p, "torch", "lib", "libcudart*.so*")), reverse=True)
    return list(dict.fromkeys(out))


def load_cudart() -> ctypes.CDLL | None:
    for cand in cudart_candidates():
        try:
            lib = ctypes.CDLL(cand)
            lib.cudaGetDeviceCount  # noqa: B018 - raises AttributeError when it is not libcudart
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _parse_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += range(int(a), int(b) + 1)
        elif part:
            out.append(int(part))
    return out


def node_of(libc, ptr: int, nbytes: int) -> int:
    """The NUMA node most of a buffer's pages are on (move_pages query on up to 64 pages), -1 if unknown."""
    nrs = _SYSCALLS.get(platform.machine())
    page = os.sysconf("SC_PAGESIZE")
    npages = nbytes // page
    n = min(64, npages)
    if nrs is None or n <= 0:
        return -1
    pages = (ctypes.c_void_p * n)(*[ptr + (npages * i // n) * page for i in range(n)])
    status = (ctypes.c_int * n)()
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(nrs[1]), 0, ctypes.c_ulong(n), pages, None, status, 0) != 0:
        return -1
    vals = [s for s in status if s >= 0]
    return max(set(vals), key=vals.count) if vals else -1


def thread_membind(libc, node: int) -> int:
    """set_mempolicy(MPOL_BIND, {node}) for this thread, or MPOL_DEFAULT when node < 0. 0 on success."""
    nr = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "ppc64": 261}.get(platform.machine())
    if nr is None:
        return -1
    libc.syscall.restype = ctypes.c_long
    if node < 0:
        return libc.syscall(ctypes.c_long(nr), 0, None, ctypes.c_ulong(0))
    mask = (ctypes.c_ulong * 16)()
    mask[node // 64] |= 1 << (node % 64)
    return libc.syscall(ctypes.c_long(nr), MPOL_BIND, mask, ctypes.c_ulong(16 * 64 + 1))


class _Host:
    """Anonymous memory bound to one NUMA node (libc mmap + the mbind syscall)."""

    def __init__(self, libc, nbytes: int, node: int):
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc, self.nbytes = libc, nbytes
        ptr = libc.mmap(None, nbytes, 0x1 | 0x2, 0x02 | 0x20, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
        if ptr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.ptr = ptr
        nrs = _SYSCALLS.get(platform.machine())
        if nrs is None:
            raise OSError(0, f"mbind: unknown syscall number on {platform.machine()}")
        mask = (ctypes.c_ulong * 16)()
        mask[node // 64] |= 1 << (node % 64)
        libc.syscall.restype = ctypes.c_long
        rc = libc.syscall(ctypes.c_long(nrs[0]), ctypes.c_void_p(ptr), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_BIND),
                          mask, ctypes.c_ulong(16 * 64 + 1), ctypes.c_uint(0))
        self.placement = "mbind"
        if rc != 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.ENOSYS):  # seccomp/containers: the pinned thread's first touch places it
                self.placement = "first-touch"
            else:
                self.close()
                raise OSError(err, f"cannot bind {nbytes} bytes to node {node}: {os.strerror(err)}")
        libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), 14)  # MADV_HUGEPAGE, best effort
        ctypes.memset(ptr, 1, nbytes)
        self.placed = node_of(libc, ptr, nbytes)

    def close(self):
        if self.ptr:
            self.libc.munmap(ctypes.c_void_p(self.ptr), self.nbytes)
            self.ptr = None


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="cudart_probe")
    ap.add_argument("--node", action="append", required=True, help="NODE:CPULIST")
    ap.add_argument("--devices", default="all")
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--alloc", choices=("register", "hostalloc"), default="register")
    args = ap.parse_args(argv)
    t_init = time.monotonic()
    rt = load_cudart()
    if rt is None:
        _emit({"kind": "init", "error": "no libcudart found (CUDA_HOME, /usr/local/cuda, pip nvidia wheels, torch)"})
        return 3
    count = ctypes.c_int(0)
    rt.cudaGetErrorString.restype = ctypes.c_char_p
    rc = rt.cudaGetDeviceCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        msg = rt.cudaGetErrorString(rc).decode() if rc else "cudaGetDeviceCount returned 0"
        _emit({"kind": "init", "error": f"no CUDA device: {msg}"})
        return 3

    def ck(rc: int, what: str):
        if rc != 0:
            raise RuntimeError(f"{what}: {rt.cudaGetErrorString(rc).decode()}")

    devs = list(range(count.value)) if args.devices == "all" else _parse_list(args.devices)
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    rt.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    rt.cudaEventSynchronize.argtypes = [ctypes.c_void_p]
    rt.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
    state = {}
    try:
        for d in devs:
            t = time.monotonic()
            ck(rt.cudaSetDevice(d), "cudaSetDevice")
            ck(rt.cudaFree(None), "CUDA context")
            dbuf, stream, e0, e1 = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            ck(rt.cudaMalloc(ctypes.byref(dbuf), ctypes.c_size_t(args.bytes)), "cudaMalloc")
            ck(rt.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "cudaStreamCreate")
            ck(rt.cudaEventCreate(ctypes.byref(e0)), "cudaEventCreate")
            ck(rt.cudaEventCreate(ctypes.byref(e1)), "cudaEventCreate")
            pci = ctypes.create_string_buffer(32)
            ck(rt.cudaDeviceGetPCIBusId(pci, 32, d), "cudaDeviceGetPCIBusId")
            state[d] = (dbuf, stream, e0, e1, pci.value.decode())
            _emit({"kind": "device", "device": d, "pci": pci.value.decode(),
                   "init_seconds": round(time.monotonic() - t, 3)})
        libc = ctypes.CDLL(None, use_errno=True)
        for spec in args.node:
            node_s, _, cpus = spec.partition(":")
            node = int(node_s)
            if cpus:
                try:
                    os.sched_setaffinity(0, _parse_list(cpus))
                except OSError:
                    pass
            t_alloc = time.monotonic()
            if args.alloc == "hostalloc":
                placement = "membind"
                if thread_membind(libc, node) != 0:
                    err = ctypes.get_errno()
                    if err not in (errno.EPERM, errno.ENOSYS):
                        _emit({"kind": "gpu", "node": node, "error": f"cannot bind memory to node {node}: "
                                                                     f"{os.strerror(err)}"})
                        continue
                    placement = "first-touch"
                p = ctypes.c_void_p()
                rc = rt.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(args.bytes), PORTABLE)
                if rc == 0:
                    ctypes.memset(p, 1, args.bytes)
                thread_membind(libc, -1)
                if rc != 0:
                    _emit({"kind": "gpu", "node": node, "error": f"cudaHostAlloc: {rt.cudaGetErrorString(rc).decode()}"})
                    continue
                host = types.SimpleNamespace(ptr=p.value, placed=node_of(libc, p.value, args.bytes),
                                             placement=placement)
            else:
                try:
                    host = _Host(libc, args.bytes, node)
                except OSError as err:
                    _emit({"kind": "gpu", "node": node, "error": str(err.strerror or err)})
                    continue
                rc = rt.cudaHostRegister(ctypes.c_void_p(host.ptr), ctypes.c_size_t(args.bytes), PORTABLE)
                if rc != 0:
                    _emit({"kind": "gpu", "node": node,
                           "error": f"cudaHostRegister: {rt.cudaGetErrorString(rc).decode()}"})
                    host.close()
                    continue
            alloc_s = time.monotonic() - t_alloc
            for d in devs:
                dbuf, stream, e0, e1, pci = state[d]
                t = time.monotonic()
                ck(rt.cudaSetDevice(d), "cudaSetDevice")
                res = {}
                for name, kind, dst, src in (("h2d", H2D, dbuf, host.ptr), ("d2h", D2H, host.ptr, dbuf)):
                    vals = []
                    for r in range(-1, args.reps):
                        ck(rt.cudaEventRecord(e0, stream), "cudaEventRecord")
                        ck(rt.cudaMemcpyAsync(dst, src, args.bytes, kind, stream), f"{name} copy")
                        ck(rt.cudaEventRecord(e1, stream), "cudaEventRecord")
                        ck(rt.cudaEventSynchronize(e1), "cudaEventSynchronize")
                        ms = ctypes.c_float()
                        ck(rt.cudaEventElapsedTime(ctypes.byref(ms), e0, e1), "cudaEventElapsedTime")
                        if r >= 0:
                            vals.append(args.bytes / (ms.value * 1e-3))
                    res[f"{name}_best"] = round(max(vals))
                    res[f"{name}_median"] = round(statistics.median(vals))
                _emit({"kind": "gpu", "device": d, "pci": pci, "node": node, "placed_node": host.placed,
                       "bytes": args.bytes, "reps": args.reps, **res, "seconds": round(time.monotonic() - t, 3),
                       "host_alloc_seconds": round(alloc_s, 3), "alloc": args.alloc, "placement": host.placement})
            if args.alloc == "hostalloc":
                rt.cudaFreeHost(ctypes.c_void_p(host.ptr))
            else:
                rt.cudaHostUnregister(ctypes.c_void_p(host.ptr))
                host.close()
    except RuntimeError as err:
        _emit({"kind": "error", "error": str(err)})
        return 1
    _emit({"kind": "done", "seconds": round(time.monotonic() - t_init, 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
