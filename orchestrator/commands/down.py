"""orchestrator down: stop everything `up` started."""

from __future__ import annotations

import argparse

HELP = "Stop workers, gateway and the Ray head that up started"
DESCRIPTION = (HELP + ": every llama-server (TERM to its process group, KILL after the timeout), the gateway, "
               "the controller and, when up started one, the embedded Ray head; NUMA balancing is restored by "
               "its wrapper as its child exits. Running it when nothing runs is not an error; a state file that "
               "cannot be read is (exit 2, naming the file): --force then stops the deployment from what up "
               "recorded beside it (its Ray head, the early-started llama-servers) and removes the broken file.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", default=None,
                   help="the deployment's Ray namespace (default: the only one recorded, else 'orchestrator')")
    p.add_argument("--force", action="store_true",
                   help="stop the deployment even when its state file is unreadable or corrupt")


def run(args: argparse.Namespace) -> int:
    import sys

    from orchestrator.cluster import down, state
    from orchestrator.commands.status import pick_namespace

    ns = pick_namespace(args.namespace)
    try:
        recorded = state.read(ns)
    except state.StateError:
        if not args.force:
            raise
        recorded = True
    if recorded is None and not (args.force and state.read_ray_record(ns)):
        print(f"orchestrator down: no deployment {ns!r} is running", file=sys.stderr)
        return 0
    res = down(ns, force=args.force)
    stopped = [w.get("name", "?") for w in res.workers]
    parts = [f"stopped {len(stopped)} worker(s)" + (f" ({', '.join(stopped)})" if stopped else ""), "the gateway"]
    if res.head_stopped:
        parts.append("the Ray head")
    print(f"orchestrator down: {ns}: " + ", ".join(parts), file=sys.stderr)
    return 0
