"""orchestrator pull TOPOLOGY|MODEL: download a remote model into the cache (what `up` does before it starts)."""

from __future__ import annotations

import argparse
import sys

HELP = "Download a model given by URL or Hugging Face id (or a topology's) into the cache, resumably"
DESCRIPTION = """\
Download the model a topology names (model.path), or the MODEL given (an https:// URL, hf://ORG/REPO/FILE.gguf or
ORG/REPO:QUANT), into the orchestrator cache: every shard, resumable (an interrupted pull continues where it
stopped), checked against the Hub's SHA-256 where it publishes one, after checking the disk has room. HF_TOKEN
is used for gated repositories. Prints the local path of the (first) file. `up` does the same before it starts
the workers."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TOPOLOGY|MODEL", help="topology.yaml, or a model URL / Hugging Face reference")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a topology key, e.g. --set model.path=org/repo:Q4_K_M (repeatable; a relative path "
                        "given this way is taken from the current directory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def model_of(target: str, overrides: list[str]) -> str:
    """The model reference a pull target names: a topology's model.path, or the target itself."""
    from orchestrator.model.remote import is_remote

    if is_remote(target):
        return target
    if target.lower().endswith((".yaml", ".yml")):
        from orchestrator.config import load_topology, parse_overrides

        topo = load_topology(target)
        if overrides:
            topo = topo.override(parse_overrides(overrides))
        return topo.model.path
    return target


def download(model_path: str, *, progress: bool = True) -> list[str] | None:
    """Download a remote model's files not yet in the cache (None for a local model: nothing to do)."""
    from orchestrator.model import remote

    return remote.download_missing(model_path, lambda line: print(line, file=sys.stderr), progress=progress)


def run(args: argparse.Namespace) -> int:
    from orchestrator.errors import ModelError

    model = model_of(args.target, args.set)
    paths = download(model, progress=not args.no_progress)
    if paths is None:
        import os

        if not os.path.exists(model):
            raise ModelError(f"{model}: no such file (and not a URL or Hugging Face reference)")
        print(f"pull: {model} is a local file: nothing to download", file=sys.stderr)
        print(model)
        return 0
    print(paths[0])
    return 0
