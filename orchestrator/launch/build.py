"""A planned worker -> :class:`LaunchSpec`: the server argv under its NUMA wrappers, plus env and placement.

The planner renders the llama-server flags (they depend on the backend flavor); this module adds what sits
around them. It reads no hardware and starts nothing; its only I/O is finding the wrapper script's path.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from orchestrator.launch.numa import NumaPolicy, numactl_argv
from orchestrator.launch.spec import LaunchSpec
from orchestrator.launch.wrappers import wrap


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


class PlannedWorker(Protocol):
    """What :func:`spec_for_worker` reads from the planner's ``orchestrator.plan.types.WorkerPlan``."""

    name: str
    node: str
    host: str
    port: int
    args: tuple[str, ...]                 # llama-server's own flags (no binary, no wrappers)
    env: Mapping[str, str]
    numa: object                          # a NumaPlan: mode, cpus, cpu_nodes, mem_nodes
    disable_numa_balancing: bool
    model_alias: str


def spec_for_worker(worker: PlannedWorker, binary: str, *, resources: Mapping[str, float] | None = None,
                    local_node: str | None = None, numactl: str = "numactl") -> LaunchSpec:
    """The :class:`LaunchSpec` of one planned worker: ``binary`` + the plan's flags under its NUMA wrappers.

    ``local_node``: the topology name of the machine the deployment is driven from; a worker planned there gets
    ``node=None`` (run locally), others keep their node name for Ray's placement.
    """
    node = None if worker.node in (None, local_node) else worker.node
    return worker_spec(worker.name, [binary, *worker.args], numa=NumaPolicy.from_plan(worker.numa),
                       disable_numa_balancing=bool(worker.disable_numa_balancing), env=dict(worker.env),
                       host=worker.host, port=int(worker.port), node=node, resources=resources,
                       model_alias=getattr(worker, "model_alias", "model"), numactl=numactl)
