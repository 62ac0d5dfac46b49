"""The llama-server runner leaves nothing behind, and the log parser reads llama.cpp's buffer lines."""

from __future__ import annotations

import lzma
import os
import stat
import time
from pathlib import Path

from orchestrator.bench.logparse import MiB, device_of_buffer, parse_load_log
from lab.serverrun import run_server

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "calibration" / "cpu"


def _script(tmp_path: Path, body: str) -> str:
    p = tmp_path / "fake-server"
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_exit_while_loading_is_reported(tmp_path):
    exe = _script(tmp_path, "echo 'error: invalid argument: --bogus' >&2\nexit 1\n")
    r = run_server(exe, "m.gguf", ["--bogus"], timeout=10)
    assert not r.loaded and r.exit_code == 1
    assert "exited with status 1" in r.error and "invalid argument" in r.log


def test_timeout_kills_the_whole_process_group(tmp_path):
    pids = tmp_path / "pids"
    exe = _script(tmp_path, f"sleep 300 &\necho $! >> {pids}\necho $$ >> {pids}\nwait\n")
    t = time.monotonic()
    r = run_server(exe, "m.gguf", [], timeout=1.5)
    assert time.monotonic() - t < 20
    assert not r.loaded and "did not load" in r.error
    for pid in map(int, pids.read_text().split()):
        try:
            os.kill(pid, 0)
            alive = not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        except ProcessLookupError:
            alive = False
        assert not alive, pid


def test_parse_fixture_log():
    rep = parse_load_log(lzma.decompress((FIX / "gptoss-cpu-c4k-ub512.log.xz").read_bytes()).decode())
    assert rep.model == {"CPU": round(1282.85 * MiB), "CPU_REPACK": round(403.42 * MiB)}
    assert rep.compute == {"CPU": round(97.14 * MiB)}
    # two KV caches (full and sliding-window layers) add up
    assert rep.kv["CPU"] == round(19.0 * MiB)
    assert len(rep.kv_cells) == 2
    assert rep.context["n_ctx"] == "4096" and rep.context["flash_attn"] == "enabled"
    dev = rep.by_device()["CPU"]
    assert dev["total"] == dev["model"] + dev["kv"] + dev["output"] + dev["compute"]


def test_buffer_devices():
    assert device_of_buffer("CUDA0") == "CUDA0"
    assert device_of_buffer("CUDA1_Split") == "CUDA1"
    for host in ("CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host"):
        assert device_of_buffer(host) == "CPU"
