"""orchestrator bench: the plan and llama.cpp's own choices, measured side by side on this machine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

HELP = "Benchmark the plan against llama.cpp's own placements (--fit, --cpu-moe, sweeps) on this machine"
DESCRIPTION = """\
Starts each configuration's llama-server in turn (R interleaved rounds), measures prompt processing, generation
at several context depths, time to first token, memory, power and temperature through llama-server's HTTP API,
and writes bench.json, bench.txt and PNG charts. The plan comes from topology.yaml (planned exactly as `up`
would, under --vram-budget as vram_limit), --plan-json (the output of `orchestrator plan --json`) or
--config plan='FLAGS'; the alternatives (fit, fit-pinned, cpu-moe, ncmoe-sweep, offload-sweep, cache-grid) are
derived from it; a plan that runs on the CPU only gets CPU alternatives instead (llama.cpp's defaults, threads,
-ub, NUMA policy, one replica over the machine) and no GPU targets. A CPU plan of several replicas on this
machine is measured as the deployment (every replica started and serving at once, the requests spread over them)
against one server over the machine, under the same load (--load-streams requests at once); its `replica` row
is one replica on its own cores, compared with the sweeps that run on the same cores. Every row says what it
runs as (cores, replicas). More configurations: --config NAME='FLAGS' (leading VAR=value words are environment).
Results go to --out DIR, by default a new folder under the state folder (~/.local/state/orchestrator/bench/).
Generation samples (temperature 1, a seed per request, llama-server's default top_k/top_p); with an expert
cache the table shows its hit rate during generation (llama-server's /metrics). Example:

  orchestrator bench topologies/h200.yaml --vram-budget 12GiB --rounds 2 --out bench-12g
"""


def _load_streams(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {n}")
    return n


def _ints(text: str) -> tuple[int, ...]:
    if text.strip() == "none":
        return ()
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer (or 'none')")
    return vals


def _offload_values(text: str) -> tuple[int, ...]:
    from orchestrator.bench.configs import OFFLOAD_NEVER

    out = []
    for x in text.split(","):
        x = x.strip()
        if not x:
            continue
        if x in ("never", "inf"):
            out.append(OFFLOAD_NEVER)
        else:
            try:
                out.append(int(x))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected integers or 'never', got {x!r}") from None
    return tuple(out)


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("topology", nargs="?", help="topology.yaml to plan from (the plan `up` would run; with "
                                                "--vram-budget the plan gets the same budget as vram_limit)")
    src = p.add_argument_group("what to compare")
    src.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a topology key, as in `orchestrator plan --set` (repeatable)")
    src.add_argument("--plan-json", metavar="FILE", help="the plan: output of `orchestrator plan --json`")
    src.add_argument("--worker", type=int, default=0, help="which worker of the plan (default 0)")
    src.add_argument("--config", action="append", default=[], metavar="NAME='FLAGS'",
                     help="a configuration given as llama-server flags (repeatable; the name 'plan' is the plan)")
    src.add_argument("--configs", type=_words, default=None, metavar="LIST",
                     help="derived groups: plan,fit,fit-pinned,cpu-moe,ncmoe-sweep,offload-sweep,cache-grid "
                          "(default: all of them when there is a plan; cache-grid = the plan's expert layers "
                          "+0/4/8/12 in host memory with their VRAM as cache, when the binary has the cache and "
                          "the plan comes from a topology); control = the plan again, an A/A noise check; "
                          "threads-sweep = the plan at other generation threads (-t). A plan on the CPU only "
                          "gets plan,defaults,threads-sweep,ub-sweep,numa-sweep (defaults = llama.cpp's own; "
                          "ub-sweep = other -ub, --ub; numa-sweep = the NUMA policies it did not choose) and, "
                          "from a topology with several replicas, replicas1 (one worker over the machine)")
    src.add_argument("--ncmoe", type=_ints, metavar="N,...", help="--n-cpu-moe values (default: plan ±1)")
    src.add_argument("--ub", type=_ints, metavar="N,...", help="-ub values of the sweep (default: 512 and the plan's)")
    src.add_argument("--load-modes", type=_words, default=("mmap", "pinned"), metavar="LIST",
                     help="load modes of the sweep (mmap, pinned, mlock; default mmap,pinned)")
    src.add_argument("--offload", type=_offload_values, metavar="N,...",
                     help="GGML_OP_OFFLOAD_MIN_BATCH values ('never' = no offload; default: around the plan's)")
    src.add_argument("--threads", type=_ints, metavar="N,...",
                     help="-t values of threads-sweep (default: the plan's T/4, T/2, 3T/4, T-1)")
    src.add_argument("--server", metavar="PATH", help="llama-server (default: the plan's, else $LLAMA_SERVER, PATH, "
                                                      "the build cache)")
    how = p.add_argument_group("how to measure")
    how.add_argument("--vram-budget", metavar="SIZE", help="leave only SIZE free on each GPU (ballast), e.g. 12GiB")
    how.add_argument("--gpus", type=_ints, metavar="I,...", help="GPUs to sample and hold to the budget (default all)")
    how.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    how.add_argument("--order", default="serpentine", choices=("serpentine", "rotate", "fixed"),
                     help="configuration order per round (default serpentine: forward, backward, ...)")
    how.add_argument("--pp", type=_ints, default=(8, 32, 64, 128, 512, 4096), metavar="N,...",
                     help="prompt lengths (default 8,32,64,128,512,4096)")
    how.add_argument("--pp-reps", type=int, default=3, help="requests per prompt length per run, up to 1024 tokens; fewer for longer prompts (default 3)")
    how.add_argument("--tg-depths", type=_ints, default=(0, 4096), metavar="N,...",
                     help="context depths for generation (default 0,4096; none = skip)")
    how.add_argument("--tg-tokens", type=int, default=128, help="tokens generated per depth (default 128)")
    how.add_argument("--tg-reps", type=int, default=2,
                     help="generation runs per depth per start (default 2; identical starts vary, as the A/A "
                          "control of docs/benchmarks.md, \"The whole workload\", shows)")
    how.add_argument("--concurrency", type=_ints, default=(1, 4), metavar="N,...",
                     help="concurrent streamed requests for time to first token (default 1,4; none = skip)")
    how.add_argument("--tg-streams", type=_ints, default=(), metavar="N,...",
                     help="streams generating at once, for aggregate generation (default none; the server needs "
                          "-np of at least N)")
    how.add_argument("--load-streams", type=_load_streams, default=None, metavar="S|auto",
                     help="requests of --load-prompt + --tg-tokens tokens sent at once to every configuration, "
                          "for aggregate and per-request rates under load (default auto: a deployment's slots, "
                          "replicas × parallel; else none; 0 = none)")
    how.add_argument("--load-prompt", type=int, default=512, help="prompt tokens of the load requests (default 512)")
    how.add_argument("--ttft-prompt", type=int, default=128, help="prompt tokens of those requests (default 128)")
    how.add_argument("--ttft-requests", type=int, default=8, help="requests per concurrency level (default 8)")
    how.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests")
    how.add_argument("--no-prime", action="store_true", help="do not read the model file into the page cache first")
    how.add_argument("--load-timeout", type=float, default=900.0, help="seconds for a server to load (default 900)")
    how.add_argument("--max-minutes", type=float, help="start no configuration that would end after this")
    how.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    how.add_argument("--server-verbosity", default="4", metavar="N|none",
                     help="-lv added to every server so its log has llama.cpp's buffer sizes and --fit decisions "
                          "(default 4; none = add nothing)")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="output directory (default: bench-YYYYmmdd-HHMMSS under the state "
                                                  "folder, ~/.local/state/orchestrator/bench)")
    out.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    out.add_argument("--progress", default="auto", choices=("auto", "plain", "none"), help="progress display")
    out.add_argument("--json", action="store_true", help="print the summary and ratios as JSON on stdout")
    out.add_argument("--dry-run", action="store_true", help="print the configurations and exit")


@dataclass(frozen=True)
class BenchSource:
    """What the command line gives to measure: the configurations, the llama-server to run them with, and what
    the plan knew (for bench.json)."""

    configs: tuple
    server: str | None = None
    plan_context: dict | None = None


@dataclass(frozen=True)
class _Plan:
    config: object = None
    server: str | None = None
    context: dict | None = None
    numa_nodes: tuple[int, ...] = ()
    replicas: tuple = ()          # every replica of the plan on this node (a deployment when there are several)


def _source(args: argparse.Namespace) -> BenchSource:
    from orchestrator.bench.configs import (CPU_GROUPS, GPU_ONLY_GROUPS, GROUPS, build_configs, dedupe,
                                            parse_config_option, runs_on_cpu_only)
    from orchestrator.errors import ConfigError

    extra = [parse_config_option(t) for t in args.config]
    given = next((c for c in extra if c.name == "plan"), None)
    if args.topology and (args.plan_json or given is not None):
        raise ConfigError("give the plan one way: a topology, --plan-json or --config plan=...")
    if args.set and not args.topology:
        raise ConfigError("--set changes a topology: give topology.yaml")
    if args.plan_json and given is not None:
        raise ConfigError("--plan-json and --config plan=... both give the plan: pass one")
    p = _plan_from_topology(args) if args.topology else _plan_from_json(args) if args.plan_json else _Plan(given)
    server = args.server or p.server
    others = [c for c in extra if c.name != "plan"]
    plan = p.config
    if plan is None:
        if args.configs:
            raise ConfigError("--configs derives from the plan: give --plan-json or --config plan='FLAGS'")
        if not others:
            raise ConfigError("nothing to benchmark: give --plan-json FILE or --config NAME='llama-server flags'")
        return BenchSource(tuple(others), server, p.context)
    cpu_only = runs_on_cpu_only(plan)
    which = args.configs or (CPU_GROUPS if cpu_only else GROUPS)
    if cpu_only:
        gpu_only = [w for w in which if w in GPU_ONLY_GROUPS]
        if gpu_only:
            raise ConfigError(f"--configs {gpu_only[0]}: compares GPU placements, and the plan runs on the CPU only "
                              f"(CPU alternatives: {', '.join(CPU_GROUPS[1:])})")
    derived = build_configs(plan, which, ncmoe_values=args.ncmoe, ubatches=args.ub, load_modes=args.load_modes,
                            offload_values=args.offload, thread_values=args.threads,
                            layer_expert_bytes=plan.params.get("layer_expert_bytes"), numa_nodes=p.numa_nodes)
    derived += _replica_alternatives(args, p) if cpu_only and not args.configs else []
    if cpu_only and len(p.replicas) > 1 and any(c.name == "plan" for c in derived):
        derived = _as_deployment(derived, p.replicas)
    names = {c.name for c in derived}
    clash = [c.name for c in others if c.name in names]
    if clash:
        raise ConfigError(f"--config {clash[0]}: that name is taken by a derived configuration")
    return BenchSource(tuple(_scoped(dedupe(derived + others))), server, p.context)


def _as_deployment(derived: list, replicas: tuple) -> list:
    """The plan as the deployment it is (every replica on the node, serving at once), followed by its first
    replica alone (``replica``: one replica on its own cores, what the same-core sweeps compare with)."""
    from dataclasses import replace

    out = []
    for c in derived:
        if c.name != "plan":
            out.append(c)
            continue
        n = len(replicas)
        slots = sum(r.parallel or 1 for r in replicas)
        out.append(replace(c, members=tuple(replicas),
                           params={**dict(c.params), "replicas": n, "load_streams": slots}))
        out.append(replace(c, name="replica", group="replica", params={**dict(c.params), "replica_of": n}))
    return out


def _machine_cpus() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _scoped(configs: list) -> list:
    """Every configuration with the cores it computes on and what it runs as, in words (``params``)."""
    from dataclasses import replace

    n = _machine_cpus()

    def scoped(c):
        members = tuple(scoped(m) for m in c.members)
        return replace(c, members=members, params={**dict(c.params), "cores": c.cores(n), "scope": c.scope(n)})

    return [scoped(c) for c in configs]


def _plan_from_json(args: argparse.Namespace) -> _Plan:
    from orchestrator.bench.configs import config_from_plan_json, server_from_plan_json
    from orchestrator.errors import ConfigError

    try:
        with open(args.plan_json) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"--plan-json {args.plan_json}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--plan-json {args.plan_json}: not JSON (line {e.lineno}: {e.msg})") from None
    return _Plan(config_from_plan_json(data, args.worker), server_from_plan_json(data, args.worker))


def _resolve(args: argparse.Namespace, more: dict | None = None):
    """Plan exactly as `orchestrator plan`/`up` do (orchestrator.resolve), under the VRAM budget when one is
    given (every node's vram_limit)."""
    from orchestrator.errors import ConfigError

    try:
        from orchestrator.config import load_topology, parse_overrides
        from orchestrator.resolve import resolve
    except ImportError as e:        # the GPU machine's python3 has no pydantic/gguf unless carried
        raise ConfigError(f"planning from {args.topology} needs the package {e.name or e}, missing here: carry "
                          f"its wheel, or plan elsewhere (`orchestrator plan {args.topology} --json > plan.json`) "
                          f"and pass --plan-json plan.json") from None

    topo = load_topology(args.topology)
    overrides = parse_overrides(args.set) if args.set else {}
    if args.vram_budget:
        for i in range(len(topo.nodes)):
            overrides[f"nodes.{i}.vram_limit"] = args.vram_budget
    return resolve(topo, overrides={**overrides, **(more or {})} or None)


def _plan_from_topology(args: argparse.Namespace) -> _Plan:
    """The worker's LaunchSpec of the topology's plan as the plan configuration."""
    from dataclasses import replace

    from orchestrator.bench.configs import config_from_launch_spec
    from orchestrator.errors import ConfigError
    from orchestrator.plan.costs import model_costs

    res = _resolve(args)
    if not 0 <= args.worker < len(res.specs):
        raise ConfigError(f"{args.topology}: worker {args.worker} does not exist (the plan has {len(res.specs)})")
    spec, worker = res.specs[args.worker], res.plan.workers[args.worker]
    machine = res.machines.get(worker.node)
    context = {
        "topology": str(args.topology), "worker": worker.name, "node": worker.node,
        "decisions": [[d.what, d.value, d.why] for d in worker.decisions],
        "bandwidth": machine.bandwidth.to_json() if machine is not None and machine.bandwidth is not None else None,
        "replicas": sum(1 for w in res.plan.workers if w.node == worker.node),
    }
    plan = config_from_launch_spec(spec, worker)
    n_layers = res.plan.model.get("n_layers")
    if isinstance(n_layers, int):
        plan = replace(plan, params={**dict(plan.params), "n_layers": n_layers})
    costs = model_costs(res.model)
    if costs.moe_layers:
        # the cache grid frees whole expert layers: the largest one's VRAM, as the plan counts it
        plan = replace(plan, params={**dict(plan.params),
                                     "layer_expert_bytes": max(costs.layer_experts[i] for i in costs.moe_layers)})
    nodes = tuple(n.id for n in machine.numa_nodes if n.cpus) if machine is not None else ()
    replicas = tuple(config_from_launch_spec(s, w) for s, w in zip(res.specs, res.plan.workers)
                     if w.node == worker.node)
    return _Plan(plan, res.backend.server, context, nodes, replicas)


def _replica_alternatives(args: argparse.Namespace, p: _Plan) -> list:
    """A CPU plan of several replicas on this machine: one worker over the whole machine instead (what
    ``workers.replicas: 1`` plans), measured as one server beside one of the plan's replicas."""
    from dataclasses import replace

    from orchestrator.bench.configs import config_from_launch_spec

    if not args.topology or not p.context or p.context.get("replicas", 1) < 2:
        return []
    res = _resolve(args, {"workers.replicas": 1})
    one = config_from_launch_spec(res.specs[0], res.plan.workers[0])
    return [replace(one, name="replicas1", group="replicas", params={**dict(one.params), "replicas": 1})]


def default_out_dir() -> str:
    """A new folder under the state folder (never the working directory: a checkout would show it untracked)."""
    from orchestrator.paths import state_dir

    return str(state_dir() / "bench" / time.strftime("bench-%Y%m%d-%H%M%S"))


def run(args: argparse.Namespace) -> int:
    from orchestrator.bench.measure import Workload
    from orchestrator.bench.progress import make_progress
    from orchestrator.bench.report import print_tables
    from orchestrator.bench.session import BenchOptions, describe, run_bench
    from orchestrator.errors import ConfigError
    from orchestrator.units import parse_size

    budget = None
    if args.vram_budget:
        try:
            budget = parse_size(args.vram_budget)
        except ValueError as e:
            raise ConfigError(f"--vram-budget: {e}") from None
    for flag, v in (("--pp-reps", args.pp_reps), ("--tg-tokens", args.tg_tokens), ("--tg-reps", args.tg_reps),
                    ("--ttft-prompt", args.ttft_prompt),
                    ("--ttft-requests", args.ttft_requests)):
        if v < 1:
            raise ConfigError(f"{flag} must be at least 1, got {v}")
    if args.load_prompt < 1:
        raise ConfigError(f"--load-prompt must be at least 1, got {args.load_prompt}")
    src = _source(args)
    load = args.load_streams
    if load is None:                     # auto: the deployment's slots, the load it is planned to serve
        load = max((int(c.params.get("load_streams") or 0) for c in src.configs), default=0)
    workload = Workload(pp=args.pp, pp_reps=args.pp_reps, tg_depths=args.tg_depths, tg_tokens=args.tg_tokens,
                        tg_reps=args.tg_reps, concurrency=args.concurrency, tg_streams=args.tg_streams,
                        ttft_prompt=args.ttft_prompt, load_streams=load, load_prompt=args.load_prompt,
                        ttft_requests=args.ttft_requests, warmup=not args.no_warmup)
    if args.server_verbosity == "none":
        verbosity = None
    elif args.server_verbosity.isdigit():
        verbosity = int(args.server_verbosity)
    else:
        raise ConfigError(f"--server-verbosity: expected a number or 'none', got {args.server_verbosity!r}")
    options = BenchOptions(log_verbosity=verbosity, rounds=args.rounds, workload=workload, order=args.order,
                           load_timeout=args.load_timeout, prime_page_cache=not args.no_prime, seed=args.seed,
                           vram_budget=budget, max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                           gpus=args.gpus)
    configs = list(src.configs)
    if src.server:
        server = src.server
    else:
        from orchestrator.backend.detect import find_llama_server

        server, _origin = find_llama_server(None)
    if args.dry_run:
        print(describe(configs, server, options))
        return 0
    out = args.out or default_out_dir()

    from orchestrator.sigutil import terminate_as_interrupt

    with terminate_as_interrupt():     # SIGTERM, a hang-up: stop the server, keep the results so far
        data = run_bench(configs, server, out, options, progress=make_progress(args.progress),
                         charts=not args.no_charts, plan_context=src.plan_context)
    if args.json:
        json.dump({"out": str(out), "files": data.get("files"), "summary": data["summary"],
                   "ratios": data["ratios"], "stopped_early": data.get("stopped_early")}, sys.stdout, indent=1)
        print()
    else:
        print_tables(data)
        print(f"\nwritten: {out}/bench.json, {out}/bench.txt"
              + "".join(f", {out}/{c}" for c in (data.get("files") or {}).get("charts", [])))
    return 0
