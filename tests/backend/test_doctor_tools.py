"""`doctor` and `build --help` name every tool the build makes, ggml-rpc-server included (the CPU tests of the
expert cache run through it), and doctor says when one is missing next to llama-server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _orch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


def test_build_help_names_the_rpc_server():
    out = _orch("build", "--help").stdout
    assert "ggml-rpc-server" in " ".join(out.split()).replace("- ", "-")


def _checks(binary: str) -> dict:
    res = _orch("doctor", "--json", "--binary", binary)
    return {c["name"]: c for c in json.loads(res.stdout)["checks"]}


def test_doctor_finds_the_rpc_server_beside_llama_server(llama_server_path):
    rpc = _checks(llama_server_path)["ggml-rpc-server"]
    assert rpc["status"] == "ok" and rpc["detail"] == str(Path(llama_server_path).resolve().parent / "ggml-rpc-server")


def test_doctor_says_when_the_rpc_server_is_missing(llama_server_path, tmp_path):
    lone = tmp_path / "llama-server"
    shutil.copy2(llama_server_path, lone)
    checks = _checks(str(lone))
    assert checks["ggml-rpc-server"]["status"] == "warn"
    assert checks["ggml-rpc-server"]["detail"] == "not next to llama-server"
    assert checks["ggml-rpc-server"]["fix"] == "orchestrator build (builds all 4)"
