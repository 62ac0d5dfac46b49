"""orchestrator status: what the running deployment is doing, per worker."""

from __future__ import annotations

import argparse

HELP = "Show the running workers: state, pid, node, binding, devices, memory, tok/s, restarts, last error"
DESCRIPTION = (HELP + ". Exit status: 0 when every worker is ready, 1 while starting or degraded, "
               "2 when no deployment is running or Ray cannot be reached.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", default=None,
                   help="the deployment's Ray namespace (default: the only one recorded, else 'orchestrator')")
    p.add_argument("--json", action="store_true", help="print the full status as JSON")


def pick_namespace(given: str | None) -> str:
    """The namespace a command acts on: the given one, else the only deployment recorded, else the default."""
    from orchestrator.cluster import state

    if given:
        return state.check_namespace(given)

    rec = state.recorded()
    return rec[0] if len(rec) == 1 else "orchestrator"


def run(args: argparse.Namespace) -> int:
    import json

    from orchestrator.cluster import status
    from orchestrator.cluster.view import format_status

    st = status(pick_namespace(args.namespace))
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True, default=str))
    else:
        print(format_status(st))
    return 0 if st.get("phase") == "ready" else 1
