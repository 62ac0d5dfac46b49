"""orchestrator build: build (or reuse from the cache) llama.cpp's llama-server, llama-bench, llama-fit-params
(and ggml-rpc-server)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

HELP = "Build llama-server/llama-bench/llama-fit-params/ggml-rpc-server from a pinned llama.cpp source (cached)"
DESCRIPTION = """\
Build llama.cpp's llama-server, llama-bench, llama-fit-params and ggml-rpc-server (ggml's RPC backend: it serves
this machine's CPU or GPU as a device for llama-server's --rpc) from a pinned source obtained through PyPI (the
llama.cpp tree vendored in the llama-cpp-python sdist; ik_llama.cpp from ik-llama-cpp-python: llama-server,
llama-bench and llama-sweep-bench), or from a local archive/tree with --source. CPU by default, CUDA when nvcc is found (architectures from the GPUs present).
Builds are cached under the user's cache dir, keyed by source and options: a valid cache is never rebuilt.
Prints the path of llama-server on stdout."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flavor", choices=["mainline", "ik_llama.cpp"], default="mainline",
                   help="which llama.cpp to build (default: mainline)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cuda", dest="cuda", action="store_true", default=None, help="build the CUDA backend (default: when nvcc and an NVIDIA GPU are both present)")
    g.add_argument("--cpu", dest="cuda", action="store_false", help="CPU only, even when nvcc is present")
    p.add_argument("--cuda-arch", action="append", default=[], metavar="SM",
                   help="CUDA architecture, e.g. 90 (repeatable; default: those of the GPUs present)")
    p.add_argument("--native", action="store_true",
                   help="tune for this CPU (GGML_NATIVE=ON); off by default: a portable AVX2 build")
    p.add_argument("--source", type=Path, metavar="ARCHIVE|DIR",
                   help="local llama.cpp source (archive or tree) instead of downloading the pinned sdist")
    p.add_argument("--rebuild", action="store_true", help="build even when a valid cached build exists")
    p.add_argument("-j", "--jobs", type=int, default=0, help="parallel compile jobs (default: all CPUs)")
    p.add_argument("--export-source", type=Path, metavar="OUT.tar.xz",
                   help="write a small source archive (for an air-gapped machine's --source) instead of building")
    p.add_argument("--json", action="store_true", help="print the build description as JSON")


def run(args: argparse.Namespace) -> int:
    from orchestrator.backend import build as b
    from orchestrator.backend import patches, sources
    from orchestrator.errors import BackendError
    from orchestrator.paths import cache_dir

    if args.export_source:
        out = args.export_source
        if not out.parent.is_dir():
            raise BackendError(f"{out}: directory {out.parent} does not exist")
        if args.source is None:
            archive = sources.fetch(sources.SOURCES[args.flavor], cache_dir())
            with tempfile.TemporaryDirectory() as tmp:
                root = sources.extract(archive, Path(tmp), sources.SOURCES[args.flavor].subdir)
                # the archive carries our patches applied (and their marker), so the air-gapped build equals this one
                patches.apply(root, patches.series(args.flavor), lambda s: None, strict=True)
                size = sources.export_source(root, out)
        elif args.source.is_dir():
            size = sources.export_source(args.source, out)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                size = sources.export_source(sources.extract(args.source, Path(tmp)), out)
        print(f"{out} ({size / 2**20:.1f} MiB)")
        return 0
    if args.jobs < 0:
        raise BackendError(f"--jobs must be >= 0, got {args.jobs}")
    opts = b.BuildOptions(flavor=args.flavor, cuda=args.cuda, cuda_archs=tuple(args.cuda_arch), native=args.native,
                          jobs=args.jobs)
    from orchestrator.sigutil import terminate_as_interrupt

    with terminate_as_interrupt():   # SIGTERM/SIGHUP: stop the compilers, keep what was compiled for a resume
        res = b.build(opts, source=args.source, rebuild=args.rebuild)
    if args.json:
        print(json.dumps({"key": res.key, "server": str(res.server), "cached": res.cached,
                          "binaries": {k: str(v) for k, v in res.binaries.items()}, **res.info}, indent=1))
    else:
        print(res.server)
    return 0
