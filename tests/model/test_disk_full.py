"""A disk that fills up while a model is written: one line naming the file, a non-zero exit, no traceback.

`synth-model` leaves nothing half-written. A download keeps its `.part` (a pull resumes it) and, once there is
room again, the next pull fetches only the rest. A real small filesystem (tmpfs, mounted by the test; skipped
where this user may not mount) that another writer fills as soon as the `.part` file has grown, after the
command's own free-space check passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

MiB = 1 << 20


def _mount_tmpfs(mnt: Path, size: str):
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}): needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture()
def small_fs(tmp_path):
    yield from _mount_tmpfs(tmp_path / "fs", "100m")


@pytest.fixture()
def cache_fs(tmp_path):
    """Room for a 64 MiB download and the 1 GiB margin pull keeps free, and no more."""
    yield from _mount_tmpfs(tmp_path / "cache", "1100m")


def _fill_when(part: Path, fs: Path, stop: threading.Event) -> None:
    """Take every free byte of ``fs`` once ``part`` holds more than its header (the free-space check passed)."""
    while not stop.is_set():
        try:
            if part.stat().st_size > 4 * MiB:
                break
        except FileNotFoundError:
            pass
        time.sleep(0.001)
    with open(fs / "filler", "wb") as f:
        # reserve nearly all of it at once (writing a GiB took longer than the download on a loaded CI machine),
        # then write until nothing is left
        st = os.statvfs(fs)
        try:
            os.posix_fallocate(f.fileno(), 0, max(0, st.f_bavail * st.f_frsize - 8 * MiB))
        except OSError:
            pass
        f.seek(0, os.SEEK_END)
        chunk = b"\0" * MiB
        try:
            while not stop.is_set():
                f.write(chunk)
                f.flush()
        except OSError:
            pass


def test_disk_full_while_synth_model_writes(small_fs):
    out = small_fs / "m.gguf"
    stop = threading.Event()
    filler = threading.Thread(target=_fill_when, args=(out.with_name(out.name + ".part"), small_fs, stop),
                              daemon=True)
    filler.start()
    try:
        # about 70 MiB of weights: fits the 100 MiB filesystem when the check runs, not once the filler has run
        res = subprocess.run([sys.executable, "-m", "orchestrator", "synth-model", str(out), "--like",
                              "qwen3-30b-a3b", "--scale", "0.125", "--quant", "q8_0"],
                             capture_output=True, text=True, timeout=300, env=dict(os.environ))
    finally:
        stop.set()
        filler.join(30)
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and f"{out}: disk full while writing" in errors[0], res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]     # no model, no .part


def test_disk_full_while_a_download_runs_then_the_next_pull_resumes(cache_fs, tmp_path, tiny_models):
    from .remote_servers import Blob, FileServer

    model = tiny_models["qwen3moe"].read_bytes()
    blob = Blob(head=model, size=64 * MiB)              # a real GGUF, then padding: 64 MiB on the wire
    env = {**os.environ, "ORCHESTRATOR_CACHE": str(cache_fs)}
    with FileServer({"/m/model.gguf": blob}) as srv:
        srv.pace_s = 0.002                              # about 30 MiB/s: the filler is faster
        stop = threading.Event()
        part = None

        def fill_once_a_part_grows():
            nonlocal part
            while not stop.is_set() and part is None:
                part = next(cache_fs.rglob("model.gguf.part"), None)
                time.sleep(0.001)
            if part is not None:
                _fill_when(part, cache_fs, stop)

        filler = threading.Thread(target=fill_once_a_part_grows, daemon=True)
        filler.start()
        try:
            res = subprocess.run([sys.executable, "-m", "orchestrator", "pull", srv.url("/m/model.gguf"),
                                  "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
        finally:
            stop.set()
            filler.join(30)
        assert res.returncode != 0, res.stderr
        errors = [ln for ln in res.stderr.splitlines() if "error" in ln]
        assert len(errors) == 1 and f"cannot write {part}" in errors[0] and "pull again to resume" in errors[0], \
            res.stderr
        assert "Traceback" not in res.stderr
        assert not part.with_name("model.gguf").exists()         # no model file that is not whole
        kept = part.stat().st_size
        assert 4 * MiB < kept < blob.size

        (cache_fs / "filler").unlink()                           # room again: the next pull fetches the rest
        srv.pace_s = 0.0
        sent = srv.stats.sent
        res = subprocess.run([sys.executable, "-m", "orchestrator", "pull", srv.url("/m/model.gguf"),
                              "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr
        path = Path(res.stdout.strip())
        assert path == part.with_name("model.gguf") and not part.exists()
        assert path.stat().st_size == blob.size and path.read_bytes()[:len(model)] == model
        assert srv.stats.sent - sent < blob.size - kept + 2 * MiB        # the kept part was not fetched again
