"""orchestrator inspect (not built yet)."""

from __future__ import annotations

import argparse

from orchestrator.commands._unbuilt import not_built

HELP = "Show the machine: sockets, NUMA nodes, cores, GPUs and links (not built yet)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    return not_built("inspect", 3)
