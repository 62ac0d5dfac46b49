"""A disk that fills up while `synth-model` writes: one line naming the file, exit 2, nothing half-written.

A real small filesystem (tmpfs, mounted by the test; skipped where this user may not mount) that another writer
fills as soon as the model's `.part` file appears, after synth-model's own free-space check passed.
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


@pytest.fixture()
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}): needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


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
