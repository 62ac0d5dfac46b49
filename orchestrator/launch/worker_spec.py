"""A planned worker's settings -> :class:`LaunchSpec`: the server argv under its NUMA wrappers, plus env.

:mod:`~orchestrator.launch.llama_args` renders the llama-server flags (they depend on the backend flavor); this
module adds what sits around them. It reads no hardware and starts nothing; its only I/O is finding the wrapper
script's path.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from orchestrator.backend.info import BackendInfo
from orchestrator.backend.server_options import option
from orchestrator.launch.llama_args import numactl_argv, server_args, server_env
from orchestrator.launch.numa import NumaPolicy
from orchestrator.launch.settings import WorkerSettings
from orchestrator.launch.spec import LaunchSpec
from orchestrator.launch.wrappers import wrap

# workers.live_routing: on -- the generated tokens whose router picks each llama-server keeps (--router-trace);
# orchestrator/cluster/live_routing.py says why this many
ROUTER_TRACE_TOKENS = 2048


def worker_spec(name: str, server_argv: Sequence[str], *, numa: NumaPolicy | None = None,
                disable_numa_balancing: bool = False, env: Mapping[str, str] | None = None,
                host: str = "127.0.0.1", port: int = 8081, node: str | None = None,
                resources: Mapping[str, float] | None = None, model_alias: str = "model",
                numactl: str = "numactl") -> LaunchSpec:
    """One worker's :class:`LaunchSpec`.

    ``server_argv`` is llama-server and its flags (``--host``/``--port`` included: the caller keeps them equal
    to ``host``/``port``; this is checked). ``numa`` adds a numactl prefix, ``disable_numa_balancing`` the
    balancing wrapper in front of it. ``env`` values must be strings (``{"CUDA_VISIBLE_DEVICES": "0,1"}``).
    """
    if not name:
        raise ValueError("worker_spec() needs a worker name")
    server_argv = [str(a) for a in server_argv]
    if not server_argv:
        raise ValueError(f"worker {name}: empty llama-server argv")
    _check_flag(name, server_argv, ("--port",), str(port))
    _check_flag(name, server_argv, ("--host",), host)
    env = dict(env or {})
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"worker {name}: env {k!r}={v!r}: names and values must be strings")
    policy = numa or NumaPolicy.none()
    argv = wrap(server_argv, disable_numa_balancing=disable_numa_balancing,
                numactl=numactl_argv(policy, numactl))
    return LaunchSpec(name=name, argv=argv, env=env, host=host, port=int(port), node=node,
                      resources=dict(resources or {}), model_alias=model_alias)


def _check_flag(name: str, argv: list[str], flags: tuple[str, ...], expected: str) -> None:
    """When ``argv`` sets one of ``flags``, its value must be ``expected`` (the spec's host/port)."""
    for i, a in enumerate(argv):
        for f in flags:
            if a == f and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(f + "="):
                value = a.split("=", 1)[1]
            else:
                continue
            if value != expected:
                raise ValueError(f"worker {name}: llama-server argv has {f} {value} but the spec says {expected}")


def spec_for_worker(name: str, settings: WorkerSettings, backend: BackendInfo, *, node: str | None = None,
                    local_node: str | None = None, resources: Mapping[str, float] | None = None,
                    numactl: str = "numactl", router_trace: int = 0) -> LaunchSpec:
    """The :class:`LaunchSpec` of one planned worker: ``backend``'s binary with ``settings`` rendered, under its
    NUMA wrappers; the settings travel with the spec (``status`` shows them).

    ``node``: the topology name of the machine the worker was planned on; ``local_node``: the one the deployment
    is driven from. A worker planned there gets ``node=None`` (run locally), others keep their node name for
    Ray's placement. ``router_trace``: tokens of router picks the server keeps (``--router-trace``, when it has
    the option), for the live routing profile.
    """
    where = None if node in (None, local_node) else node
    argv = [backend.server, *server_args(settings, backend)]
    if router_trace > 0 and backend.has("router_trace"):
        argv += [option("--router-trace").flag, str(router_trace)]
    spec = worker_spec(name, argv, numa=settings.numa,
                       disable_numa_balancing=settings.disable_numa_balancing, env=server_env(settings, backend),
                       host=settings.host or "127.0.0.1", port=settings.port or 8081, node=where, resources=resources,
                       model_alias=settings.alias or "model", numactl=numactl)
    return replace(spec, settings=settings)
