"""`orchestrator plan` on the example topologies (which name real Hub repositories) against a stand-in of the Hub
with full-size models of the same shapes, and `orchestrator pull`, run as a user would (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab.calibmodels import PRESETS, build
from orchestrator.model.writer import write_gguf, write_gguf_split

from .remote_servers import Blob, FileServer, HubServer

REPO = Path(__file__).resolve().parents[2]

# example topology -> (the shape its model has, parts)
EXAMPLES = {
    "1socket-1gpu-24g": ("qwen3-30b-a3b", 1),
    "2socket-2gpu": ("qwen3-235b-a22b", 3),
    "2socket-8gpu": ("deepseek-v3", 9),
}


def model_ref(topology: str) -> str:
    return yaml.safe_load((REPO / "topologies" / f"{topology}.yaml").read_text())["model"]["path"]


@pytest.fixture(scope="module")
def full_size(tmp_path_factory) -> dict[str, list[Path]]:
    """Full-size sparse models (headers on disk, data as holes), split like the Hub's files of each example."""
    d = tmp_path_factory.mktemp("full-size")
    out = {}
    for topology, (like, parts) in EXAMPLES.items():
        repo, quant = model_ref(topology).split(":")
        md, ts = build(PRESETS[like])
        stem = d / topology / f"{repo.split('/')[1].removesuffix('-GGUF')}-{quant}"
        stem.parent.mkdir()
        if parts == 1:
            write_gguf(f"{stem}.gguf", md, ts)
            out[topology] = [Path(f"{stem}.gguf")]
        else:
            out[topology] = [Path(p) for p in write_gguf_split(stem, md, ts, parts)]
    return out


@pytest.fixture(scope="module")
def hub(full_size):
    with FileServer() as cdn, HubServer(cdn) as h:
        for topology, paths in full_size.items():
            repo, quant = model_ref(topology).split(":")
            sub = f"{quant}/" if len(paths) > 1 else ""
            h.add_repo(repo, {f"{sub}{p.name}": Blob(p) for p in paths} | {"README.md": Blob(head=b"# x\n")})
        yield h


def orch(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=env)


@pytest.fixture()
def env(hub, tmp_path) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    return {**e, "PYTHONPATH": str(REPO), "HF_ENDPOINT": hub.base, "HF_HOME": str(tmp_path / "hf-home"),
            "ORCHESTRATOR_CACHE": str(tmp_path / "cache")}


@pytest.mark.parametrize("topology", sorted(EXAMPLES))
def test_example_topology_plans_from_its_hub_reference(topology, full_size, hub, env, tmp_path):
    sent = hub.cdn.stats.sent
    # the alias (the name clients send) defaults to the last part of model.path: REPO:QUANT here, the file's
    # name for a local file; the same for both plans
    r = orch("plan", f"topologies/{topology}.yaml", "--json", "--set", "model.alias=m", env=env)
    assert r.returncode == 0, r.stderr
    headers_read = hub.cdn.stats.sent - sent
    by_ref = json.loads(r.stdout)
    paths = full_size[topology]
    total = sum(p.stat().st_size for p in paths)
    assert headers_read < total / 1000       # megabytes of headers for 17..380 GiB of model
    r = orch("plan", f"topologies/{topology}.yaml", "--json", "--set", f"model.path={paths[0]}",
             "--set", "model.alias=m", env=env)
    assert r.returncode == 0, r.stderr
    local = json.loads(r.stdout)
    repo, quant = model_ref(topology).split(":")
    cached = Path(env["ORCHESTRATOR_CACHE"]) / "models" / "huggingface" / repo
    cached = cached / (f"{quant}/" if len(paths) > 1 else "") / paths[0].name
    w = by_ref["workers"][0]
    assert w["argv"][w["argv"].index("-m") + 1] == str(cached)
    assert json.dumps(by_ref["workers"]).replace(str(cached), str(paths[0])) == json.dumps(local["workers"])
    assert any(f"model: {repo}:{quant} read over the network" in n for n in by_ref["notes"])


def test_pull_a_topology_then_plan_and_pull_again(hub, env, tmp_path, tiny_models):
    hub.add_repo("someorg/Small-GGUF", {"Small-Q8_0.gguf": Blob(tiny_models["qwen3moe"])})
    topo = tmp_path / "t.yaml"
    topo.write_text("model: someorg/Small-GGUF:Q8_0\n")
    r = orch("pull", str(topo), "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path == Path(env["ORCHESTRATOR_CACHE"]) / "models/huggingface/someorg/Small-GGUF/Small-Q8_0.gguf"
    assert path.read_bytes() == tiny_models["qwen3moe"].read_bytes()
    assert "GiB to download into" in r.stderr
    sent = hub.cdn.stats.sent
    r = orch("pull", "someorg/Small-GGUF:Q8_0", env=env)
    assert r.returncode == 0 and r.stdout.strip() == str(path) and hub.cdn.stats.sent == sent
    assert "to download" not in r.stderr


def test_pull_of_a_local_file_and_errors(env, tmp_path, tiny_models, llama_server_path):
    r = orch("pull", str(tiny_models["llama"]), env=env)
    assert r.returncode == 0 and "is a local file: nothing to download" in r.stderr
    r = orch("pull", str(tmp_path / "none.gguf"), env=env)
    assert r.returncode == 2
    assert r.stderr == f"orchestrator pull: error: {tmp_path / 'none.gguf'}: no such file (and not a URL or " \
                       "Hugging Face reference)\n"
    with FileServer({"/m.gguf": Blob(tiny_models["llama"])}, ranges=False) as s:
        topo = tmp_path / "t.yaml"
        topo.write_text(f"model: {s.url('/m.gguf')}\n")
        r = orch("plan", str(topo), env=env)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert f"{s.url('/m.gguf')}: the server ignores HTTP range requests" in r.stderr
        assert f"`orchestrator pull {s.url('/m.gguf')}` downloads it once" in r.stderr
        # pull needs no ranges: it takes the whole body
        r = orch("pull", s.url("/m.gguf"), env=env)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).read_bytes() == tiny_models["llama"].read_bytes()
        # ... and then the same URL plans from the finished copy, asking the server for nothing but its HEAD
        sent = s.stats.sent
        for cmd in (("plan", str(topo)), ("model", s.url("/m.gguf"))):
            r = orch(*cmd, env={**env, "LLAMA_SERVER": llama_server_path})
            assert r.returncode == 0, r.stderr
        assert s.stats.sent == sent
