"""orchestrator up: run the plan under Ray behind one OpenAI-compatible gateway."""

from __future__ import annotations

import argparse

HELP = "Start the planned llama-server workers under Ray behind one OpenAI-compatible gateway"
DESCRIPTION = """\
Plan the topology (exactly what `orchestrator plan` prints), then start a Ray head on this machine (or join the
topology's Ray cluster), a controller actor, one worker actor per planned llama-server (pinned with numactl,
under the NUMA-balancing wrapper, restarted on failure) and the gateway. In the foreground (the default) it
prints the gateway and dashboard addresses and stays until Ctrl-C, SIGTERM, SIGHUP or the pipe its output goes
into closing; each stops everything it started (like `orchestrator down`), and a second signal waits for that
stop. Exit status: 0 for a stop that was asked for (Ctrl-C, SIGTERM, `orchestrator down`), 129 after a hang-up,
141 after the output pipe closed, 1 when the Ray head vanished or the stop failed; interrupted while starting,
128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM). With --detach it returns once every worker is
healthy and leaves the deployment running. A second `up` of a namespace that an `up` holds is refused."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topology", help="topology.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a topology key, e.g. --set nodes.0.vram_limit=12GiB (repeatable)")
    p.add_argument("--detach", "-d", action="store_true",
                   help="return once every worker is healthy; stop later with `orchestrator down`")
    p.add_argument("--ready-timeout", type=float, default=None, metavar="SECONDS",
                   help="give up (and stop everything) when not ready after this long "
                        "(default: the topology's restart.startup_timeout)")


def deployment_from(res):
    """The Deployment for a resolved topology (the plan's LaunchSpecs + gateway, Ray and restart settings)."""
    from orchestrator.cluster import Deployment, RestartPolicy
    from orchestrator.cluster.deployment import gateway_processes
    from orchestrator.commands.plan import plan_document

    t = res.topology
    r = t.restart
    restart = RestartPolicy(
        max_restarts=r.max_restarts, backoff_initial_s=max(r.backoff_initial, 0.01),
        backoff_max_s=max(r.backoff_max, r.backoff_initial, 0.01),
        health_timeout_s=r.health_timeout * r.health_failures, load_timeout_s=r.startup_timeout,
        stable_s=r.reset_after, health_interval_s=r.health_interval, probe_timeout_s=r.health_timeout,
        stop_timeout_s=r.stop_timeout,
    )
    metrics_port = t.ray.metrics_export_port
    return Deployment(
        gateway_processes=gateway_processes(t.gateway.processes),
        specs=res.specs, gateway_host=t.gateway.host, gateway_port=t.gateway.port, api_key_env=t.gateway.api_key_env,
        ray_address=t.ray.address, dashboard_host=t.ray.dashboard_host, dashboard_port=t.ray.dashboard_port,
        namespace=t.ray.namespace, restart=restart, plan_json=plan_document(res),
        metrics_export_port=None if metrics_port in (None, "auto") else int(metrics_port),
    )


def run(args: argparse.Namespace) -> int:
    from orchestrator.cluster import state
    from orchestrator.cluster.runner import StopSignals
    from orchestrator.config import load_topology, parse_overrides

    topo = load_topology(args.topology)
    if args.set:
        topo = topo.override(parse_overrides(args.set))
    # one `up` per namespace, from before anything starts; every signal from here on stops cleanly
    with state.NamespaceLock.acquire(topo.ray.namespace), StopSignals() as sigs:
        return _run(args, topo, sigs)


def _run(args: argparse.Namespace, topo, sigs) -> int:
    import secrets
    import sys

    from orchestrator.cluster import LOCAL, up
    from orchestrator.resolve import resolve

    early = None
    prefetch = None
    servers: list = []
    server_key = secrets.token_urlsafe(32)    # every llama-server's own key; the gateway adds it upstream
    try:
        if topo.ray.address == LOCAL:
            # the Ray head takes seconds to start: start it now, while the plan is made (stopped if planning fails)
            from orchestrator.cluster.runner import start_early_head

            metrics_port = topo.ray.metrics_export_port
            early = start_early_head(
                topo.ray.namespace, nodes=[(n.name, n.address) for n in topo.nodes], gateway_host=topo.gateway.host,
                gateway_port=topo.gateway.port, dashboard_host=topo.ray.dashboard_host,
                dashboard_port=topo.ray.dashboard_port,
                metrics_port=None if metrics_port in (None, "auto") else int(metrics_port), log_dir=None)
        res = resolve(topo)
        from orchestrator.commands.pull import download

        download(res.topology.model.path)   # a remote model: into the cache, where the plan's -m points
        dep = deployment_from(res)
        early_start = early is not None and res.topology.workers.early_start
        if res.topology.workers.prefetch and not res.topology.workers.warmup and not early_start:
            from orchestrator.cluster.ray_api import stop_signals_blocked

            with stop_signals_blocked():     # its thread leaves the stop signals to the main thread
                prefetch = start_prefetch(res)
        if res.topology.workers.warmup:
            from orchestrator.launch.warmup import drop_caches, warm

            print(f"warm-up: {drop_caches()}", file=sys.stderr)
            for spec in res.specs:
                if spec.node is None:   # this machine; a remote node warms up through its own `up`
                    secs = warm(res.model.paths, spec.argv)
                    print(f"warm-up: read the model under {spec.name}'s NUMA policy in {secs:.1f}s",
                          file=sys.stderr)
        for w, spec in zip(res.plan.workers, res.specs):
            print(f"worker {w.name}: GPUs {','.join(map(str, w.gpus)) or 'none'}; predicted tg "
                  f"{w.predicted.tg:.1f} t/s", file=sys.stderr)
            print(f"  {spec.shell_line()}", file=sys.stderr)
        if early_start:
            start_early_servers(dep, servers, server_key)
            dep = dep.copy(early={s.spec.name: s.handover() for s in servers})
    except BaseException:
        sigs.absorb()                     # the clean-up runs to its end whatever else arrives
        if prefetch is not None:
            prefetch.stop()
        stop_unadopted(servers, quiet=True)
        if early is not None:
            early.abandon()
        raise
    ok = False
    try:
        result = up(dep, foreground=not args.detach, ready_timeout=args.ready_timeout, early=early,
                    server_key=server_key)
        ok = True
    finally:
        sigs.absorb()
        if prefetch is not None:
            prefetch.stop()
        stop_unadopted(servers, quiet=not ok)
    return result.exit_code


def start_early_servers(dep, servers: list, server_key: str | None = None) -> list:
    """Start every worker's llama-server now, each under a keeper (orchestrator.cluster.keeper), so it loads while
    Ray starts; the worker actors adopt them. A worker whose port is taken is left to its actor (which says so).
    Each is appended to ``servers`` as soon as it runs (so a signal in between leaves none unaccounted for)."""
    import sys

    from orchestrator.cluster.keeper import EarlyServer
    from orchestrator.cluster.runner import _log_dir
    from orchestrator.cluster.supervisor import port_busy
    from orchestrator.cluster.state import run_dir

    logs = _log_dir(dep.log_dir, dep.namespace)
    for spec in dep.specs:
        if spec.node is not None or port_busy(spec.host, spec.port):
            continue
        server = EarlyServer(spec, logs / f"{spec.name}.log", run_dir(dep.namespace), dep.restart.stop_timeout_s,
                             server_key)
        servers.append(server)
        server.start()
        print(f"llama-server {spec.name}: starting now, while Ray starts (workers.early_start)", file=sys.stderr)
    return servers


def stop_unadopted(servers: list, quiet: bool) -> None:
    """After ``up``: stop the early servers no worker actor took over. An adopted one is never stopped here: its
    worker actor owns it (the deployment's stop ends it; a detached deployment keeps it), and its keeper stops it
    by itself when that actor dies."""
    import sys

    for s in servers:
        if s.popen is not None and s.popen.poll() is not None:
            continue                    # its keeper has ended already (the deployment's stop ended it)
        if not s.adopted():
            if not quiet:
                try:
                    print(f"llama-server {s.spec.name}: started early but not adopted by its worker; stopping it",
                          file=sys.stderr)
                except (BrokenPipeError, OSError, ValueError):
                    pass
            s.stop()


def start_prefetch(res):
    """Read the model into the page cache in the background when that helps here (see orchestrator.launch.prefetch);
    prints what it does or why not. Returns the running Prefetch or None."""
    import os
    import sys

    from orchestrator.launch.prefetch import Prefetch, eligible

    local = [(w, spec) for w, spec in zip(res.plan.workers, res.specs) if spec.node is None]
    if not local:
        return None
    machine = res.machines.get(local[0][0].node)
    try:
        size = sum(os.path.getsize(p) for p in res.model.paths)
    except OSError:
        return None
    ok, why = eligible(size, [w.load_mode for w, _ in local], len(machine.numa_nodes) if machine else 1,
                       machine.memory_available_bytes if machine else None)
    print(f"prefetch: {why}", file=sys.stderr)
    return Prefetch(res.model.paths).start() if ok else None
