"""orchestrator probe (not built yet)."""

from __future__ import annotations

import argparse

from orchestrator.commands._unbuilt import not_built

HELP = "Measure PCIe and memory bandwidth per GPU and NUMA node (not built yet)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    return not_built("probe", 3)
