"""The llama.cpp build path, exercised with real cmake on a tiny stand-in tree (seconds, not minutes).

The real llama.cpp build itself runs in scripts/setup.sh before the suite (and its binary is used by every
integration test); these tests check caching, keys, failure cleanup and source archives.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from orchestrator.backend import build as b
from orchestrator.backend import sources
from orchestrator.errors import BackendError

CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake_llama C)
add_library(llama STATIC src/lib.c)
foreach(t llama-server llama-bench llama-fit-params ggml-rpc-server)
  add_executable(${t} tools/tool.c)
  target_link_libraries(${t} llama)
endforeach()
"""


def fake_tree(root: Path, *, broken: bool = False) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "ggml" / "include").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "CMakeLists.txt").write_text(CMAKE)
    (root / "src" / "llama.cpp").write_text("// marker file of a llama.cpp tree\n")
    (root / "src" / "lib.c").write_text("int fake_lib(void) { return 1; }\n")
    (root / "include" / "llama.h").write_text("int fake_lib(void);\n")
    (root / "ggml" / "include" / "ggml.h").write_text("/* ggml */\n")
    body = "int main(void) { return 0; }\n" if not broken else "int main(void) { return undefined_symbol_here + ; }\n"
    (root / "tools").mkdir()
    (root / "tools" / "tool.c").write_text(body)
    (root / "models").mkdir()
    (root / "models" / "big.bin").write_bytes(b"x" * 1000)
    return root


def test_build_then_cache_hit(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    cache = tmp_path / "cache"
    opts = b.BuildOptions(cuda=False)
    first = b.build(opts, source=tree, cache=cache, say=lambda s: None)
    assert not first.cached
    for t in b.TARGETS:
        assert os.access(first.prefix / "bin" / t, os.X_OK)
    assert (first.prefix / "lib" / "libllama.a").is_file()
    assert (first.prefix / "include" / "llama.h").is_file()
    mtime = (first.prefix / "bin" / "llama-server").stat().st_mtime_ns
    second = b.build(opts, source=tree, cache=cache, say=lambda s: None)
    assert second.cached and second.prefix == first.prefix
    assert (second.prefix / "bin" / "llama-server").stat().st_mtime_ns == mtime  # not rebuilt
    # no leftovers of the build itself
    assert not list((cache / "llama.cpp").glob("*.partial"))
    assert not (first.prefix / "build").exists() and not (first.prefix / "src").exists()


def test_options_change_the_key(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    k1, _ = b.build_key(b.BuildOptions(), tree, cuda=False, archs=())
    k2, _ = b.build_key(b.BuildOptions(native=True), tree, cuda=False, archs=())
    k3, _ = b.build_key(b.BuildOptions(), tree, cuda=True, archs=("90",))
    k4, _ = b.build_key(b.BuildOptions(), tree, cuda=True, archs=("80",))
    assert len({k1, k2, k3, k4}) == 4
    assert k3.startswith("mainline-cuda-") and k1.startswith("mainline-cpu-")


def test_failed_build_reports_compiler_lines_and_leaves_cache_clean(tmp_path):
    tree = fake_tree(tmp_path / "tree", broken=True)
    cache = tmp_path / "cache"
    with pytest.raises(BackendError) as ei:
        b.build(b.BuildOptions(cuda=False), source=tree, cache=cache, say=lambda s: None)
    msg = str(ei.value)
    assert "build failed" in msg
    assert "undefined_symbol_here" in msg or "error" in msg
    root = cache / "llama.cpp"
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []  # nothing but the lock file
    assert b.cached_builds(cache) == []


def test_export_source_is_small_and_buildable(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    (tree / ".git").write_text("gitdir: elsewhere\n")
    out = tmp_path / "llama-src.tar.xz"
    # ik_llama.cpp's layout: the Kompute submodule in ggml/src, the server's web UI sources under examples/
    for d in ("ggml/src/kompute", "ggml/src/ggml-cuda", "examples/server/themes", "examples/server/public"):
        (tree / d).mkdir(parents=True)
        (tree / d / "f.txt").write_text("x")
    sources.export_source(tree, out)
    with tarfile.open(out) as tf:
        names = tf.getnames()
    assert any(n.endswith("src/llama.cpp") for n in names)
    assert not any("/kompute/" in n or "/themes/" in n for n in names)
    assert any(n.endswith("ggml/src/ggml-cuda/f.txt") for n in names)
    assert any(n.endswith("examples/server/public/f.txt") for n in names)     # the assets the server embeds
    assert not any("models/" in n for n in names)  # models, docs, tests are left out
    assert not any(n.endswith("/.git") for n in names)
    res = b.build(b.BuildOptions(cuda=False), source=out, cache=tmp_path / "cache", say=lambda s: None)
    assert os.access(res.server, os.X_OK)


def test_not_a_source_tree(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BackendError, match="no llama.cpp source tree"):
        b.build(b.BuildOptions(cuda=False), source=tmp_path / "empty", cache=tmp_path / "cache", say=lambda s: None)


def test_missing_source_archive(tmp_path):
    with pytest.raises(BackendError, match="not found"):
        b.build(b.BuildOptions(cuda=False), source=tmp_path / "nope.tar.xz", cache=tmp_path / "c", say=lambda s: None)


IK_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake_ik C)
execute_process(COMMAND ${CMAKE_COMMAND} -P ${CMAKE_SOURCE_DIR}/common/cmake/build-info-gen-cpp.cmake
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "build-info-gen-cpp.cmake failed: ${rc}")
endif()
file(READ ${CMAKE_SOURCE_DIR}/common/build-info.cpp info)
if(NOT info MATCHES "build_number = 7")
  message(FATAL_ERROR "build-info.cpp not written from build-info.cpp.in")
endif()
add_library(llama STATIC src/lib.c)
foreach(t llama-server llama-bench llama-sweep-bench)
  add_executable(${t} tools/tool.c)
  target_link_libraries(${t} llama)
endforeach()
"""


def test_ik_archive_gets_the_build_info_script_its_sdist_lacks(tmp_path):
    """ik_llama.cpp's common/CMakeLists runs common/cmake/build-info-gen-cpp.cmake, which its sdist (and so an
    exported archive of it) lacks: the build writes it into its own extracted copy, and real cmake runs it."""
    tree = fake_tree(tmp_path / "tree")
    (tree / "CMakeLists.txt").write_text(IK_CMAKE)
    (tree / "cmake").mkdir()
    (tree / "cmake" / "build-info.cmake").write_text('set(BUILD_NUMBER 7)\nset(BUILD_COMMIT "abc")\n')
    (tree / "common").mkdir()
    (tree / "common" / "build-info.cpp.in").write_text("int build_number = @BUILD_NUMBER@;\n")
    out = tmp_path / "ik-src.tar.xz"
    sources.export_source(tree, out)
    res = b.build(b.BuildOptions(cuda=False, flavor="ik_llama.cpp"), source=out, cache=tmp_path / "cache",
                  say=lambda s: None)
    assert os.access(res.server, os.X_OK)
    assert not (tree / "common" / "cmake").exists()            # the exported tree itself is not touched
    with pytest.raises(BackendError, match="Error processing file: .*build-info-gen-cpp.cmake"):   # a user's own tree: left alone
        b.build(b.BuildOptions(cuda=False, flavor="ik_llama.cpp"), source=tree, cache=tmp_path / "cache2",
                say=lambda s: None)


def test_an_interrupted_build_is_resumed_with_its_objects(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM through the CLI) during compilation keeps the partial build; the next build with the
    same key resumes it instead of extracting and compiling from scratch. A failed build is still removed."""
    tree = fake_tree(tmp_path / "tree")
    out = tmp_path / "src.tar.xz"
    sources.export_source(tree, out)
    cache = tmp_path / "cache"
    real = b._run_logged

    def interrupt_compile(argv, *a, **kw):
        if "--build" in argv:
            raise KeyboardInterrupt
        return real(argv, *a, **kw)

    monkeypatch.setattr(b, "_run_logged", interrupt_compile)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        b.build(b.BuildOptions(cuda=False), source=out, cache=cache, say=said.append)
    (partial,) = (cache / "llama.cpp").glob("*.partial")
    assert (partial / "partial.json").is_file() and any("resumes it" in x for x in said)
    marker = next(partial.glob("src/*/src")) / "kept.txt"
    marker.write_text("the extracted source is reused, not unpacked again")
    monkeypatch.setattr(b, "_run_logged", real)
    said.clear()
    res = b.build(b.BuildOptions(cuda=False), source=out, cache=cache, say=said.append)
    assert any(x.startswith("resuming the interrupted build") for x in said)
    assert os.access(res.server, os.X_OK) and not res.cached and not partial.exists()
    assert not (res.prefix / "partial.json").exists()
    # another key (other options) does not resume someone else's partial build
    assert b._resumable(partial, "other-key") is None


SLOW_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake_llama C)
add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/slow.c
                   COMMAND ${CMAKE_COMMAND} -E sleep 60
                   COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_SOURCE_DIR}/tools/tool.c ${CMAKE_BINARY_DIR}/slow.c)
add_library(llama STATIC src/lib.c)
foreach(t llama-server llama-bench llama-fit-params ggml-rpc-server)
  add_executable(${t} ${CMAKE_BINARY_DIR}/slow.c)
  target_link_libraries(${t} llama)
endforeach()
"""


@pytest.mark.integration
def test_sigterm_stops_every_compiler_and_keeps_the_partial_build(tmp_path):
    """`orchestrator build` stopped with SIGTERM (as `timeout` does): exit 130, nothing it started is left running
    (cmake, ninja and the step they run are in its process group), and the partial build stays for a resume."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    tree = fake_tree(tmp_path / "tree")
    (tree / "CMakeLists.txt").write_text(SLOW_CMAKE)
    env = {**os.environ, "ORCHESTRATOR_CACHE": str(tmp_path / "cache")}
    p = subprocess.Popen([sys.executable, "-m", "orchestrator", "build", "--source", str(tree), "--cpu"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def cmdline(k) -> str:
        try:
            return " ".join(k.cmdline())
        except psutil.Error:            # a configure step that ended (a zombie) between listing and reading it
            return ""

    try:
        deadline = time.monotonic() + 60
        sleeper = None
        while time.monotonic() < deadline and sleeper is None:
            kids = psutil.Process(p.pid).children(recursive=True)
            sleeper = next((k for k in kids if "sleep" in cmdline(k)), None)
            time.sleep(0.1)
        assert sleeper is not None, p.stderr.read() if p.poll() is not None else "no build step started"
        group = [k for k in psutil.Process(p.pid).children(recursive=True)]
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:            # a failed assertion must not leave cmake running into the next tests
            try:
                left = psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                left = []
            for k in left + [psutil.Process(p.pid)]:
                try:
                    k.kill()
                except psutil.Error:
                    pass
            p.wait()
    assert p.returncode == 130, err
    gone, alive = psutil.wait_procs(group, timeout=10)
    assert alive == [], [k.cmdline() for k in alive]
    (partial,) = (tmp_path / "cache" / "llama.cpp").glob("*.partial")
    assert (partial / "partial.json").is_file() and "resumes it" in err


def test_cuda_requested_without_nvcc(tmp_path, monkeypatch):
    monkeypatch.setattr(b, "find_nvcc", lambda: None)
    with pytest.raises(BackendError, match="nvcc"):
        b.build(b.BuildOptions(cuda=True), source=fake_tree(tmp_path / "t"), cache=tmp_path / "c", say=lambda s: None)


def test_pinned_sources_are_pinned():
    for src in sources.SOURCES.values():
        assert len(src.sha256) == 64 and src.url.startswith("https://files.pythonhosted.org/")
        assert src.version in src.filename
