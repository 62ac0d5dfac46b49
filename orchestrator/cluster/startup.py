"""``orchestrator up``, phase by phase: the one place where starting a deployment is put in order.

Each phase registers its undoing on one exit stack before it starts anything, so whatever stops ``up`` (an
error, Ctrl-C, SIGTERM, a hang-up) undoes exactly what had started, newest first (:attr:`Startup.trace`
records both)::

    phase          starts                                             undone by
    lock           one ``up`` per namespace (state.NamespaceLock)     releasing it
    signals        every stop signal from here on stops cleanly       the handlers found before
                   (sigutil.StopSignals, the one owner of them)
    resolve        preflight (a deployment already running, the gateway port, the files the topology names),
                   the plan and its LaunchSpecs, every local worker's port: what can be refused is refused
                   here, before anything starts or is printed
    early head     the embedded Ray head, in the background           stopping it, unless the head phase took it
                   (lifecycle.EarlyHead)
    pull           a remote model into the cache
    prefetch       the model read into the page cache, or warmed      stopping the read
                   up under each worker's NUMA policy
    early servers  llama-servers started now, for the worker          stopping those no worker adopted
                   actors to adopt (keeper.EarlyServer)
    head           the embedded head taken over or started, and       stopping it, removing the record
                   recorded for ``down``
    controller     Ray connected, the controller actor created        the controller stopping its workers and the
                   (it starts the workers and the gateway)            gateway, then killed; Ray let go of
    ready          every worker healthy and the gateway serving;      (nothing of its own)
                   recorded as running
    serve          where it serves said; in the foreground until      the stop: ``down``'s clean stop
                   a signal, a closed output or ``down``

From ``ready`` on the deployment is handed over: a detached one stays running for ``orchestrator down``, a
foreground one is stopped by the stop; the head's and the controller's undoing run only for a failure before.
A Deployment built by hand (:func:`run_deployment`) runs the same phases from ``head`` on.

Exit status: :attr:`lifecycle.UpResult.exit_code` (see ``lifecycle``); a :class:`StopRequested` that arrived while
starting propagates to the CLI, which exits 128 + its signal.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.cluster import head as headmod
from orchestrator.cluster import state as statemod
from orchestrator.cluster.deployment import LOCAL, Deployment, RestartPolicy, StartLimits, gateway_processes
from orchestrator.cluster.lifecycle import say_default
from orchestrator.errors import ClusterError
from orchestrator.sigutil import StopSignals, stop_signals_blocked


def ray_cli() -> str:
    """The ``ray`` command of the Python that runs orchestrator (``.venv/bin/ray`` after the quick start, which
    puts nothing on PATH), else plain ``ray``."""
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    return here if os.access(here, os.X_OK) else "ray"


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
        gateway_cors=t.gateway.cors_origins,
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
    from orchestrator.cluster.lifecycle import check_not_running

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
    """One ``up``: the topology (or a Deployment built by hand), what each phase started, and the exit stack that
    undoes them. ``trace`` lists, in order, each phase as it starts (``start NAME``) and each undoing as it runs
    (``undo NAME``)."""

    topo: Any = None                  # None: ``deployment`` was built by hand (run_deployment)
    deployment: Deployment | None = None
    detach: bool = False
    ready_timeout: float | None = None
    say: Any = say_default
    early: Any = None                 # lifecycle.EarlyHead
    prefetch: Any = None              # launch.prefetch.Prefetch
    servers: list = field(default_factory=list)    # keeper.EarlyServer
    server_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))   # every llama-server's own key
    trace: list = field(default_factory=list)
    gateway_key: str | None = None    # the API key clients give the gateway (gateway.api_key_env)
    sigs: Any = None                  # sigutil.StopSignals
    st: Any = None                    # state.ClusterState: what `down` finds
    head: Any = None                  # head.HeadInfo of the embedded head
    head_s: float | None = None
    t0: float = 0.0
    api: Any = None                   # ray_api.RayApi
    ctrl: Any = None                  # the controller actor
    result: Any = None                # lifecycle.UpResult, once ready
    stopped_elsewhere: bool = False   # a `down` from another shell stopped the deployment while it served
    handed_over: bool = False         # ready: a failure from here on is the stop's, not the phases' undoing

    @property
    def namespace(self) -> str:
        return self.topo.ray.namespace if self.topo is not None else self.deployment.namespace

    def run(self) -> int:
        """Every phase in order; the exit status (see the module docstring)."""
        with contextlib.ExitStack() as stack:
            self._begin("lock")
            lock = statemod.NamespaceLock.acquire(self.namespace)
            self._undo(stack, "lock", lock.release)
            self._begin("signals")
            self.sigs = StopSignals().__enter__()
            self._undo(stack, "signals", lambda: self.sigs.__exit__(None, None, None))
            with stop_signals_blocked():
                # numpy starts its BLAS threads on import; started here they keep the stop signals blocked, so
                # one that comes while the main thread blocks them (around ray.init) waits for it instead of
                # landing in such a thread under Ray's handler, which aborts the process
                import numpy  # noqa: F401
            try:
                if self.topo is not None:
                    self._local_phases(stack)
                else:
                    self._undo(stack, "early head", self._abandon_early_head)
                self._ray_phases(stack)
            except KeyboardInterrupt:
                if self.st is not None and not self.handed_over:
                    self.say("interrupted: stopping everything up started ...")
                raise
            finally:
                self.sigs.absorb()        # the undoing below runs to its end whatever else arrives
        return self.result.exit_code

    # each phase says that it starts, then registers what undoes it before it starts anything
    def _begin(self, name: str) -> None:
        self.trace.append(f"start {name}")

    def _undo(self, stack: contextlib.ExitStack, name: str, undo, *, until_ready: bool = False) -> None:
        """``undo`` runs when the stack unwinds; ``until_ready``: only when a phase before the deployment was ready
        failed (from then on a detached deployment stays, and a foreground one is the stop phase's)."""
        def on_exit(exc_type, _exc, _tb) -> bool:
            if until_ready and (exc_type is None or self.handed_over):
                return False
            self.trace.append(f"undo {name}")
            undo()
            return False

        stack.push(on_exit)

    # --- on this machine, before Ray: resolve, pull, prefetch/warm-up, early servers --------------------------

    def _local_phases(self, stack: contextlib.ExitStack) -> None:
        from orchestrator.resolve import resolve

        self._begin("resolve")
        preflight(self.topo)
        res = resolve(self.topo)
        check_worker_ports(res)
        self._begin("early head")
        self._undo(stack, "early head", self._abandon_early_head)
        self.early = self._start_early_head()
        self._begin("pull")
        pull_model(res.topology.model.path, say=self.say)
        dep = deployment_from(res)
        early_start = self.early is not None and res.topology.workers.early_start
        self._begin("prefetch")
        self._undo(stack, "prefetch", self._stop_prefetch)
        self._read_ahead(res, early_start)
        self._print_plan(res)
        self._begin("early servers")
        self._undo(stack, "early servers", self._stop_unadopted)
        if early_start:
            start_early_servers(dep, self.servers, self.server_key, say=self.say)
            dep = dep.copy(early={s.spec.name: s.handover() for s in self.servers})
        self.deployment = dep

    def _start_early_head(self):
        """The Ray head takes seconds to start: start it now, while the model is pulled, read ahead and loaded."""
        from orchestrator.cluster.lifecycle import start_early_head

        t = self.topo
        if t.ray.address != LOCAL:
            return None
        return start_early_head(
            t.ray.namespace, nodes=[(n.name, n.address) for n in t.nodes], gateway_host=t.gateway.host,
            gateway_port=t.gateway.port, dashboard_host=t.ray.dashboard_host, dashboard_port=t.ray.dashboard_port,
            metrics_port=_port_or_none(t.ray.metrics_export_port), log_dir=None, limits=start_limits(t))

    def _abandon_early_head(self) -> None:
        if self.early is not None and not self.early.taken:
            self.early.abandon()

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
        stop_unadopted(self.servers, quiet=not self.handed_over)

    # --- under Ray: head, controller, ready, serve, stop ---------------------------------------------------------

    def _ray_phases(self, stack: contextlib.ExitStack) -> None:
        self._head(stack)
        self._controller(stack)
        self._ready()
        self._serve(stack)

    def _head(self, stack: contextlib.ExitStack) -> None:
        """The embedded Ray head (the early one taken over, or started now), recorded for `down` as soon as its
        process exists; for a Ray cluster given by address, nothing starts here. Undone: the head stopped, the
        record removed."""
        from orchestrator.cluster.lifecycle import api_key, check_not_running, deployment_log_dir, embedded_node_name

        dep = self.deployment
        self._begin("head")
        early = self.early
        if early is not None and (not dep.embedded or early.namespace != dep.namespace
                                  or embedded_node_name(dep) != "local"):
            early.abandon()      # not the head this deployment needs
            self.early = early = None
        self.gateway_key = api_key(dep)
        check_not_running(dep.namespace, early is not None)
        headmod.check_port(dep.gateway_host, dep.gateway_port, "gateway.port")
        self.t0 = early.t0 if early is not None else time.monotonic()
        self.st = statemod.ClusterState(
            namespace=dep.namespace, ray_address=dep.ray_address, embedded=dep.embedded, up_pid=os.getpid(),
            started_at=time.time(), foreground=not self.detach,
            gateway_url=f"http://{dep.gateway_host}:{dep.gateway_port}",
            workers=[{"name": s.name, "node": s.node, "url": s.url} for s in dep.specs])
        self._undo(stack, "head", self._stop_head, until_ready=True)
        if not dep.embedded:
            return
        if early is not None:
            self.say(f"waiting for the Ray head started in the background (dashboard on {dep.dashboard_host}:"
                     f"{dep.dashboard_port}) ...")
            self.head = early.result()   # interrupted meanwhile: the early head's undoing stops it once it runs
            early.taken = True           # ours now: this phase's undoing stops it
        else:
            self.say(f"starting the Ray head (dashboard on {dep.dashboard_host}:{dep.dashboard_port}) ...")
            self.head = headmod.start_head(
                node_name=embedded_node_name(dep), gcs_port=dep.ray_port, dashboard_host=dep.dashboard_host,
                dashboard_port=dep.dashboard_port, metrics_port=dep.metrics_export_port,
                log_dir=deployment_log_dir(dep.log_dir, dep.namespace), on_spawn=self._record_head,
                timeout=dep.limits.head_s, ray_env=dep.limits.ray_env())
        os.environ.setdefault("RAY_AUTH_MODE", self.head.auth_mode)
        self._record_head(self.head)
        self.head_s = time.monotonic() - self.t0

    def _record_head(self, info: headmod.HeadInfo) -> None:
        """The embedded head in the state file, so `down` finds it even if this process dies while it starts."""
        st = self.st
        st.ray_address, st.head_pid, st.head_started = info.address, info.pid, info.started
        st.head_temp_dir, st.head_log, st.auth_mode = info.temp_dir, info.log_path, info.auth_mode
        st.dashboard_url, st.metrics_url = info.dashboard_url, f"http://127.0.0.1:{info.metrics_port}/metrics"
        statemod.write(st)

    def _stop_head(self) -> None:
        st = self.st
        if st.embedded and st.head_pid:
            headmod.stop_head(st.head_pid, st.head_started, st.head_temp_dir)
        statemod.remove(st.namespace)

    def _controller(self, stack: contextlib.ExitStack) -> None:
        """Connect to Ray and create the named, detached controller actor, which starts the worker actors and the
        gateway. Undone: the controller asked to stop them and killed, then Ray let go of."""
        from orchestrator.cluster.controller import ControllerActor
        from orchestrator.cluster.ray_api import RayApi
        from orchestrator.cluster.lifecycle import CONTROLLER, CONTROLLER_RESTARTS

        dep, ns = self.deployment, self.deployment.namespace
        self._begin("controller")
        self.api = api = RayApi.connect(self.st.ray_address, ns)
        self._undo(stack, "ray connection", api.disconnect)
        if not dep.embedded:
            statemod.write(self.st)
        if api.get_actor(CONTROLLER, ns) is not None:
            raise ClusterError(f"deployment {ns!r} already runs on the Ray cluster at {dep.ray_address} (a "
                               f"controller named {CONTROLLER!r} exists in namespace {ns!r}); run `orchestrator down` "
                               "or pick another namespace")
        self._undo(stack, "controller", self._stop_controller, until_ready=True)   # not one that ran already
        driver_node = api.current_node_id()
        self.say(f"starting {len(dep.specs)} worker(s) and the gateway on {dep.gateway_host}:{dep.gateway_port} ...")
        self.ctrl = api.create_actor(ControllerActor, dep.to_dict(), driver_node, self.gateway_key, self.server_key,
                                     name=CONTROLLER, namespace=ns, detached=True, node_id=driver_node,
                                     max_concurrency=8, max_restarts=CONTROLLER_RESTARTS)

    def _stop_controller(self) -> None:
        from orchestrator.cluster.lifecycle import stop_controller

        dep = self.deployment
        stop_controller(self.api, self.ctrl, dep.namespace, dep.restart.stop_timeout_s)

    def _ready(self) -> None:
        """Until every worker is healthy and the gateway serves (or one fails: then the phases above are undone).
        Recorded as running; from here the deployment is handed over: a detached one stays for `down`, a
        foreground one is stopped by the stop phase. Nothing of its own to undo."""
        from orchestrator.cluster.lifecycle import UpResult, wait_ready

        dep, st = self.deployment, self.st
        self._begin("ready")
        status = wait_ready(self.api, self.ctrl, dep, self.ready_timeout, self.say)
        st.phase = "running"
        st.gateway_url = status["gateway"]["url"]
        statemod.write(st)
        self.handed_over = True
        took = time.monotonic() - self.t0
        self.result = UpResult(dep.namespace, st.gateway_url or "", st.dashboard_url, st.metrics_url,
                               st.ray_address, status, took)

    def _serve(self, stack: contextlib.ExitStack) -> None:
        """Say where it serves and let go of Ray; in the foreground, serve until stopped. Undone in the
        foreground by the stop phase: the clean stop (as `down`), whatever ended the serving."""
        from orchestrator.cluster.lifecycle import breakdown, serve_until_stopped

        st, res, sigs = self.st, self.result, self.sigs
        self._begin("serve")
        if not self.detach:
            self._undo(stack, "stop", self._stop)
        split = breakdown(res.status, self.head_s, time.time() - res.seconds_to_ready)
        try:
            # from "running" on, a signal means the clean stop; it is held until up has let go of Ray (a Ctrl-C
            # that cut ray.shutdown() in half made the stop's ray.init() abort the process)
            with sigs.held():
                self.say(f"ready in {res.seconds_to_ready:.1f}s" + (f" ({split})" if split else "")
                         + f": gateway {st.gateway_url}/v1"
                         + (f", dashboard {st.dashboard_url}" if st.dashboard_url else "")
                         + (f", metrics {st.metrics_url}" if st.metrics_url else ""))
                if st.auth_mode == "token" and st.dashboard_url:
                    self.say(f"the dashboard asks for the Ray token: ~/.ray/auth_token (`{ray_cli()} get-auth-token`)")
                self.api.disconnect()
            if not self.detach:
                res.exit_code, self.stopped_elsewhere = serve_until_stopped(st.namespace, self.say, sigs)
        except KeyboardInterrupt:
            if self.detach:
                raise
            # a signal right after ready: the stop phase stops everything and says why by its exit status

    def _stop(self) -> None:
        from orchestrator.cluster.lifecycle import stop_from_foreground

        res = self.result
        res.stopped = True
        if not self.stopped_elsewhere:
            res.exit_code = stop_from_foreground(self.st.namespace, self.say, self.sigs, res.exit_code, self.st)


def pull_model(model_path: str, *, say=say_default) -> list[str] | None:
    """A remote model's files not yet in the cache, downloaded where the plan's ``-m`` points (None for a
    local model: nothing to do)."""
    from orchestrator.model import remote

    return remote.download_missing(model_path, say)


def start_up(topo, *, detach: bool = False, ready_timeout: float | None = None) -> int:
    """Run ``orchestrator up`` for a loaded topology; returns its exit status (see the module docstring)."""
    return Startup(topo, detach=detach, ready_timeout=ready_timeout).run()


def run_deployment(deployment: Deployment, foreground: bool = True, *, say=say_default,
                   ready_timeout: float | None = None, early=None, server_key: str | None = None):
    """The phases from the Ray head on for a Deployment built by hand (``python -m orchestrator.cluster up``, the
    tests); returns the lifecycle.UpResult. Raises ClusterError/LaunchError/ConfigError with one clear line after
    undoing everything it started. ``early``: the head lifecycle.start_early_head started for it; ``server_key``:
    every llama-server's own API key, which the gateway adds upstream (the early-started servers were given it
    already; a new one when None)."""
    s = Startup(deployment=deployment, detach=not foreground, ready_timeout=ready_timeout, say=say, early=early)
    if server_key:
        s.server_key = server_key
    s.run()
    return s.result


def start_early_servers(dep: Deployment, servers: list, server_key: str | None = None, *, say=say_default) -> list:
    """Start every worker's llama-server now, each under a keeper (orchestrator.cluster.keeper), so it loads while
    Ray starts; the worker actors adopt them. A worker whose port is taken is left to its actor (which says so).
    Each is appended to ``servers`` as soon as it runs (so a signal in between leaves none unaccounted for)."""
    from orchestrator.cluster.keeper import EarlyServer
    from orchestrator.cluster.lifecycle import deployment_log_dir
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


def start_prefetch(res, *, say=say_default):
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
