"""Reading the model ahead into the page cache (orchestrator.launch.prefetch): the rule for when, and the real
kernel doing it: a file evicted from the page cache is resident again after advise_files, as mincore(2) says."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import pytest

from orchestrator.launch.prefetch import CHUNK, Prefetch, advise_files, eligible

GiB = 1 << 30


def resident_fraction(path) -> float:
    """Share of the file's pages in the page cache: mincore(2) on a read-only mapping made through libc (Python's
    mmap does not expose the address of a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        assert rc == 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) / n


def evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture()
def big_file(tmp_path):
    p = tmp_path / "model.gguf"
    with open(p, "wb") as f:
        for _ in range(16):
            f.write(os.urandom(4 << 20))       # 64 MiB, 8 chunks
        f.flush()
        os.fsync(f.fileno())
    return p


def test_advise_files_brings_an_evicted_file_back_into_the_page_cache(big_file):
    evict(big_file)
    if resident_fraction(big_file) > 0.5:
        pytest.skip("this kernel/filesystem keeps the file cached after POSIX_FADV_DONTNEED (tmpfs?)")
    assert advise_files([str(big_file), str(big_file.parent / "missing.gguf")]) == os.path.getsize(big_file)
    deadline = time.monotonic() + 20
    while resident_fraction(big_file) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_fraction(big_file) >= 0.99


def test_a_stopped_prefetch_asks_for_no_more(big_file):
    p = Prefetch([str(big_file)])
    p.stop()                                  # stopped before it ran: nothing asked
    p.start()
    assert p.join(10) and p.asked == 0 and p.seconds is not None
    q = Prefetch([str(big_file)]).start()
    assert q.join(30) and q.asked == os.path.getsize(big_file)
    assert CHUNK == 8 << 20


def test_when_to_read_ahead():
    ok, why = eligible(16 * GiB, ["pinned"], 1, 100 * GiB)
    assert ok and "16.0 GiB" in why
    assert eligible(16 * GiB, ["mmap"], 1, 100 * GiB)[0]                  # one node: placement cannot be wrong
    assert eligible(16 * GiB, ["pinned", "pinned"], 2, 100 * GiB)[0]      # pinned: the cache is only a source
    ok, why = eligible(16 * GiB, ["pinned", "mmap"], 2, 100 * GiB)
    assert not ok and "workers.warmup" in why
    ok, why = eligible(90 * GiB, ["pinned"], 1, 100 * GiB)
    assert not ok and "80%" in why
    assert not eligible(1 * GiB, [], 1, 100 * GiB)[0]
