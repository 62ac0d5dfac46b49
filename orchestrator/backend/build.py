"""Reproducible, cached builds of llama.cpp's ``llama-server``, ``llama-bench`` and ``llama-fit-params``.

The cache lives under ``<cache>/llama.cpp/<key>/`` where ``key`` hashes the source (pinned sdist sha256 or the
local archive's sha256) and every build option, so a valid cache is never rebuilt and a changed option never
reuses a stale binary. A build happens in ``<key>.partial`` and is renamed into place only when it succeeded;
a failed build leaves nothing behind but reports the compiler's last lines.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from orchestrator.backend import patches, sources
from orchestrator.errors import BackendError
from orchestrator.paths import cache_dir

TARGETS = ("llama-server", "llama-bench", "llama-fit-params", "ggml-rpc-server")
# ik_llama.cpp keeps its tools under examples/ and has llama-sweep-bench instead of llama-fit-params
FLAVOR_TARGETS = {"mainline": TARGETS, "ik_llama.cpp": ("llama-server", "llama-bench", "llama-sweep-bench")}
BUILD_FORMAT = 3  # bump when the cache layout or the fixed CMake flags change


@dataclass(frozen=True)
class BuildOptions:
    """What to build. ``cuda=None`` means: CUDA when ``nvcc`` is found *and* an NVIDIA GPU is present.

    (nvcc alone is not enough: a CI image may carry the toolkit without a GPU, and a CUDA build for every
    architecture takes hours on a small machine. ``cuda=True`` forces it.)"""

    flavor: str = "mainline"                 # "mainline" | "ik_llama.cpp"
    cuda: bool | None = None
    cuda_archs: tuple[str, ...] = ()         # e.g. ("90",); empty = from the detected GPUs, else llama.cpp's list
    native: bool = False                     # GGML_NATIVE: tune for this CPU (off: portable AVX2 build)
    build_type: str = "Release"
    targets: tuple[str, ...] = ()            # empty = the flavor's own set (FLAVOR_TARGETS)
    extra_cmake: tuple[str, ...] = ()
    jobs: int = 0                            # 0 = all CPUs

    @property
    def resolved_targets(self) -> tuple[str, ...]:
        return self.targets or FLAVOR_TARGETS.get(self.flavor, TARGETS)


@dataclass(frozen=True)
class BuildResult:
    key: str
    prefix: Path
    server: Path
    binaries: dict[str, Path] = field(default_factory=dict)
    cached: bool = False
    seconds: float = 0.0
    info: dict = field(default_factory=dict)


def find_nvcc() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for cand in ("/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc"):
        if os.access(cand, os.X_OK):
            return cand
    return None


def detect_cuda_archs() -> tuple[str, ...]:
    """Compute capabilities of the GPUs present (``("90",)`` on an H200), through NVML or nvidia-smi."""
    archs: set[str] = set()
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i))
                archs.add(f"{major}{minor}")
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no GPU, or no NVML: try nvidia-smi, then give up
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20).stdout
                archs.update(line.strip().replace(".", "") for line in out.splitlines() if line.strip())
            except (OSError, subprocess.SubprocessError):
                pass
    return tuple(sorted(a for a in archs if a.isdigit()))


def cmake_args(opts: BuildOptions, *, cuda: bool, archs: tuple[str, ...]) -> list[str]:
    args = [
        f"-DCMAKE_BUILD_TYPE={opts.build_type}",
        f"-DGGML_NATIVE={'ON' if opts.native else 'OFF'}",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        # ik_llama.cpp's server and benches live under examples/
        f"-DLLAMA_BUILD_EXAMPLES={'ON' if opts.flavor == 'ik_llama.cpp' else 'OFF'}",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF",
    ]
    if opts.flavor == "mainline":
        # ggml's RPC backend: llama-server's --rpc, and ggml-rpc-server, which serves a backend of this machine as a
        # GPU-type device; the expert cache's scheduler path runs through it in the CPU tests
        args.append("-DGGML_RPC=ON")
    if cuda:
        args.append("-DGGML_CUDA=ON")
        if archs:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}")
    args.extend(opts.extra_cmake)
    return args


def _source_id(opts: BuildOptions, source: Path | None) -> tuple[str, str]:
    """(id used in the cache key, human description)."""
    if source is None:
        pin = sources.SOURCES[opts.flavor]
        return f"{pin.package}=={pin.version}:{pin.sha256}", f"{pin.package} {pin.version} sdist (PyPI, sha256 pinned)"
    source = source.resolve()
    if source.is_dir():
        return f"dir:{source}", f"local tree {source}"
    return f"archive:{sources.sha256_file(source)}", f"local archive {source}"


def build_key(opts: BuildOptions, source: Path | None, *, cuda: bool, archs: tuple[str, ...]) -> tuple[str, dict]:
    sid, desc = _source_id(opts, source)
    spec = {
        "format": BUILD_FORMAT,
        "source": sid,
        "flavor": opts.flavor,
        "cmake": cmake_args(opts, cuda=cuda, archs=archs),
        "targets": sorted(opts.resolved_targets),
    }
    if source is None or not source.is_dir():
        # our own extracted copy gets the patch series (a user's tree is built as it is)
        spec["patches"] = patches.describe(patches.series(opts.flavor))
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return f"{opts.flavor}-{'cuda' if cuda else 'cpu'}-{key}", {**spec, "source_description": desc}


def _cached(prefix: Path, targets: tuple[str, ...]) -> dict | None:
    meta = prefix / "build.json"
    if not meta.is_file():
        return None
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    if all(os.access(prefix / "bin" / t, os.X_OK) for t in targets):
        return info
    return None


class _Progress:
    """Prints ``[n/N]`` build progress: one updating line on a terminal, a line per 10% otherwise."""

    _RE = re.compile(r"^\[(\d+)/(\d+)\]")

    def __init__(self, label: str, stream=sys.stderr):
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.last_decile = -1
        self.t0 = time.monotonic()

    def line(self, text: str) -> None:
        m = self._RE.match(text)
        if not m:
            return
        n, total = int(m.group(1)), int(m.group(2))
        elapsed = time.monotonic() - self.t0
        msg = f"{self.label}: [{n}/{total}] {100 * n // max(total, 1)}% {elapsed:.0f}s"
        if self.tty:
            self.stream.write("\r" + msg.ljust(60))
            self.stream.flush()
        else:
            decile = 10 * n // max(total, 1)
            if decile != self.last_decile:
                self.last_decile = decile
                print(msg, file=self.stream, flush=True)

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _run_logged(argv: list[str], cwd: Path, log: Path, env: dict, progress: _Progress | None) -> int:
    with open(log, "a") as lf:
        lf.write("$ " + " ".join(argv) + "\n")
        lf.flush()
        # its own process group, so stopping the build stops cmake's ninja and every compiler under it too
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, bufsize=1, start_new_session=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lf.write(line)
                if progress:
                    progress.line(line)
            return proc.wait()
        except BaseException:
            # TERM first: ninja then stops the steps it runs (each in a process group of its own); KILL after 10 s
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            raise


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    # prefer the compiler's error lines when there are any
    errs = [ln for ln in lines if re.search(r"\berror\b|Error|FAILED", ln)]
    picked = errs[-n:] if errs else lines[-n:]
    return "\n".join(picked)


def build(
    opts: BuildOptions = BuildOptions(),
    *,
    source: Path | None = None,
    cache: Path | None = None,
    rebuild: bool = False,
    say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> BuildResult:
    """Build (or reuse) llama.cpp; returns where the binaries are."""
    cache = cache or cache_dir()
    if opts.flavor not in sources.SOURCES:
        raise BackendError(f"unknown llama.cpp flavor {opts.flavor!r} (expected one of {sorted(sources.SOURCES)})")
    if source is not None and not source.exists():
        raise BackendError(f"{source}: source archive not found")
    nvcc = find_nvcc()
    detected = detect_cuda_archs() if nvcc and (opts.cuda is not False) else ()
    cuda = bool(nvcc and detected) if opts.cuda is None else opts.cuda
    if cuda and not nvcc:
        raise BackendError("CUDA build requested but nvcc was not found (install the CUDA toolkit or add it to PATH)")
    archs = opts.cuda_archs or detected
    key, spec = build_key(opts, source, cuda=cuda, archs=archs)
    root = cache / "llama.cpp"
    root.mkdir(parents=True, exist_ok=True)
    prefix = root / key
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not rebuild:
            info = _cached(prefix, opts.resolved_targets)
            if info is not None:
                return BuildResult(key, prefix, prefix / "bin" / "llama-server",
                                   {t: prefix / "bin" / t for t in opts.resolved_targets}, cached=True, info=info)
        if prefix.exists():
            shutil.rmtree(prefix)
        work = root / f"{key}.partial"
        resume = None if rebuild else _resumable(work, key)
        if resume is None:
            if work.exists():
                shutil.rmtree(work)
            work.mkdir()
        t0 = time.monotonic()
        ok = False
        interrupted = False
        try:
            if resume is not None:
                src_root = resume
                say(f"resuming the interrupted build in {work}")
            else:
                if source is None:
                    archive = sources.fetch(sources.SOURCES[opts.flavor], cache, progress=say)
                    src_root = sources.extract(archive, work / "src", sources.SOURCES[opts.flavor].subdir)
                elif source.is_dir():
                    src_root = sources.find_llama_root(source)
                else:
                    src_root = sources.extract(source, work / "src")
                if source is None or not source.is_dir():
                    _patch_source(src_root, opts.flavor, say)  # our own extracted copy (a user's tree is left alone)
                    if patches.applied(src_root) is None:     # an exported archive is patched already
                        patches.apply(src_root, patches.series(opts.flavor), say, strict=source is None)
                # from here an interrupted build (Ctrl-C, a killed shell, a lost machine) is resumed by the next
                # `orchestrator build` with the same key: the compiled objects are kept
                (work / "partial.json").write_text(json.dumps({"key": key, "src_root": str(src_root)}) + "\n")
            bdir = work / "build"
            log = work / "build.log"
            env = dict(os.environ)
            if nvcc and cuda:
                env["PATH"] = str(Path(nvcc).parent) + os.pathsep + env.get("PATH", "")
                env.setdefault("CUDACXX", nvcc)
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            if not shutil.which("cmake"):
                raise BackendError("cmake not found: install it (Debian/Ubuntu: apt-get install cmake ninja-build g++)")
            say(f"configuring llama.cpp ({spec['source_description']}; {'CUDA ' + ','.join(archs) if cuda else 'CPU'}"
                f"{', native' if opts.native else ''}) in {work}")
            rc = _run_logged(["cmake", "-S", str(src_root), "-B", str(bdir), *gen,
                              *cmake_args(opts, cuda=cuda, archs=archs)], work, log, env, None)
            if rc != 0:
                raise BackendError(f"llama.cpp configure failed (exit {rc}); last lines of {log.name}:\n{_tail(log)}")
            jobs = opts.jobs or os.cpu_count() or 2
            prog = _Progress(f"building {'/'.join(opts.resolved_targets)}")
            rc = _run_logged(["cmake", "--build", str(bdir), "--target", *opts.resolved_targets, "-j", str(jobs)],
                             work, log, env, prog)
            prog.done()
            if rc != 0:
                raise BackendError(f"llama.cpp build failed (exit {rc}); the compiler's last lines:\n{_tail(log)}")
            (work / "bin").mkdir()
            binaries = {}
            for t in opts.resolved_targets:
                found = next((p for p in (bdir / "bin" / t, bdir / t) if p.is_file()), None)
                if found is None:
                    raise BackendError(f"llama.cpp build finished but {t} is missing under {bdir}")
                shutil.copy2(found, work / "bin" / t)
                binaries[t] = prefix / "bin" / t
            dev = _install_dev(src_root, bdir, work)
            seconds = time.monotonic() - t0
            info = {**spec, "dev": dev, "cuda": cuda, "cuda_archs": list(archs), "seconds": round(seconds, 1),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "jobs": jobs}
            (work / "build.json").write_text(json.dumps(info, indent=1) + "\n")
            shutil.copy2(log, work / "build.log.keep")
            shutil.rmtree(work / "src", ignore_errors=True)
            shutil.rmtree(bdir, ignore_errors=True)
            (work / "build.log").unlink(missing_ok=True)
            (work / "partial.json").unlink(missing_ok=True)
            os.replace(work, prefix)
            ok = True
            say(f"built llama.cpp in {seconds:.0f}s -> {prefix / 'bin'}")
            return BuildResult(key, prefix, prefix / "bin" / "llama-server", binaries, cached=False,
                               seconds=seconds, info=info)
        except KeyboardInterrupt:
            interrupted = True
            say(f"build interrupted: the next `orchestrator build` with the same options resumes it ({work})")
            raise
        finally:
            if not ok and not interrupted:
                shutil.rmtree(work, ignore_errors=True)      # a failed build leaves the cache clean


def _resumable(work: Path, key: str) -> Path | None:
    """The source root of an interrupted build of ``key`` in ``work`` (its objects are reused), else None."""
    try:
        meta = json.loads((work / "partial.json").read_text())
    except (OSError, ValueError):
        return None
    src = Path(meta.get("src_root", ""))
    if meta.get("key") != key or not (src / "CMakeLists.txt").is_file():
        return None
    return src


_IK_BUILD_INFO_SCRIPT = """\
# Written by orchestrator: the ik-llama-cpp-python sdist leaves out common/cmake/, which ik_llama.cpp's
# common/CMakeLists.txt runs to write build-info.cpp.
include(${CMAKE_CURRENT_LIST_DIR}/../../cmake/build-info.cmake)
configure_file(${CMAKE_CURRENT_LIST_DIR}/../build-info.cpp.in ${CMAKE_CURRENT_LIST_DIR}/../build-info.cpp)
"""


def _patch_source(src_root: Path, flavor: str, say: Callable[[str], None]) -> None:
    """Repair known packaging gaps of the pinned sdists (only files that are missing are written)."""
    if flavor == "ik_llama.cpp":
        script = src_root / "common" / "cmake" / "build-info-gen-cpp.cmake"
        if not script.exists() and (src_root / "common" / "build-info.cpp.in").exists():
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(_IK_BUILD_INFO_SCRIPT)
            say(f"added the missing {script.relative_to(src_root)} (absent from the sdist)")


def _install_dev(src_root: Path, bdir: Path, work: Path) -> dict:
    """Keep the static libraries and public headers, so small native tools (native/) can link libllama."""
    lib, inc = work / "lib", work / "include"
    lib.mkdir()
    inc.mkdir()
    libs = []
    for a in sorted(bdir.rglob("*.a")):
        if a.name.startswith(("libllama", "libggml")):
            shutil.copy2(a, lib / a.name)
            libs.append(a.name)
    for hdir in (src_root / "include", src_root / "ggml" / "include"):
        for h in hdir.glob("*.h"):
            shutil.copy2(h, inc / h.name)
    return {"libs": libs, "include": "include", "lib": "lib"}


def cached_builds(cache: Path | None = None) -> list[tuple[Path, dict]]:
    """Completed builds in the cache, newest first."""
    root = (cache or cache_dir()) / "llama.cpp"
    out = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and not d.name.endswith(".partial"):
                info = _cached(d, ("llama-server",))
                if info is not None:
                    out.append((d, info))
    out.sort(key=lambda x: (x[0] / "build.json").stat().st_mtime, reverse=True)
    return out


__all__ = ["BuildOptions", "BuildResult", "build", "cached_builds", "detect_cuda_archs", "find_nvcc", "asdict"]
