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
    except KeyboardInterrupt as e:   # Ctrl-C; `up` also raises it for SIGTERM/SIGHUP, with their exit status
        code = getattr(e, "exit_code", 128 + signal.SIGINT)
        try:
            print(f"orchestrator {args.command}: interrupted" + (f" ({e})" if str(e) else ""), file=sys.stderr)
        except (BrokenPipeError, OSError, ValueError):
            pass
        return code
    except BrokenPipeError:
        _silence_output()
        # `orchestrator plan | head` is fine; an `up` whose output pipe closed did not finish what it was asked
        return 128 + signal.SIGPIPE if args.command == "up" else 0


def _silence_output() -> None:
    """Point stdout/stderr at /dev/null so the interpreter's last flush into a closed pipe stays quiet."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
