"""orchestrator up: run the plan under Ray behind one OpenAI-compatible gateway."""

from __future__ import annotations

import argparse

HELP = "Start the planned llama-server workers under Ray behind one OpenAI-compatible gateway"
DESCRIPTION = """\
Plan the topology (exactly what `orchestrator plan` prints), then start a Ray head on this machine (or join the
topology's Ray cluster), a controller actor, one worker actor per planned llama-server (pinned with numactl,
under the NUMA-balancing wrapper, restarted on failure) and the gateway. A deployment already running, a taken
gateway or worker port (naming the process holding it) and a missing model file are refused before anything
starts. In the foreground (the default) it prints the gateway and dashboard addresses and stays until Ctrl-C,
SIGTERM, SIGHUP or the pipe its output goes into closing; each stops everything it started (like `orchestrator
down`), and a second signal waits for that stop. Exit status: 0 for a stop that was asked for (Ctrl-C, SIGTERM,
`orchestrator down`), 129 after a hang-up, 141 after the output pipe closed, 1 when the Ray head vanished or the
stop failed; interrupted while starting, 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM). With
--detach it returns once every worker is healthy and leaves the deployment running. A second `up` of a
namespace that an `up` holds is refused."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topology", help="topology.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a topology key, e.g. --set nodes.0.vram_limit=12GiB (repeatable; a relative path "
                        "given this way is taken from the current directory)")
    p.add_argument("--detach", "-d", action="store_true",
                   help="return once every worker is healthy; stop later with `orchestrator down`")
    p.add_argument("--ready-timeout", type=float, default=None, metavar="SECONDS",
                   help="give up (and stop everything) when not ready after this long "
                        "(default: the topology's restart.startup_timeout)")


def run(args: argparse.Namespace) -> int:
    from orchestrator.cluster import start_up
    from orchestrator.config import load_topology, parse_overrides

    topo = load_topology(args.topology)
    if args.set:
        topo = topo.override(parse_overrides(args.set))
    return start_up(topo, detach=args.detach, ready_timeout=args.ready_timeout)
