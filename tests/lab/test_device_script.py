"""The device script: every documented step has a body, unknown steps are refused before anything runs, and the
helper that turns a plan into a bench configuration reproduces the plan's own flags from a real plan."""

from __future__ import annotations

import json
import lzma
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "lab" / "device" / "run.sh"
PLAN_CONFIG = REPO / "lab" / "device" / "plan-config.py"
PLAN_8G = REPO / "docs" / "benchmarks" / "h200-2026-11-29-w1-why" / "plan-8g.json.xz"   # a real plan


def _steps() -> list[str]:
    text = RUN.read_text()
    listed = re.search(r"^STEPS=\(([^)]*)\)", text, re.M | re.S).group(1).split()
    return listed


def test_script_parses_and_every_step_is_documented_and_implemented():
    subprocess.run(["bash", "-n", str(RUN)], check=True)
    text = RUN.read_text()
    help_text = subprocess.run(["bash", str(RUN), "help"], capture_output=True, text=True, check=True).stdout
    for step in _steps():
        assert re.search(rf"^\s+{re.escape(step)}(\[=\w+\])?\s", help_text, re.M), f"{step} not in the help"
        assert re.search(rf"^  {re.escape(step)}\)$", text, re.M), f"{step} has no case branch"
    documented = re.findall(r"^#   ([a-z0-9-]+)(?:\[=\w+\])?\s{2,}", text, re.M)
    assert sorted(documented) == sorted(_steps())


def test_unknown_step_is_refused_before_anything_runs(tmp_path):
    res = subprocess.run(["bash", str(RUN), "up-proof", "w1-fast"], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert res.returncode == 2
    assert res.stderr.strip() == "run.sh: unknown step 'w1-fast' (run.sh help lists them)"
    assert list(tmp_path.iterdir()) == []


def _plan(tmp_path: Path) -> Path:
    p = tmp_path / "plan.json"
    p.write_bytes(lzma.decompress(PLAN_8G.read_bytes()))
    return p


def test_plan_config_keeps_the_plan_flags_and_environment(tmp_path):
    plan = _plan(tmp_path)
    w = json.loads(plan.read_text())["workers"][0]
    out = subprocess.run([sys.executable, str(PLAN_CONFIG), "plan-ub512", str(plan), "--replace=-ub=512",
                          "--add=--no-host"], capture_output=True, text=True, check=True).stdout.strip()
    name, rest = out.split("=", 1)
    words = shlex.split(rest)
    assert name == "plan-ub512"
    assert words[:3] == [f"{k}={v}" for k, v in w["env"].items()]
    flags = words[3:]
    assert "--host" not in flags and "--port" not in flags and "--alias" not in flags
    assert flags[flags.index("-ub") + 1] == "512" and flags[-1] == "--no-host"
    assert flags[flags.index("-ot") + 1] == w["args"][w["args"].index("-ot") + 1]


def test_plan_config_refuses_a_flag_the_plan_does_not_have(tmp_path):
    res = subprocess.run([sys.executable, str(PLAN_CONFIG), "x", str(_plan(tmp_path)), "--replace=--n-cpu-moe=3"],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "the plan has no --n-cpu-moe" in res.stderr


def _prebuilt_run(tmp_path: Path, server: Path) -> tuple[str, Path]:
    """run.sh with CUDA_PREBUILT holding ``server`` (xz-compressed, as cross-build.sh writes it), a step that needs
    no GPU, and its work under tmp_path."""
    pre = tmp_path / "pre"
    pre.mkdir()
    (pre / "llama-server.xz").write_bytes(lzma.compress(server.read_bytes(), format=lzma.FORMAT_XZ))
    (pre / "build.json").write_text('{"built_on": "a test"}\n')
    work = tmp_path / "work"
    res = subprocess.run(["bash", str(RUN), "probe-vs-torch"], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "DEVICE_WORK": str(work),
                              "RUN_SECONDS": "4", "CUDA_PREBUILT": str(pre), "HOME": str(tmp_path)})
    return res.stdout, work


def test_a_prebuilt_server_that_finds_no_gpu_is_not_used(tmp_path, llama_server_path):
    # the CPU build lists no CUDA device: run.sh says so, and the steps would build as before
    out, work = _prebuilt_run(tmp_path, Path(llama_server_path))
    assert "the cross-built llama-server does not run here" in out, out
    assert "server: the cross-built" not in out
    assert (work / "out" / "prebuilt.txt").read_text().strip().endswith("(none)")


def test_a_prebuilt_server_that_lists_the_gpu_is_used(tmp_path):
    # a stand-in for the device's answer to --list-devices (the side effect the check reads)
    fake = tmp_path / "llama-server"
    fake.write_text('#!/bin/sh\n[ "$1" = --list-devices ] && printf "Available devices:\\n  CUDA0: NVIDIA H200\\n"\n')
    out, work = _prebuilt_run(tmp_path, fake)
    assert f"server: the cross-built {work}/prebuilt/bin/llama-server" in out, out
    assert (work / "prebuilt" / "bin" / "llama-server").stat().st_mode & 0o111
    assert json.loads((work / "out" / "prebuilt-build.json").read_text()) == {"built_on": "a test"}
