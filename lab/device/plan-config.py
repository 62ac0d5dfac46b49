#!/usr/bin/env python3
"""Turn one worker of `orchestrator plan --json` into a bench configuration string, for `orchestrator bench
--config`: ``NAME=[LLAMA_SERVER=PATH] [VAR=value ...] flags`` (the worker's flags without --host/--port/--alias,
its environment (op-offload threshold, visible GPUs), and with --server its binary as this configuration's own llama-server).

  python3 lab/device/plan-config.py NAME PLAN.json [--server] [--worker N] [--add 'FLAGS'] [--replace=FLAG=VALUE]
                                    [--env VAR=VALUE]

A variant of the plan: --add appends llama-server flags (--add='--cpu-strict 1'); --replace gives an existing
flag another value (--replace=-ub=512; repeatable); --env sets a variable of its environment (repeatable).
"""
from __future__ import annotations

import argparse
import json
import shlex

SKIP = {"--host", "--port", "--alias"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("plan_json")
    ap.add_argument("--server", action="store_true", help="run it on the plan's own llama-server binary")
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--add", default="", help="llama-server flags appended to the plan's")
    ap.add_argument("--replace", action="append", default=[], metavar="FLAG=VALUE",
                    help="give the plan's FLAG another value")
    ap.add_argument("--env", action="append", default=[], metavar="VAR=VALUE",
                    help="a variable of the server's environment, beside the plan's")
    a = ap.parse_args()
    with open(a.plan_json) as f:
        w = json.load(f)["workers"][a.worker]
    args, out, i = w["args"], [], 0
    while i < len(args):
        if args[i] in SKIP:
            i += 2
            continue
        out.append(args[i])
        i += 1
    for flag, value in (r.split("=", 1) for r in a.replace):
        if flag not in out:
            raise SystemExit(f"plan-config.py: the plan has no {flag}")
        out[out.index(flag) + 1] = value
    env = [f"{k}={v}" for k, v in {**w["env"], **dict(e.split("=", 1) for e in a.env)}.items()]
    argv = w["argv"]
    assert argv[len(argv) - len(args):] == args, "the worker's argv does not end with its args"
    server = [f"LLAMA_SERVER={argv[len(argv) - len(args) - 1]}"] if a.server else []   # the word before the args
    print(f"{a.name}=" + shlex.join(server + env + out + shlex.split(a.add)))


if __name__ == "__main__":
    main()
