"""``orchestrator up``, phase by phase: the one place where starting a deployment is put in order.

Each phase that leaves something running registers its undoing on one exit stack as it starts, so whatever
stops ``up`` (an error, Ctrl-C, SIGTERM, a hang-up) undoes exactly what had started, newest first::

    lock         one ``up`` per namespace (state.NamespaceLock)
    signals      every stop signal from here on stops cleanly (sigutil.StopSignals)
    preflight    a deployment already running, the gateway port, the files the topology names
    resolve      the plan and its LaunchSpecs (orchestrator.resolve), then every local worker's port: what
                 can be refused is refused here, before anything starts or is printed
    early head   the embedded Ray head starts in the background (runner.EarlyHead) while the phases below run
    pull         a remote model into the cache
    prefetch     the model read into the page cache, or warmed up under each worker's NUMA policy
    early        llama-servers started now, adopted later by their worker actors (keeper.EarlyServer)
    controller, ready, serve, stop: runner.up (the controller actor, its workers and the gateway)

Exit status: :attr:`runner.UpResult.exit_code` (see ``runner``); a :class:`StopRequested` that arrived while
starting propagates to the CLI, which exits 128 + its signal.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any

from orchestrator.cluster import head as headmod
from orchestrator.cluster import state as statemod
from orchestrator.cluster.deployment import LOCAL, Deployment, RestartPolicy, StartLimits, gateway_processes
from orchestrator.errors import ClusterError
from orchestrator.sigutil import StopSignals, stop_signals_blocked


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def deployment_from(res) -> Deployment:
    """The Deployment for a resolved topology (the plan's LaunchSpecs + gateway, Ray and restart settings)."""
    from orchestrator.plan.document import PlanDocument

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
        namespace=t.ray.namespace, restart=restart, plan_json=PlanDocument.from_resolved(res).to_dict(),
        metrics_export_port=_port_or_none(metrics_port), limits=start_limits(t),
    )


def _port_or_none(port: Any) -> int | None:
    return None if port in (None, "auto") else int(port)


def start_limits(topo) -> StartLimits:
    """``ray.start_timeout`` for this machine: auto scales with its load now."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 0.0
    return StartLimits.from_start_timeout(topo.ray.start_timeout, load)


# --- preflight: refused before anything starts -------------------------------------------------------------------

def preflight(topo) -> None:
    """What can be refused from the topology alone, before the plan is made: a deployment of this namespace
    running already, the gateway's port taken, a file the topology names (the model, a recorded machine, the
    binary) missing."""
    from orchestrator.cluster.runner import check_not_running

    check_not_running(topo.ray.namespace)
    headmod.check_port(topo.gateway.host, topo.gateway.port, "gateway.port")
    topo.check_files()


def check_worker_ports(res) -> None:
    """Every local worker's port free (the process holding one named), before any worker or server starts."""
    from orchestrator.cluster.supervisor import port_busy

    for spec in res.specs:
        if spec.node is None:
            busy = port_busy(spec.host, spec.port)
            if busy:
                raise ClusterError(f"workers.port_base: worker {spec.name} cannot listen: {busy}; stop it or "
                                   "choose another workers.port_base")


# --- the phases ----------------------------------------------------------------------------------------------------

@dataclass
class Startup:
    """One ``up``: the topology, what each phase started, and the exit stack that undoes them."""

    topo: Any
    detach: bool = False
    ready_timeout: float | None = None
    say: Any = _say
    early: Any = None                 # runner.EarlyHead
    prefetch: Any = None              # launch.prefetch.Prefetch
    servers: list = field(default_factory=list)    # keeper.EarlyServer
    server_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))   # every llama-server's own key
    up_started: bool = False          # runner.up owns the early head from then on
    ok: bool = False                  # runner.up returned

    def run(self) -> int:
        with contextlib.ExitStack() as stack:
            stack.enter_context(statemod.NamespaceLock.acquire(self.topo.ray.namespace))
            sigs = stack.enter_context(StopSignals())
            with stop_signals_blocked():
                # numpy starts its BLAS threads on import; started here they keep the stop signals blocked, so
                # one that comes while the main thread blocks them (around ray.init) waits for it instead of
                # landing in such a thread under Ray's handler, which aborts the process
                import numpy  # noqa: F401
            try:
                return self._phases(stack)
            finally:
                sigs.absorb()             # the undoing below runs to its end whatever else arrives

    def _phases(self, stack: contextlib.ExitStack) -> int:
        from orchestrator.resolve import resolve

        preflight(self.topo)
        res = resolve(self.topo)
        check_worker_ports(res)
        stack.callback(self._abandon_early_head)
        self.early = self._start_early_head()
        self._pull(res)
        dep = deployment_from(res)
        early_start = self.early is not None and res.topology.workers.early_start
        stack.callback(self._stop_prefetch)
        self._read_ahead(res, early_start)
        self._print_plan(res)
        stack.callback(self._stop_unadopted)
        if early_start:
            start_early_servers(dep, self.servers, self.server_key, say=self.say)
            dep = dep.copy(early={s.spec.name: s.handover() for s in self.servers})
        return self._serve(dep)

    def _start_early_head(self):
        """The Ray head takes seconds to start: start it now, while the model is pulled, read ahead and loaded."""
        from orchestrator.cluster.runner import start_early_head

        t = self.topo
        if t.ray.address != LOCAL:
            return None
        return start_early_head(
            t.ray.namespace, nodes=[(n.name, n.address) for n in t.nodes], gateway_host=t.gateway.host,
            gateway_port=t.gateway.port, dashboard_host=t.ray.dashboard_host, dashboard_port=t.ray.dashboard_port,
            metrics_port=_port_or_none(t.ray.metrics_export_port), log_dir=None, limits=start_limits(t))

    def _abandon_early_head(self) -> None:
        if self.early is not None and not self.up_started:
            self.early.abandon()

    def _pull(self, res) -> None:
        pull_model(res.topology.model.path, say=self.say)

    def _read_ahead(self, res, early_start: bool) -> None:
        w = res.topology.workers
        if w.prefetch and not w.warmup and not early_start:
            with stop_signals_blocked():     # its thread leaves the stop signals to the main thread
                self.prefetch = start_prefetch(res, say=self.say)
        if w.warmup:
            from orchestrator.launch.warmup import drop_caches, warm

            self.say(f"warm-up: {drop_caches()}")
            for spec in res.specs:
                if spec.node is None:   # this machine; a remote node warms up through its own `up`
                    secs = warm(res.model.paths, spec.argv)
                    self.say(f"warm-up: read the model under {spec.name}'s NUMA policy in {secs:.1f}s")

    def _stop_prefetch(self) -> None:
        if self.prefetch is not None:
            self.prefetch.stop()

    def _print_plan(self, res) -> None:
        for note in res.notes:
            if "not measured" in note:     # the speeds below rest on an assumption: say which
                self.say(f"note: {note}")
        for w, spec in zip(res.plan.workers, res.specs):
            self.say(f"worker {w.name}: GPUs {','.join(map(str, w.gpus)) or 'none'}; predicted "
                     f"{w.predicted.summary()}")
            self.say(f"  {spec.shell_line()}")

    def _stop_unadopted(self) -> None:
        stop_unadopted(self.servers, quiet=not self.ok)

    def _serve(self, dep: Deployment) -> int:
        from orchestrator.cluster.runner import up

        self.up_started = True
        result = up(dep, foreground=not self.detach, ready_timeout=self.ready_timeout, early=self.early,
                    server_key=self.server_key)
        self.ok = True
        return result.exit_code


def pull_model(model_path: str, *, say=_say) -> list[str] | None:
    """A remote model's files not yet in the cache, downloaded where the plan's ``-m`` points (None for a
    local model: nothing to do)."""
    from orchestrator.model import remote

    return remote.download_missing(model_path, say)


def start_up(topo, *, detach: bool = False, ready_timeout: float | None = None) -> int:
    """Run ``orchestrator up`` for a loaded topology; returns its exit status (see the module docstring)."""
    return Startup(topo, detach=detach, ready_timeout=ready_timeout).run()


def start_early_servers(dep: Deployment, servers: list, server_key: str | None = None, *, say=_say) -> list:
    """Start every worker's llama-server now, each under a keeper (orchestrator.cluster.keeper), so it loads while
    Ray starts; the worker actors adopt them. A worker whose port is taken is left to its actor (which says so).
    Each is appended to ``servers`` as soon as it runs (so a signal in between leaves none unaccounted for)."""
    from orchestrator.cluster.keeper import EarlyServer
    from orchestrator.cluster.runner import deployment_log_dir
    from orchestrator.cluster.supervisor import port_busy

    logs = deployment_log_dir(dep.log_dir, dep.namespace)
    for spec in dep.specs:
        if spec.node is not None or port_busy(spec.host, spec.port):
            continue
        server = EarlyServer(spec, logs / f"{spec.name}.log", statemod.run_dir(dep.namespace),
                             dep.restart.stop_timeout_s, server_key)
        servers.append(server)
        server.start()
        say(f"llama-server {spec.name}: starting now, while Ray starts (workers.early_start)")
    return servers


def stop_unadopted(servers: list, quiet: bool) -> None:
    """After ``up``: stop the early servers no worker actor took over. An adopted one is never stopped here: its
    worker actor owns it (the deployment's stop ends it; a detached deployment keeps it), and its keeper stops it
    by itself when that actor dies."""
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


def start_prefetch(res, *, say=_say):
    """Read the model into the page cache in the background when that helps here (see orchestrator.launch.prefetch);
    says what it does or why not. Returns the running Prefetch or None."""
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
    say(f"prefetch: {why}")
    return Prefetch(res.model.paths).start() if ok else None
