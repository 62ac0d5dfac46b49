"""The expert cache our llama.cpp patch series adds (``--moe-cache-mib``), on the CPU side.

The slots live on a GPU: the scheduler path runs end to end on an RPC device in test_expert_cache_rpc.py, and on a
real GPU in test_expert_cache_gpu.py (the device; speed in docs/benchmarks.md). Here: the series applies to the
pinned source and is part of the build key, the built llama-server offers the flags, a CPU-only server asked for
a cache says it needs a GPU and serves without it, and the slot table's assignment and eviction order (C++, linked
against the cached libraries).
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import urllib.request
from pathlib import Path

import pytest

from orchestrator.backend import build as b
from orchestrator.backend import patches, sources
from orchestrator.backend.detect import detect_backend
from orchestrator.model.routing import dev_tree_from_cache

HERE = Path(__file__).resolve().parent


def test_the_series_exists_and_is_for_mainline_only():
    series = patches.series("mainline")
    assert series, f"no patches under {patches.patch_dir()}"
    assert all(p.suffix == ".patch" for p in series)
    assert patches.series("ik_llama.cpp") == []


def test_the_series_applies_to_the_pinned_source_and_marks_it(tmp_path):
    archive = sources.fetch(sources.SOURCES["mainline"], b.cache_dir(), progress=lambda s: None)
    root = sources.extract(archive, tmp_path, sources.SOURCES["mainline"].subdir)
    said = []
    lines = patches.apply(root, patches.series("mainline"), said.append, strict=True)
    assert lines == patches.describe(patches.series("mainline"))
    assert patches.applied(root) == lines
    assert "--moe-cache-mib" in (root / "common" / "arg.cpp").read_text()
    assert (root / "ggml" / "include" / "ggml-moe-cache.h").is_file()
    # applied twice, the pinned source is an error (strict), and nothing is half-applied
    before = (root / "ggml" / "src" / "ggml-backend.cpp").read_text()
    with pytest.raises(Exception, match="does not apply"):
        patches.apply(root, patches.series("mainline"), said.append, strict=True)
    assert (root / "ggml" / "src" / "ggml-backend.cpp").read_text() == before


def test_a_series_applies_in_order_or_not_at_all(tmp_path):
    """Each patch applies on top of the ones before it; when a later one does not apply, the earlier ones are taken
    back: the tree is the pinned source again, byte for byte."""
    archive = sources.fetch(sources.SOURCES["mainline"], b.cache_dir(), progress=lambda s: None)
    root = sources.extract(archive, tmp_path / "src", sources.SOURCES["mainline"].subdir)
    series = patches.series("mainline")
    assert len(series) >= 2           # the later patches change lines the first one adds
    touched = ["common/arg.cpp", "ggml/src/ggml-backend.cpp", "include/llama.h"]
    pristine = {f: (root / f).read_bytes() for f in touched}
    alt = tmp_path / "series"
    alt.mkdir()
    for p in series:
        (alt / p.name).write_bytes(p.read_bytes())
    (alt / "9999-broken.patch").write_text("diff --git a/common/arg.cpp b/common/arg.cpp\n--- a/common/arg.cpp\n"
                                         "+++ b/common/arg.cpp\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    said = []
    assert patches.apply(root, patches.series("mainline", alt), said.append, strict=False) == []
    assert any("9999-broken.patch" in s for s in said)
    assert {f: (root / f).read_bytes() for f in touched} == pristine
    assert not (root / "ggml" / "include" / "ggml-moe-cache.h").exists() and patches.applied(root) is None


def test_another_source_is_built_without_the_series_and_says_so(tmp_path):
    from tests.backend.test_build import fake_tree

    tree = fake_tree(tmp_path / "tree")
    said = []
    assert patches.apply(tree, patches.series("mainline"), said.append, strict=False) == []
    assert any("do not apply to this source" in s for s in said)
    assert patches.applied(tree) is None


def test_the_patches_are_part_of_the_build_key(tmp_path, monkeypatch):
    k_pinned, spec = b.build_key(b.BuildOptions(), None, cuda=False, archs=())
    assert spec["patches"] == patches.describe(patches.series("mainline"))
    alt = tmp_path / "alt"
    alt.mkdir()
    for p in patches.series("mainline"):
        (alt / p.name).write_text(p.read_text() + "\n")   # one byte more: another series
    monkeypatch.setattr(patches, "patch_dir", lambda: alt)
    k_other, _ = b.build_key(b.BuildOptions(), None, cuda=False, archs=())
    assert k_other != k_pinned
    # a user's tree is built as it is: no patches in its key
    tree = tmp_path / "tree"
    tree.mkdir()
    _k, spec_dir = b.build_key(b.BuildOptions(), tree, cuda=False, archs=())
    assert "patches" not in spec_dir


def test_an_exported_archive_carries_the_applied_series(tmp_path):
    out = tmp_path / "llama-src.tar.xz"
    res = subprocess.run(["orchestrator", "build", "--export-source", str(out)], capture_output=True, text=True,
                         timeout=600, env=_cli_env())
    assert res.returncode == 0, res.stderr
    with tarfile.open(out) as tf:
        names = tf.getnames()
        marker = next(n for n in names if n.endswith("/" + patches.MARKER))
        text = tf.extractfile(marker).read().decode()
        arg = tf.extractfile(next(n for n in names if n.endswith("/common/arg.cpp"))).read().decode()
    assert text.splitlines() == patches.describe(patches.series("mainline"))
    assert "--moe-cache-mib" in arg


def _cli_env() -> dict:
    import os
    import sys

    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


@pytest.mark.integration
def test_the_built_server_offers_the_cache(llama_server_path):
    info = detect_backend(llama_server_path)
    assert info.has("expert_cache"), "the suite's llama-server was built without orchestrator's patch series"
    help_text = subprocess.run([llama_server_path, "--help"], capture_output=True, text=True, timeout=30).stdout
    assert re.search(r"--moe-cache-mib N", help_text) and re.search(r"--moe-cache-max-batch N", help_text)
    # every option of the series that the plan asks for, as the plan detects it
    for feature in ("expert_cache_slot_reads", "expert_cache_cpu_misses", "expert_cache_slots", "expert_cache_staging",
                    "expert_cache_stage_min_batch"):
        assert info.has(feature), feature
    # uploads ahead of need are the lab's (lab/llama.cpp-patches): the plan never chooses them
    assert not info.has("expert_cache_prefetch")


@pytest.mark.integration
def test_a_cpu_only_server_asked_for_a_cache_says_so_and_serves(tmp_path, llama_server_path):
    from orchestrator.model import synth
    from tests.integration.test_synth_llama_server import Server, _post

    model = synth.write_model(tmp_path / "m.gguf", "qwen3-30b-a3b", scale=0.125, quant="q4_0", seed=5).path
    srv = Server(llama_server_path, model, tmp_path / "server.log",
                 extra=("--metrics", "--moe-cache-mib", "64", "--moe-cache-max-batch", "4"))
    try:
        srv.wait_healthy()
        out = _post(srv.url + "/completion", {"prompt": "one two three", "n_predict": 4, "temperature": 0})
        assert out["tokens_predicted"] == 4
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    finally:
        srv.stop()
    text = srv.log.read_text()
    assert "expert cache off: it needs a GPU" in text, text[-2000:]
    values = dict(re.findall(r"^llamacpp:(moe_cache_\w+) (\S+)$", metrics, re.M))
    assert float(values["moe_cache_active"]) == 0
    assert float(values["moe_cache_lookups_total"]) == 0


def test_slot_assignment_and_eviction_order(tmp_path):
    tree = dev_tree_from_cache()
    assert tree is not None, "no cached llama.cpp build with its libraries (run `orchestrator build`)"
    base = [p for p in tree.libs if p.name == "libggml-base.a"]
    assert base, f"libggml-base.a missing from {tree.origin}"
    header = [d for d in tree.include_dirs if (d / "ggml-moe-cache.h").is_file()]
    assert header, f"ggml-moe-cache.h missing from {tree.origin}: built without the patch series"
    exe = tmp_path / "moe_slot_table_test"
    argv = ["c++", "-O1", "-std=c++17", str(HERE / "moe_slot_table_test.cpp"), f"-I{header[0]}", str(base[0]),
            "-lpthread", "-lm", "-o", str(exe)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 failed"), run.stdout
