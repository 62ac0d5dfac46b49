"""The ``orchestrator`` command line.

Each command lives in ``orchestrator/commands/<name>.py`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Command modules import heavy things (Ray, NVML, numpy)
inside ``run`` so that ``orchestrator --help`` stays fast.

User errors (``OrchestratorError``) are printed as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from orchestrator import __version__
from orchestrator.errors import OrchestratorError

# name -> module (in the order `--help` shows them, following the data flow)
COMMANDS: dict[str, str] = {
    "doctor": "orchestrator.commands.doctor",
    "inspect": "orchestrator.commands.inspect",
    "probe": "orchestrator.commands.probe",
    "model": "orchestrator.commands.model",
    "synth-model": "orchestrator.commands.synth_model",
    "plan": "orchestrator.commands.plan",
    "pull": "orchestrator.commands.pull",
    "up": "orchestrator.commands.up",
    "status": "orchestrator.commands.status",
    "down": "orchestrator.commands.down",
    "bench": "orchestrator.commands.bench",
    "build": "orchestrator.commands.build",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description="NUMA-aware, multi-GPU orchestrator for Mixture-of-Experts models on llama.cpp.",
    )
    parser.add_argument("--version", action="version", version=f"orchestrator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in COMMANDS.items():
        mod = importlib.import_module(modname)
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except OrchestratorError as err:
        print(f"orchestrator {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"orchestrator {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `orchestrator plan | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
