"""orchestrator down: stop everything `up` started."""

from __future__ import annotations

import argparse

HELP = "Stop workers, gateway and the Ray head that up started"
DESCRIPTION = (HELP + ": every llama-server (TERM to its process group, KILL after the timeout), the gateway, "
               "the controller and, when up started one, the embedded Ray head; NUMA balancing is restored by "
               "its wrapper as its child exits. Running it when nothing runs is not an error.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", default=None,
                   help="the deployment's Ray namespace (default: the only one recorded, else 'orchestrator')")


def run(args: argparse.Namespace) -> int:
    import sys

    from orchestrator.cluster import down, state
    from orchestrator.commands.status import pick_namespace

    ns = pick_namespace(args.namespace)
    if state.read(ns) is None:
        print(f"orchestrator down: no deployment {ns!r} is running", file=sys.stderr)
        return 0
    res = down(ns)
    stopped = [w.get("name", "?") for w in res.workers]
    parts = [f"stopped {len(stopped)} worker(s)" + (f" ({', '.join(stopped)})" if stopped else ""), "the gateway"]
    if res.head_stopped:
        parts.append("the Ray head")
    print(f"orchestrator down: {ns}: " + ", ".join(parts), file=sys.stderr)
    return 0
