"""`orchestrator up` on a topology whose model is a URL: the model is downloaded into the cache before any worker
starts, and the real llama-server serves it from there (through Ray and the gateway). Real parts throughout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .remote_servers import Blob, FileServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import cluster_support as S  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_downloads_a_url_model_and_serves_it(tmp_path, llama_server_path):
    model = S.write_tiny_llama(tmp_path / "tiny-llama.gguf")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMA_SERVER": llama_server_path,
           "ORCHESTRATOR_CACHE": str(cache), "ORCHESTRATOR_STATE": str(tmp_path / "state")}
    ns = "remote-up"
    port = S.free_port()
    with FileServer({"/models/tiny-llama.gguf": Blob(model)}) as srv:
        topo = tmp_path / "t.yaml"
        topo.write_text(f"model:\n  path: {srv.url('/models/tiny-llama.gguf')}\n  context: 512\n  alias: tiny\n"
                        f"gateway:\n  port: {port}\nray:\n  address: local\n  dashboard_port: {S.free_port()}\n"
                        f"  namespace: {ns}\nworkers:\n  port_base: {S.free_port_base(4)}\n")
        try:
            r = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(topo), "--detach"], env=env,
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            local = next(cache.glob("models/url/*/*/tiny-llama.gguf"))
            assert local.read_bytes() == model.read_bytes()
            assert f"-m {local}" in r.stderr              # the worker's argv as up printed it
            code, body = S.post_json(f"http://127.0.0.1:{port}/v1/completions",
                                     {"model": "tiny", "prompt": "hello", "max_tokens": 4})
            assert code == 200 and body["choices"], body
            running = [" ".join(p.cmdline()) for p in S.llama_servers(llama_server_path)]
            assert any(f"-m {local}" in c for c in running), running
        finally:
            subprocess.run([sys.executable, "-m", "orchestrator", "down", "--namespace", ns], env=env,
                           capture_output=True, text=True, timeout=120)
