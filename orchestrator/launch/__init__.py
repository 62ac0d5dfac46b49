"""Turn a plan into processes: argv + env for one worker (numactl wrapper, NUMA-balancing wrapper, llama-server).

:class:`LaunchSpec` is the one description of a process that ``plan`` prints and ``up``/``bench`` run.
"""

from orchestrator.launch.spec import LaunchSpec

__all__ = ["LaunchSpec"]
