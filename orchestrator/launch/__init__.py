"""Turn a plan into processes: argv + env for one worker (numactl wrapper, NUMA-balancing wrapper, llama-server).

:class:`LaunchSpec` is the one description of a process that ``plan`` prints and ``up``/``bench`` run.

* :mod:`~orchestrator.launch.settings` — :class:`WorkerSettings`, what the planner decides per worker; pure.
* :mod:`~orchestrator.launch.numa` — :class:`NumaPolicy`, the one NUMA type; pure.
* :mod:`~orchestrator.launch.llama_args` — the one vocabulary of llama-server and numactl: settings -> argv/env
  (:func:`server_args`, :func:`server_env`, :func:`numactl_argv`) and a user's flags -> settings; pure.
* :mod:`~orchestrator.launch.wrappers` — :func:`wrap` puts an argv under ``scripts/numa/`` wrappers.
* :mod:`~orchestrator.launch.worker_spec` — :func:`spec_for_worker` (planned settings -> :class:`LaunchSpec`)
  and :func:`worker_spec` (the same from plain values).
* :mod:`~orchestrator.launch.process` — :func:`start` / :func:`launch` a spec as a real process group, wait for
  ``/health``, stop it; failures are :class:`~orchestrator.errors.LaunchError` with llama-server's own reason.
  (Import it explicitly; it is not re-exported here so that pure users stay free of subprocess.)
"""

from orchestrator.launch.worker_spec import spec_for_worker, worker_spec
from orchestrator.launch.llama_args import numactl_argv
from orchestrator.launch.numa import NumaPolicy, format_cpulist, parse_cpulist
from orchestrator.launch.settings import WorkerSettings
from orchestrator.launch.spec import LaunchSpec
from orchestrator.launch.wrappers import wrap

__all__ = ["LaunchSpec", "NumaPolicy", "WorkerSettings", "format_cpulist", "numactl_argv", "parse_cpulist",
           "spec_for_worker", "worker_spec", "wrap"]
