"""``python -m orchestrator.cluster up DEPLOYMENT.json [--detach]``: run a Deployment saved as JSON.

The ``orchestrator up topology.yaml`` command plans and then calls the same :func:`orchestrator.cluster.up`;
this entry runs an already planned deployment (``Deployment.to_dict()``), which tests and debugging use.
Errors are one line on stderr with exit status 2, as in the CLI.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from orchestrator.errors import OrchestratorError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.cluster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="run a deployment (JSON of Deployment.to_dict())")
    u.add_argument("deployment")
    u.add_argument("--detach", action="store_true", help="return once ready and leave it running")
    d = sub.add_parser("down", help="stop a deployment")
    d.add_argument("--namespace", "-n", default="orchestrator")
    a = ap.parse_args(argv)
    from orchestrator.cluster import Deployment, down, up

    try:
        if a.cmd == "up":
            with open(a.deployment) as f:
                dep = Deployment.from_dict(json.load(f))
            up(dep, foreground=not a.detach)
        else:
            down(a.namespace)
    except OrchestratorError as e:
        print(f"orchestrator {a.cmd}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"orchestrator {a.cmd}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
