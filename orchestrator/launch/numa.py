"""NUMA policy of one worker: the one type the planner decides, launch renders and ``status`` shows. Pure.

:func:`orchestrator.launch.llama_args.numactl_argv` renders it (numactl's vocabulary lives there). CPU and node
numbers are the kernel's (OS) indexes, as sysfs and numactl use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from orchestrator.units import format_cpulist, parse_cpulist  # noqa: F401  (re-exported: the kernel's list format)

NumaMode = Literal["bind", "interleave", "none"]
MODES: tuple[str, ...] = ("bind", "interleave", "none")


def _ints(name: str, values: Iterable[int]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"NumaPolicy.{name} must be a sequence of ints, not a string (use parse_cpulist)")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"NumaPolicy.{name} holds {v!r}; expected ints")
        if v < 0:
            raise ValueError(f"NumaPolicy.{name} holds {v}; CPU and node numbers are >= 0")
        out.append(v)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class NumaPolicy:
    """Where one worker's threads run and where its memory comes from.

    * ``bind``: threads on ``cpus`` (``--physcpubind``) or, when ``cpus`` is empty, on ``cpu_nodes``
      (``--cpunodebind``); memory only from ``mem_nodes`` (``--membind``).
    * ``interleave``: memory spread page by page over ``mem_nodes`` (``--interleave``); threads limited as for
      bind when ``cpus``/``cpu_nodes`` are given, free otherwise.
    * ``none``: no numactl at all; ``cpus`` may still list the CPUs the worker's threads are counted on
      (nothing binds them).

    The tuples are stored sorted and without duplicates, so two equal policies compare equal.
    """

    mode: NumaMode = "none"
    cpus: tuple[int, ...] = ()
    cpu_nodes: tuple[int, ...] = ()
    mem_nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"NumaPolicy.mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name in ("cpus", "cpu_nodes", "mem_nodes"):
            object.__setattr__(self, name, _ints(name, getattr(self, name)))
        if self.mode == "none":
            if self.cpu_nodes or self.mem_nodes:
                raise ValueError("NumaPolicy(mode='none') takes no cpu_nodes or mem_nodes")
        elif self.mode == "bind":
            if not self.mem_nodes:
                raise ValueError("NumaPolicy(mode='bind') needs mem_nodes (the nodes its memory comes from)")
            if not (self.cpus or self.cpu_nodes):
                raise ValueError("NumaPolicy(mode='bind') needs cpus or cpu_nodes (where its threads run)")
        elif not self.mem_nodes:
            raise ValueError("NumaPolicy(mode='interleave') needs mem_nodes (the nodes to spread memory over)")

    # -- constructors the planner reads well --------------------------------------------------------------

    @classmethod
    def none(cls, cpus: Iterable[int] = ()) -> "NumaPolicy":
        return cls("none", tuple(cpus))

    @classmethod
    def bind(cls, mem_nodes: Iterable[int], *, cpus: Iterable[int] = (), cpu_nodes: Iterable[int] = ()) -> "NumaPolicy":
        return cls("bind", tuple(cpus), tuple(cpu_nodes), tuple(mem_nodes))

    @classmethod
    def interleave(cls, mem_nodes: Iterable[int], *, cpus: Iterable[int] = (),
                   cpu_nodes: Iterable[int] = ()) -> "NumaPolicy":
        return cls("interleave", tuple(cpus), tuple(cpu_nodes), tuple(mem_nodes))

    # -- views ---------------------------------------------------------------------------------------------

    @property
    def n_cpus(self) -> int | None:
        """Number of CPUs the threads are limited to, when given as CPUs (None when by node or free)."""
        return len(self.cpus) if self.cpus and self.mode != "none" else None

    def describe(self) -> str:
        """One short line for plan tables: ``bind cpus 0-15 mem 0-1``."""
        if self.mode == "none":
            return "none"
        parts = [self.mode]
        if self.cpus:
            parts.append(f"cpus {format_cpulist(self.cpus)}")
        elif self.cpu_nodes:
            parts.append(f"cpu nodes {format_cpulist(self.cpu_nodes)}")
        parts.append(f"mem {format_cpulist(self.mem_nodes)}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "cpus": list(self.cpus), "cpu_nodes": list(self.cpu_nodes),
                "mem_nodes": list(self.mem_nodes)}

    @classmethod
    def from_dict(cls, d: dict) -> "NumaPolicy":
        return cls(d.get("mode", "none"), tuple(d.get("cpus", ())), tuple(d.get("cpu_nodes", ())),
                   tuple(d.get("mem_nodes", ())))
