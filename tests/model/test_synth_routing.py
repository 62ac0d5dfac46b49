"""The routing rule and the expert_usage build plumbing (pure parts; the measurement itself is in
tests/integration/test_routing.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.errors import BackendError, ModelError
from orchestrator.model import routing


def _report(distinct_long, distinct_short, n_expert=128, used=8):
    def layers(ds, n_tok):
        out = []
        for i, d in enumerate(ds):
            counts = [0] * n_expert
            for e in range(d):
                counts[e] = 1
            counts[0] += n_tok * used - d
            out.append({"layer": i, "distinct": d, "max_share": counts[0] / (n_tok * used), "counts": counts})
        return out
    return json.dumps({"model": "m.gguf", "arch": "qwen3moe", "n_expert": n_expert, "n_expert_used": used,
                       "n_layer": len(distinct_long), "seed": 1,
                       "runs": [{"n_tokens": 512, "layers": layers(distinct_long, 512)},
                                {"n_tokens": 8, "layers": layers(distinct_short, 8)}]})


def test_parse_report():
    rep = routing.parse_report(_report([128, 120], [40, 9]))
    assert (rep.n_expert, rep.n_expert_used, rep.arch) == (128, 8, "qwen3moe")
    assert rep.run(512).layers[1].distinct == 120
    assert sum(rep.run(8).layers[0].counts) == 64
    assert rep.run(8).min_distinct() == 9
    with pytest.raises(KeyError):
        rep.run(7)


def test_check_passes_a_spread_routing():
    assert routing.check(routing.parse_report(_report([128, 116, 125], [41, 30, 9]))) == []


def test_check_flags_each_collapsed_layer():
    rep = routing.parse_report(_report([128, 115, 10], [41, 8, 8]))
    problems = routing.check(rep)
    assert len(problems) == 4
    assert problems[0].startswith("layer 1: 115/128")   # 115 < 0.9 * 128 = 115.2
    assert "layer 2: 10/128" in problems[1]
    assert "only 8 distinct experts over 8 tokens" in problems[2]


def test_format_report_has_a_row_per_layer():
    text = routing.format_report(routing.parse_report(_report([128, 120], [40, 9])))
    assert len(text.splitlines()) == 2 + 2


def _fake_build(cache: Path, key: str, libs: list[str]) -> Path:
    prefix = cache / "llama.cpp" / key
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib").mkdir()
    (prefix / "include").mkdir()
    (prefix / "bin" / "llama-server").write_text("#!/bin/sh\n")
    (prefix / "bin" / "llama-server").chmod(0o755)
    (prefix / "include" / "llama.h").write_text("")
    for n in libs:
        (prefix / "lib" / n).write_bytes(b"!<arch>\n")
    (prefix / "build.json").write_text(json.dumps({"dev": {"libs": libs, "lib": "lib", "include": "include"}}))
    return prefix


def test_dev_tree_from_the_build_cache_orders_libs_for_static_linking(tmp_path):
    prefix = _fake_build(tmp_path, "mainline-cpu-abc",
                         ["libllama-common.a", "libggml-base.a", "libggml-cpu.a", "libggml.a", "libllama.a",
                          "libllama-server-impl.a"])
    tree = routing.dev_tree_from_cache(tmp_path)
    assert tree is not None and str(prefix) in tree.origin
    assert [p.name for p in tree.libs] == ["libllama.a", "libggml.a", "libggml-cpu.a", "libggml-base.a"]
    assert not tree.cuda
    argv = routing.compile_argv(tree, tmp_path / "out", "c++")
    assert argv[0] == "c++" and str(routing.SOURCE) in argv
    assert f"-I{prefix / 'include'}" in argv
    i, j = argv.index("-Wl,--start-group"), argv.index("-Wl,--end-group")
    assert [Path(a).name for a in argv[i + 1:j]] == [p.name for p in tree.libs]
    assert "-lcudart" not in argv


def test_cuda_build_links_the_cuda_runtime(tmp_path):
    _fake_build(tmp_path, "mainline-cuda-abc",
                ["libggml-base.a", "libggml-cpu.a", "libggml-cuda.a", "libggml.a", "libllama.a"])
    tree = routing.dev_tree_from_cache(tmp_path)
    assert tree.cuda
    argv = routing.compile_argv(tree, tmp_path / "out", "c++")
    assert {"-lcudart", "-lcublas", "-lcuda"} <= set(argv)


def test_a_build_without_libraries_is_not_a_dev_tree(tmp_path):
    prefix = _fake_build(tmp_path, "old", [])
    (prefix / "build.json").write_text("{}")
    assert routing.dev_tree_from_cache(tmp_path) is None


def test_no_dev_tree_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path))
    monkeypatch.delenv("ORCHESTRATOR_LLAMA_BUILD_DIR", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_LLAMA_INCLUDE", raising=False)
    with pytest.raises(BackendError, match="orchestrator build"):
        routing.find_dev_tree()


def test_build_tree_without_libllama(tmp_path):
    with pytest.raises(BackendError, match="libllama.a"):
        routing.dev_tree_from_dirs(tmp_path, [tmp_path])


def test_a_failing_link_reports_the_linker_and_leaves_no_binary(tmp_path):
    """A real compiler against empty archives: the link fails, the error carries its last lines."""
    import shutil as _sh

    if not (_sh.which("c++") or _sh.which("g++")):
        pytest.fail("a C++ compiler is required (scripts/setup.sh installs g++)")
    prefix = _fake_build(tmp_path, "broken", ["libggml-base.a", "libggml.a", "libllama.a"])
    (prefix / "include" / "llama.h").write_text("#error this is not llama.h\n")
    tree = routing.dev_tree_from_cache(tmp_path)
    with pytest.raises(BackendError) as e:
        routing.build_tool(tree, cache=tmp_path)
    assert "failed" in str(e.value) and "llama.h" in str(e.value)
    left = [p.name for p in (tmp_path / "native").iterdir() if not p.name.startswith(".")]
    assert left == []


# --------------------------------------------------------------------------------------------------------------
# routing profiles cached by file identity (the measurement itself: tests/integration/test_routing.py)


def _cached_profile(cache, model):
    from orchestrator.model import routing_profile as R

    ids = [[[0, 1], [2, 3]], [[1, 0], [3, 2]], [[2, 3], [0, 1]]]
    import numpy as np

    prof = R.profile(R.Trace(4, 2, (0, 1), np.asarray(ids, np.int32)), "recorded")
    path = routing.profile_path(model, cache)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"model": str(model), "settings": {"tokens": 3}, "profile": prof.to_json()}))
    return prof, path


def test_profile_cache_is_keyed_by_file_identity(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\1" * 100)
    assert routing.load_profile(model, tmp_path) is None
    prof, _ = _cached_profile(tmp_path, model)
    got, settings = routing.load_profile(model, tmp_path)
    assert settings == {"tokens": 3} and got.curve("lru-global").hits == prof.curve("lru-global").hits
    assert routing.profile_curve(model, cache=tmp_path).source == "recorded"
    model.write_bytes(b"GGUF" + b"\2" * 100)                                   # same size, other content
    assert routing.load_profile(model, tmp_path) is None


def test_without_a_profile_the_default_follows_the_model_shape(tmp_path, write_model, tiny_specs):
    from orchestrator.model import synth
    from orchestrator.model.routing_profile import DEFAULT_CURVE, default_curve

    # 128 experts, top 8: the measured shape
    qwen = synth.write_model(tmp_path / "q.gguf", "qwen3-30b-a3b", scale=0.05, layers=2, fsync=False).path
    assert routing.profile_curve(qwen, cache=tmp_path) is DEFAULT_CURVE
    # 8 experts, top 2: another shape, the cautious default for it
    (tiny,) = write_model(tiny_specs["qwen3moe"])
    c = routing.profile_curve(tiny, cache=tmp_path)
    assert c == default_curve(8, 2) and c.source.startswith("default for 8 experts, top 2")
    with pytest.raises(ModelError, match="x.gguf"):
        routing.profile_curve(tmp_path / "x.gguf", cache=tmp_path)


def test_generated_models_trace_random_ids_and_others_text(tmp_path, write_model, tiny_specs):
    """synth-model's general.organization marks a generated model: its locality is in its weights, so random ids
    show it; any other model traces the built-in corpus, then its own continuation at llama-server's 0.8."""
    from orchestrator.model import synth

    gen = synth.write_model(tmp_path / "g.gguf", "qwen3-30b-a3b", scale=0.05, layers=2, fsync=False).path
    (other,) = write_model(tiny_specs["qwen3moe"])
    assert routing.is_generated(gen) and not routing.is_generated(other)
    assert routing.trace_input(gen) == {"input": "random", "prompts": None, "sample": None}
    text = routing.trace_input(other)
    assert text["input"] == "text" and text["sample"] == 0.8
    assert text["prompts"]["path"] == str(routing.CORPUS) and "built-in corpus" in text["prompts"]["name"]
    assert routing.describe_input(text).startswith("the text of the built-in corpus (chat turns, prose, code")
    assert routing.describe_input(text).endswith(
        ", then past its end the model's own tokens sampled at temperature 0.8")
    assert routing.describe_input(routing.trace_input(gen)) == "random token ids"
    # asked for, either way round
    assert routing.trace_input(gen, "text")["input"] == "text"
    assert routing.trace_input(other, "random", sample=1.0) == {"input": "random", "prompts": None, "sample": 1.0}
    own = tmp_path / "mine.txt"
    own.write_text("Bonjour tout le monde.")
    mine = routing.trace_input(gen, prompts=own, sample=1.5)
    assert mine["prompts"]["name"] == "mine.txt" and mine["sample"] == 1.5 and mine["input"] == "text"
    # another text is another profile: the hash says which
    own.write_text("Hallo Welt.")
    assert routing.trace_input(gen, prompts=own)["prompts"]["sha256"] != mine["prompts"]["sha256"]
    with pytest.raises(ModelError, match="either a text or random"):
        routing.trace_input(gen, "random", prompts=own)
    with pytest.raises(ModelError, match="missing.txt: prompts file not found"):
        routing.trace_input(gen, prompts=tmp_path / "missing.txt")
    with pytest.raises(ModelError, match="trace input 'words'"):
        routing.trace_input(gen, "words")


def test_the_built_in_corpus_holds_what_it_says():
    text = routing.CORPUS.read_text(encoding="utf-8")
    assert 1000 < len(text.encode()) < 4000          # about 500 tokens: the continuation gets the rest of 1024
    assert "User:" in text and "Assistant:" in text  # chat turns
    assert "def " in text and "return" in text        # code
    assert any(w in text for w in ("und", "wir", "dass")) and "ü" in text   # German


def test_a_damaged_profile_says_what_to_do(tmp_path):
    from orchestrator.errors import ModelError

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    _, path = _cached_profile(tmp_path, model)
    path.write_text("{not json")
    with pytest.raises(ModelError, match="--routing"):
        routing.load_profile(model, tmp_path)
    with pytest.raises(ModelError, match="not found"):
        routing.measure_profile(tmp_path / "missing.gguf", cache=tmp_path)


def test_libraries_the_linker_asks_for_are_added_and_the_link_retried(tmp_path, monkeypatch):
    """A CUDA build may link NCCL, and ggml's RPC backend may link ibverbs (its RDMA transport): only the
    linker knows, so build_tool adds each library an undefined reference names and links again."""
    _fake_build(tmp_path, "mainline-cuda-abc",
                ["libggml-base.a", "libggml-cpu.a", "libggml-cuda.a", "libggml.a", "libllama.a"])
    tree = routing.dev_tree_from_cache(tmp_path)
    calls = tmp_path / "calls"
    cxx = tmp_path / "fake-cxx"
    # the compiler seam: a link that fails until both libraries are named, then writes the -o file
    cxx.write_text(f"""#!/bin/sh
echo "$@" >> {calls}
case " $* " in *" -lnccl "*) ;; *) echo "x.o: undefined reference to \\`ncclCommInitRank'" >&2; exit 1;; esac
case " $* " in *" -libverbs "*) ;; *) echo "transport.cpp: undefined reference to \\`ibv_close_device'" >&2; exit 1;; esac
while [ $# -gt 0 ]; do [ "$1" = -o ] && {{ printf '#!/bin/sh\\n' > "$2"; chmod +x "$2"; }}; shift; done
""")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    exe = routing.build_tool(tree, cache=tmp_path / "c")
    assert os.access(exe, os.X_OK)
    links = calls.read_text().splitlines()
    assert len(links) == 3
    assert "-lnccl" not in links[0] and "-libverbs" in links[2] and "-lnccl" in links[2]


def test_a_link_that_fails_for_another_reason_is_one_clear_error(tmp_path, monkeypatch):
    _fake_build(tmp_path, "mainline-cpu-abc", ["libggml-base.a", "libggml.a", "libllama.a"])
    tree = routing.dev_tree_from_cache(tmp_path)
    cxx = tmp_path / "fake-cxx"
    cxx.write_text("#!/bin/sh\necho \"x.o: undefined reference to \\`somewhere_else'\" >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.raises(BackendError, match="(?s)building expert_usage .* failed .*somewhere_else"):
        routing.build_tool(tree, cache=tmp_path / "c")
    assert not list((tmp_path / "c" / "native").glob("expert_usage-*"))
