"""Measure how a MoE model routes tokens, through llama.cpp itself.

``native/expert_usage.cpp`` loads a GGUF with libllama, evaluates prompts of random token ids and records the
router's top-k (the ``ffn_moe_topk-<layer>`` graph tensors) of every MoE layer. This module compiles it on
demand against the static libraries and headers that ``orchestrator build`` keeps in its cache
(``<cache>/llama.cpp/<key>/{lib,include}``), caches the binary under ``<cache>/native/`` keyed by the source,
the libraries and the flags, runs it and parses its JSON.

A synthetic model is only useful for speed measurements if its routing looks like a trained model's: llama.cpp
reads and copies only the experts a batch uses. :func:`check` states the rule the tests enforce.

``python -m orchestrator.model.routing MODEL.gguf`` prints a per-layer table.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import BackendError, ModelError
from orchestrator.paths import cache_dir, native_dir

SOURCE = native_dir() / "expert_usage.cpp"
TOOL = "expert_usage"


@dataclass(frozen=True)
class DevTree:
    """Static llama.cpp libraries and public headers to link a native tool against."""

    libs: tuple[Path, ...]
    include_dirs: tuple[Path, ...]
    origin: str

    @property
    def cuda(self) -> bool:
        return any(p.name.startswith("libggml-cuda") for p in self.libs)


@dataclass(frozen=True)
class LayerUsage:
    layer: int
    distinct: int          # experts picked at least once
    max_share: float       # largest fraction of all picks taken by one expert
    counts: tuple[int, ...]


@dataclass(frozen=True)
class RoutingRun:
    n_tokens: int
    layers: tuple[LayerUsage, ...]

    def min_distinct(self) -> int:
        return min(u.distinct for u in self.layers)


@dataclass(frozen=True)
class RoutingReport:
    model: str
    arch: str
    n_expert: int
    n_expert_used: int
    n_layer: int
    runs: tuple[RoutingRun, ...]

    def run(self, n_tokens: int) -> RoutingRun:
        for r in self.runs:
            if r.n_tokens == n_tokens:
                return r
        raise KeyError(n_tokens)


def parse_report(text: str) -> RoutingReport:
    d = json.loads(text)
    runs = tuple(
        RoutingRun(r["n_tokens"], tuple(LayerUsage(x["layer"], x["distinct"], float(x["max_share"]),
                                                   tuple(x["counts"])) for x in r["layers"]))
        for r in d["runs"])
    return RoutingReport(d["model"], d["arch"], int(d["n_expert"]), int(d["n_expert_used"]), int(d["n_layer"]), runs)


def check(report: RoutingReport, *, long_tokens: int = 512, short_tokens: int = 8,
          min_fraction: float = 0.9) -> list[str]:
    """Problems with the routing (empty when it looks like a trained model's).

    Over ``long_tokens`` tokens every MoE layer must pick at least ``min_fraction`` of its experts; over
    ``short_tokens`` tokens every layer must pick more than ``n_expert_used`` distinct experts (the minimum, when
    all tokens agree).
    """
    problems = []
    need = min_fraction * report.n_expert
    for u in report.run(long_tokens).layers:
        if u.distinct < need:
            problems.append(f"layer {u.layer}: {u.distinct}/{report.n_expert} experts used over {long_tokens} tokens "
                            f"(need >= {need:.0f})")
    for u in report.run(short_tokens).layers:
        if u.distinct <= report.n_expert_used:
            problems.append(f"layer {u.layer}: only {u.distinct} distinct experts over {short_tokens} tokens "
                            f"(the minimum is {report.n_expert_used})")
    return problems


# --------------------------------------------------------------------------------------------------------------
# building the tool


def _lib_order(libs: list[Path]) -> list[Path]:
    def rank(p: Path) -> tuple[int, str]:
        n = p.name
        if n.startswith("libllama"):
            return 0, n
        if n == "libggml.a":
            return 1, n
        if n == "libggml-base.a":
            return 3, n
        return 2, n
    return sorted(libs, key=rank)


def _wanted(name: str) -> bool:
    """libllama and the ggml libraries; not the tools' own libraries (server, bench, common)."""
    return name == "libllama.a" or (name.startswith("libggml") and name.endswith(".a"))


def dev_tree_from_cache(cache: Path | None = None) -> DevTree | None:
    """The newest cached mainline ``orchestrator build`` that kept its libraries and headers (the tool uses
    mainline llama.cpp's API; ik_llama.cpp's differs)."""
    from orchestrator.backend.build import cached_builds

    builds = sorted(cached_builds(cache), key=lambda b: b[1].get("flavor", "mainline") != "mainline")
    for prefix, info in builds:
        if info.get("flavor", "mainline") != "mainline":
            continue
        dev = info.get("dev") or {}
        names = dev.get("libs") or []
        libdir = prefix / dev.get("lib", "lib")
        incdir = prefix / dev.get("include", "include")
        libs = [libdir / n for n in names if _wanted(n) and (libdir / n).is_file()]
        if libs and any(p.name == "libllama.a" for p in libs) and (incdir / "llama.h").is_file():
            return DevTree(tuple(_lib_order(libs)), (incdir,), f"build cache {prefix}")
    return None


def dev_tree_from_dirs(build_dir: Path, include_dirs: list[Path]) -> DevTree:
    """A llama.cpp CMake build tree (static libs anywhere under it) plus header directories."""
    libs = [p for p in build_dir.rglob("*.a") if _wanted(p.name)]
    if not any(p.name == "libllama.a" for p in libs):
        raise BackendError(f"{build_dir}: no libllama.a under it (build llama.cpp with BUILD_SHARED_LIBS=OFF)")
    for d in include_dirs:
        if not d.is_dir():
            raise BackendError(f"{d}: header directory not found")
    return DevTree(tuple(_lib_order(libs)), tuple(include_dirs), f"build tree {build_dir}")


def find_dev_tree() -> DevTree:
    """The build cache, else ``$ORCHESTRATOR_LLAMA_BUILD_DIR`` + ``$ORCHESTRATOR_LLAMA_INCLUDE`` (path list)."""
    tree = dev_tree_from_cache()
    if tree:
        return tree
    bdir = os.environ.get("ORCHESTRATOR_LLAMA_BUILD_DIR")
    inc = os.environ.get("ORCHESTRATOR_LLAMA_INCLUDE")
    if bdir and inc:
        return dev_tree_from_dirs(Path(bdir), [Path(p) for p in inc.split(os.pathsep) if p])
    raise BackendError("no llama.cpp libraries to link expert_usage against: run `orchestrator build` first "
                       "(or set ORCHESTRATOR_LLAMA_BUILD_DIR and ORCHESTRATOR_LLAMA_INCLUDE)")


def _cuda_link_flags() -> list[str]:
    from orchestrator.backend.build import find_nvcc

    dirs = []
    nvcc = find_nvcc()
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        dirs += [root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"]
    dirs += [Path("/usr/local/cuda/lib64")]
    flags = []
    for d in dirs:
        if d.is_dir():
            flags += [f"-L{d}", f"-Wl,-rpath,{d}"]
        if (d / "stubs").is_dir():
            flags.append(f"-L{d / 'stubs'}")
    return flags + ["-lcudart", "-lcublas", "-lcublasLt", "-lcuda"]


def compile_argv(tree: DevTree, out: Path, cxx: str = "c++", extra: tuple[str, ...] = ()) -> list[str]:
    argv = [cxx, "-O2", "-std=c++17", str(SOURCE), "-o", str(out)]
    argv += [f"-I{d}" for d in tree.include_dirs]
    argv += ["-Wl,--start-group", *[str(p) for p in tree.libs], "-Wl,--end-group"]
    if tree.cuda:
        argv += _cuda_link_flags()
    argv += [*extra, "-fopenmp", "-lpthread", "-ldl", "-lm"]
    return argv


# libraries a llama.cpp build may need beyond the fixed list, added when the linker asks for them
# (GGML_CUDA_NCCL is on by default and links NCCL when the build machine has it)
_ON_DEMAND = (("undefined reference to `nccl", "-lnccl"), ("undefined reference to `ibv_", "-libverbs"))


def _tool_key(tree: DevTree, cxx: str) -> str:
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(cxx.encode())
    for p in tree.libs:
        st = p.stat()
        h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
    for d in tree.include_dirs:
        h.update(str(d).encode())
    return h.hexdigest()[:16]


def build_tool(tree: DevTree | None = None, *, cache: Path | None = None) -> Path:
    """Compile expert_usage (once per source/libraries/flags) and return its path."""
    if not SOURCE.is_file():
        raise BackendError(f"{SOURCE} not found: the routing tool is built from a source checkout "
                           f"(pip install -e .)")
    tree = tree or find_dev_tree()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
    if not cxx:
        raise BackendError("no C++ compiler found (install g++) to build the expert_usage tool")
    root = (cache or cache_dir()) / "native"
    root.mkdir(parents=True, exist_ok=True)
    key = _tool_key(tree, cxx)
    exe = root / f"{TOOL}-{key}"
    if os.access(exe, os.X_OK):
        return exe
    with open(root / f".{TOOL}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(exe, os.X_OK):
            return exe
        tmp = root / f"{TOOL}-{key}.partial"
        extra: list[str] = []
        try:
            while True:
                argv = compile_argv(tree, tmp, cxx, tuple(extra))
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                more = [flag for needle, flag in _ON_DEMAND
                        if proc.returncode != 0 and needle in proc.stderr and flag not in extra]
                if not more:
                    break
                extra += more
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
                raise BackendError(f"building {TOOL} against {tree.origin} failed (exit {proc.returncode}):\n{tail}")
            os.replace(tmp, exe)
        finally:
            tmp.unlink(missing_ok=True)
    return exe


# --------------------------------------------------------------------------------------------------------------
# running it


def measure(model: os.PathLike | str, *, lengths: tuple[int, ...] = (512, 8), seed: int = 1,
            threads: int | None = None, ngl: int = 0, tool: Path | None = None,
            timeout: float = 1800) -> RoutingReport:
    """Run expert_usage on ``model`` and return what its routers picked."""
    model = Path(model)
    if not model.is_file():
        raise ModelError(f"{model}: model file not found")
    exe = tool or build_tool()
    argv = [str(exe), str(model), "--seed", str(seed), "-ngl", str(ngl)]
    for n in lengths:
        argv += ["-n", str(n)]
    if threads:
        argv += ["-t", str(threads)]
    return parse_report(_run_tool(argv, model, TOOL, timeout).stdout)


def _run_tool(argv: list[str], model: Path, what: str, timeout: float, say=None,
              interval: float = 10.0) -> subprocess.CompletedProcess:
    """Run the router probe; a timeout or a failure is one line naming the model and the tool's last words.
    ``say(text)``, when given, hears how long it has run every ``interval`` seconds (a trace of a large model on
    a CPU takes minutes and prints nothing before it ends)."""
    import time

    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                raise subprocess.TimeoutExpired(argv, timeout)
            try:
                out, err = proc.communicate(timeout=min(interval, left))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 >= timeout:
                    raise
                if say is not None:
                    say(f"{what}: running for {time.monotonic() - t0:.0f} s")
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise BackendError(f"{what} on {model} took longer than {timeout:.0f}s") from None
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        tail = "\n".join(err.splitlines()[-10:])
        raise ModelError(f"{model}: {what} failed (exit {proc.returncode}): {tail}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def trace(model: os.PathLike | str, *, tokens: int = 1024, prompts: os.PathLike | str | None = None,
          sample: float | None = None, seed: int = 1, threads: int | None = None, ngl: int = 0,
          tool: Path | None = None, timeout: float = 1800, say=None):
    """Decode ``tokens`` tokens one per ``llama_decode`` and return the experts each picked in each MoE layer
    (:class:`orchestrator.model.routing_profile.Trace`). The tokens are random ids, or the text of ``prompts``;
    with ``sample`` (a temperature > 0), after the text (or one random token) they are sampled from the model,
    seeded, as a server generates them. ``say(text)`` hears progress (see :func:`_run_tool`)."""
    import tempfile

    from orchestrator.model.routing_profile import parse_trace

    model = Path(model)
    if not model.is_file():
        raise ModelError(f"{model}: model file not found")
    if prompts is not None and not Path(prompts).is_file():
        raise ModelError(f"{prompts}: prompts file not found")
    if tokens < 2:
        raise ModelError(f"--tokens {tokens}: a trace needs at least 2 tokens")
    if sample is not None and not sample > 0:
        raise ModelError(f"--sample {sample}: the temperature must be > 0 (greedy decoding loops)")
    exe = tool or build_tool()
    with tempfile.TemporaryDirectory(prefix="orchestrator-trace-") as tmp:
        out = Path(tmp) / "routing.trace"
        argv = [str(exe), str(model), "--trace", str(out), "--decode", str(tokens), "--seed", str(seed),
                "-ngl", str(ngl)]
        if prompts is not None:
            argv += ["--prompts", str(prompts)]
        if sample is not None:
            argv += ["--sample", repr(float(sample))]
        if threads:
            argv += ["-t", str(threads)]
        _run_tool(argv, model, f"{TOOL} --trace", timeout, say)
        return parse_trace(out.read_bytes(), str(out))


# --------------------------------------------------------------------------------------------------------------
# routing profiles, cached by model file identity


PROFILE_DIR = "routing"
_HEADER_BYTES = 1 << 20


def model_identity(model: os.PathLike | str) -> str:
    """Size, modification time and a hash of the first MiB (the GGUF header): a changed file gets a new key."""
    model = Path(model)
    try:
        st = model.stat()
        with open(model, "rb") as f:
            head = f.read(_HEADER_BYTES)
    except OSError as e:
        raise ModelError(f"{model}: cannot read: {e.strerror or e}") from None
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    h.update(head)
    return h.hexdigest()[:24]


def profile_path(model: os.PathLike | str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / PROFILE_DIR / f"{model_identity(model)}.json"


def load_profile(model: os.PathLike | str, cache: Path | None = None):
    """The cached routing profile of ``model`` (``(profile, settings)``), or None when it was never measured
    (or the file changed since). Reads one small JSON file: what the plan does at plan time."""
    from orchestrator.model.routing_profile import RoutingProfile

    path = profile_path(model, cache)
    try:
        d = json.loads(path.read_text())
        return RoutingProfile.from_json(d["profile"]), d["settings"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{path}: unreadable routing profile ({e}); delete it and measure again "
                         f"(orchestrator model MODEL --routing)") from None


def profile_curve(model: os.PathLike | str, policy: str = "lru-layer", cache: Path | None = None):
    """The hit-rate curve the plan uses for ``model``: the cached profile's (``lru-layer`` by default: our
    cache gives every host-resident expert tensor its own bank of slots, the same count for all), else the stated
    default for the model's expert count and top-k
    (:func:`~orchestrator.model.routing_profile.default_curve`, read from its header), whose ``source`` says that
    it is the default."""
    from orchestrator.model import read_model
    from orchestrator.model.routing_profile import default_curve

    found = load_profile(model, cache)
    if found:
        return found[0].curve(policy)
    info = read_model(model)
    return default_curve(info.n_expert, info.n_expert_used, info.arch)


# --------------------------------------------------------------------------------------------------------------
# what a trace decodes

# `orchestrator synth-model` writes this as general.organization (model/shapes.py): a generated model, whose
# locality is built into its weights and shows on random ids as on text
SYNTH_ORGANIZATION = "orchestrator synth-model"
CORPUS = Path(__file__).resolve().parent.parent / "_data" / "routing" / "corpus.txt"
CORPUS_PARTS = "chat turns, prose, code, German"
# llama-server's default temperature (common_params_sampling::temp, 0.80 in llama.cpp's common/common.h): the
# continuation is sampled as a server samples it, over the whole vocabulary
TEXT_TEMPERATURE = 0.8
INPUTS = ("auto", "text", "random")


def is_generated(model: os.PathLike | str) -> bool:
    """Whether ``model`` was written by ``orchestrator synth-model`` (its GGUF ``general.organization``)."""
    from orchestrator.model.reader import read_gguf

    return read_gguf(model).metadata.get("general.organization") == SYNTH_ORGANIZATION


def trace_input(model: os.PathLike | str, input: str = "auto", prompts: os.PathLike | str | None = None,
                sample: float | None = None) -> dict:
    """What a trace of ``model`` decodes, as the profile records it: ``input`` "text" (``prompts``, else the
    built-in corpus, then the model's own continuation sampled at ``sample``, default
    :data:`TEXT_TEMPERATURE`) or "random" (uniformly random token ids; sampled after the first one only with
    ``sample``). "auto": random ids for a generated model, text for any other -- a trained model's locality comes
    from coherent text, and random ids make it look far less local than it is in use."""
    if input not in INPUTS:
        raise ModelError(f"trace input {input!r}: expected one of {', '.join(INPUTS)}")
    if prompts is not None:
        if input == "random":
            raise ModelError("--prompts and --random: a trace decodes either a text or random token ids")
        input = "text"
    if input == "auto":
        input = "random" if is_generated(model) else "text"
    if input == "random":
        return {"input": "random", "prompts": None, "sample": sample}
    path = Path(prompts) if prompts is not None else CORPUS
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        if prompts is None:
            raise ModelError(f"{path}: the built-in routing corpus is missing from this installation; "
                             f"give a text with --prompts FILE or use --random") from None
        raise ModelError(f"{path}: prompts file not found") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read the prompts file: {e.strerror or e}") from None
    name = f"the built-in corpus ({CORPUS_PARTS})" if prompts is None else path.name
    return {"input": "text", "prompts": {"path": str(path), "name": name,
                                         "sha256": hashlib.sha256(text).hexdigest()[:16]},
            "sample": TEXT_TEMPERATURE if sample is None else sample}


def describe_input(what: dict) -> str:
    """One line for what a trace decoded (:func:`trace_input`'s record)."""
    if what["input"] == SERVED:
        return (f"{what['tokens']} tokens generated in use by {what['workers']} worker(s), each stream in decode "
                f"order (llama-server --router-trace)")
    if what["input"] == "random":
        return "random token ids" + (f" (one, then the model's own tokens sampled at temperature "
                                     f"{what['sample']:g})" if what["sample"] else "")
    # the text is cut at the trace's length: the continuation starts where the text ends, if before that
    return (f"the text of {what['prompts']['name']}"
            + (f", then past its end the model's own tokens sampled at temperature {what['sample']:g}"
               if what["sample"] else ""))


def measure_profile(model: os.PathLike | str, *, tokens: int = 1024, input: str = "auto",
                    prompts: os.PathLike | str | None = None, sample: float | None = None, seed: int = 1,
                    threads: int | None = None, cache: Path | None = None, refresh: bool = False,
                    tool: Path | None = None, gpu_layers: int = 0, say=None):
    """Measure ``model``'s routing profile (a decode-order trace through llama.cpp of what :func:`trace_input`
    picks) and cache it by the file's identity; a cached profile measured with the same settings is returned as
    it is. ``gpu_layers`` only makes the trace faster (where the layers run changes the routing no more than
    rounding does), so it is not a setting the cache compares. ``say(text)`` hears what it is doing.

    Returns ``(profile, path, cached, settings)``; ``settings`` records what was traced."""
    from orchestrator.model.routing_profile import profile

    model = Path(model)
    if not model.is_file():
        raise ModelError(f"{model}: model file not found")
    what = trace_input(model, input, prompts, sample)
    settings = {"tokens": tokens, "seed": seed, **what}
    path = profile_path(model, cache)
    if not refresh:
        old = load_profile(model, cache)
        # a profile cached before the CPU-miss shares were replayed is measured again
        if old is not None and old[1] == settings and old[0].cpu_misses is not None:
            return old[0], path, True, settings
    exe = tool
    if exe is None:
        if say is not None and not _tool_is_built():
            say(f"building {TOOL} against the cached llama.cpp libraries (once)")
        exe = build_tool()
    if say is not None:
        say(f"tracing {tokens} tokens of {model.name} one per decode, as generation runs: "
            f"{describe_input(what)} (seed {seed})")
    tr = trace(model, tokens=tokens, prompts=what["prompts"]["path"] if what["prompts"] else None,
               sample=what["sample"], seed=seed, threads=threads, tool=exe, ngl=gpu_layers, say=say)
    source = (f"measured: {model.name}, {tr.n_tokens} tokens in decode order, {describe_input(what)} "
              f"(seed {seed})")
    prof = profile(tr, source)
    return prof, save_profile(model, prof, settings, cache), False, settings


def save_profile(model: os.PathLike | str, prof, settings: dict, cache: Path | None = None) -> Path:
    """Cache ``prof`` as ``model``'s routing profile (what :func:`load_profile` reads; written whole or not at
    all), ``settings`` recording what it was made from. Returns its path."""
    path = profile_path(model, cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.{threading.get_ident()}.part")
    try:
        tmp.write_text(json.dumps({"model": str(model), "settings": settings, "profile": prof.to_json()}))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# what a deployment served (orchestrator.cluster.live_routing): the input of a profile made from the workers'
# router traces, which hold the tokens they generated
SERVED = "served"


def served_settings(tokens: int, workers: int) -> dict:
    """The settings a profile made from served traffic records."""
    return {"tokens": int(tokens), "input": SERVED, "workers": int(workers), "prompts": None, "sample": None}


def served_profile(model: os.PathLike | str, tr, workers: int, cache: Path | None = None):
    """``tr`` (a :class:`~orchestrator.model.routing_profile.Trace` of the tokens ``workers`` workers generated,
    each slot's in decode order) as ``model``'s routing profile, cached where :func:`load_profile` finds it, so
    the next plan sizes the cache from it. Returns ``(profile, path)``."""
    from orchestrator.model.routing_profile import profile

    what = served_settings(tr.n_tokens, workers)
    prof = profile(tr, f"measured: {Path(model).name}, {describe_input(what)}")
    return prof, save_profile(model, prof, what, cache)


def _tool_is_built() -> bool:
    """Whether :func:`build_tool` would find its binary without compiling (False when it cannot tell)."""
    try:
        tree = find_dev_tree()
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
        return bool(cxx) and SOURCE.is_file() and os.access(cache_dir() / "native" / f"{TOOL}-{_tool_key(tree, cxx)}",
                                                            os.X_OK)
    except (BackendError, OSError):
        return False


def format_report(report: RoutingReport) -> str:
    lines = [f"{report.model}: {report.arch}, {report.n_expert} experts, top {report.n_expert_used}"]
    head = "layer " + " ".join(f"{'distinct/' + str(r.n_tokens) + 't':>14} {'max share':>9}" for r in report.runs)
    lines.append(head)
    for i, u0 in enumerate(report.runs[0].layers):
        cells = []
        for r in report.runs:
            u = r.layers[i]
            cells.append(f"{u.distinct:>14} {u.max_share:>9.3f}")
        lines.append(f"{u0.layer:>5} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m orchestrator.model.routing",
                                description="Per-layer expert usage of a MoE GGUF, measured through llama.cpp")
    p.add_argument("model", type=Path)
    p.add_argument("-n", type=int, action="append", dest="lengths", help="prompt length (default 512 and 8)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("-t", "--threads", type=int)
    p.add_argument("-ngl", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    lengths = tuple(a.lengths or (512, 8))
    try:
        rep = measure(a.model, lengths=lengths, seed=a.seed, threads=a.threads, ngl=a.ngl)
    except (ModelError, BackendError) as e:
        print(f"routing: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"model": rep.model, "n_expert": rep.n_expert, "runs": [
            {"n_tokens": r.n_tokens, "distinct": [u.distinct for u in r.layers]} for r in rep.runs]}))
    else:
        print(format_report(rep))
    if 512 in lengths and 8 in lengths:
        problems = check(rep)
        for pr in problems:
            print("FAIL " + pr)
        print("routing check: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
