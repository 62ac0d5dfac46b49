"""Flavor and feature detection from the binary's own --help; finding the binary."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orchestrator.backend.detect import detect_backend, find_llama_server
from orchestrator.backend.info import parse_help
from orchestrator.errors import BackendError

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "backend"


def test_parse_mainline_help():
    flavor, feats, modes, _ = parse_help((FIX / "mainline-llama-server-help.txt").read_text())
    assert flavor == "mainline"
    assert modes == ("none", "layer", "row", "tensor")
    for f in ("fit", "fit_target", "n_cpu_moe", "cpu_moe", "override_tensor", "load_mode", "sm_tensor", "numa"):
        assert f in feats, f
    assert "sm_graph" not in feats and "mla" not in feats


def test_detect_real_llama_server(llama_server_path):
    info = detect_backend(llama_server_path)
    assert info.flavor in ("mainline", "ik_llama.cpp")
    assert info.has("override_tensor")
    assert info.version
    assert info.bench and os.access(info.bench, os.X_OK)


def test_detect_rejects_non_server(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho hello\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(BackendError, match="does not look like llama-server"):
        detect_backend(fake)


def test_detect_not_executable(tmp_path):
    f = tmp_path / "llama-server"
    f.write_text("x")
    with pytest.raises(BackendError, match="not executable"):
        detect_backend(f)


def test_find_order(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "llama-server"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    other = tmp_path / "other-server"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(other))
    monkeypatch.setenv("PATH", str(exe.parent) + os.pathsep + os.environ["PATH"])
    assert find_llama_server(str(exe)) == (str(exe), "backend.binary")
    assert find_llama_server(None) == (str(other), "$LLAMA_SERVER")
    monkeypatch.delenv("LLAMA_SERVER")
    assert find_llama_server("auto") == (str(exe), "PATH")
    with pytest.raises(BackendError, match="not found"):
        find_llama_server(str(tmp_path / "missing"))


def test_parse_ik_llama_cpp_help():
    """Recorded from ik_llama.cpp built by `orchestrator build --flavor ik_llama.cpp` (CPU)."""
    flavor, feats, modes, gpu = parse_help((FIX / "ik-llama-server-help.txt").read_text())
    assert flavor == "ik_llama.cpp"
    for f in ("mla", "merge_qkv", "attn_max_batch", "cuda_params", "no_mmap", "fit", "n_cpu_moe"):
        assert f in feats, f
    assert "load_mode" not in feats and "fit_target" not in feats
    assert modes == () and not gpu  # a CPU build lists no -ngl/-sm


def test_parse_ik_split_modes_block():
    text = ("-sm,   --split-mode SPLIT_MODE    how to split the model across multiple GPUs, one of:\n"
            "                                  - none: use one GPU only\n"
            "                                  - graph: split model tensors and computation graph across GPUs\n"
            "                                  - layer (default): split layers and KV across GPUs\n"
            "-ngl,  --gpu-layers N             number of layers to store in VRAM\n")
    flavor, feats, modes, gpu = parse_help(text)
    assert modes == ("none", "graph", "layer") and "sm_graph" in feats and flavor == "ik_llama.cpp" and gpu


def test_expert_cache_feature_is_read_from_help():
    """Our patched build (and newer upstream) offers --moe-cache-mib: the feature `expert_cache` says so."""
    base = (FIX / "mainline-llama-server-help.txt").read_text()
    assert "expert_cache" not in parse_help(base)[1]
    patched = base + "--moe-cache-mib N                      VRAM for an LRU cache of host-resident experts (MiB)\n"
    assert "expert_cache" in parse_help(patched)[1]


def test_flavor_is_one_string_valued_enum():
    import json

    from orchestrator.backend.info import BackendInfo, Flavor

    flavor, *_ = parse_help((FIX / "ik-llama-server-help.txt").read_text())
    assert flavor is Flavor.IK and flavor == "ik_llama.cpp" and f"{flavor}" == "ik_llama.cpp"
    assert json.dumps({"flavor": flavor}) == '{"flavor": "ik_llama.cpp"}'
    info = BackendInfo(server="s", flavor="ik_llama.cpp")
    assert info.flavor is Flavor.IK and info.ik and info.to_dict()["flavor"] == "ik_llama.cpp"
    with pytest.raises(ValueError):
        BackendInfo(server="s", flavor="ik")


def test_backend_info_is_pure():
    """The planner reads BackendInfo: importing it must not load subprocess (probing is detect's side effect)."""
    import subprocess as sp
    import sys

    code = ("import sys; import orchestrator.backend.info; "
            "print(','.join(m for m in ('subprocess', 'tarfile', 'fcntl', 'ctypes') if m in sys.modules))")
    out = sp.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
