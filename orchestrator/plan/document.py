"""The plan document: what ``orchestrator plan --json`` prints, ``up`` hands to its controller (``status``
shows it) and ``bench --plan-json`` reads back, as one typed, versioned value.

:meth:`PlanDocument.from_plan` builds it from the planner's :class:`Plan` and the LaunchSpecs rendered from it;
:meth:`PlanDocument.to_dict` is the JSON; :meth:`PlanDocument.from_dict` reads that JSON back, checking it, with
one error line naming the field. Its JSON schema (:func:`json_schema`) is written to
``docs/plan-document.schema.json``; a test checks the file is current and that real plans validate against it.

Version 1 is the first versioned shape; a document without ``version`` (written before it existed) has the same
fields and reads as version 1. A worker's ``settings`` name the expert cache's fields ``expert_cache_*``; a document
that names them as the flags do (``moe_cache_mib``, ``moe_cache_prefill_ahead`` ..., the boolean
``moe_cache_device_slots``) reads the same (:meth:`~orchestrator.launch.settings.WorkerSettings.from_dict`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from orchestrator.backend.info import BackendInfo
from orchestrator.errors import ConfigError
from orchestrator.launch.settings import WorkerSettings
from orchestrator.launch.spec import LaunchSpec
from orchestrator.plan.types import Decision, Plan

VERSION = 1
SERVER_NAME = "llama-server"     # the binary's name prefix (llama-server, llama-server-cuda ...)


def _fail(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what} (expected the output of `orchestrator plan --json`)")


@dataclass(frozen=True)
class WorkerEntry:
    """One worker of the document: where it runs, exactly what it runs, what the plan predicts for it.
    ``details``: the worker's whole JSON (placement, memory, expert cache ...), kept as written."""

    name: str
    node: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    gpus: tuple[int, ...] = ()
    args: tuple[str, ...] = ()              # llama-server's own flags
    argv: tuple[str, ...] = ()              # the whole command: wrappers, the binary, args
    env: Mapping[str, str] = field(default_factory=dict)
    settings: WorkerSettings | None = None
    decisions: tuple[Decision, ...] = ()
    predicted_tg: float | None = None
    predicted_pp: Mapping[int, float] = field(default_factory=dict)
    devices: Mapping[str, int] = field(default_factory=dict)     # device ("CUDA0", "CPU") -> predicted bytes
    cpu_expert_layers: tuple[int, ...] | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def server_index(self) -> int | None:
        """Where the llama-server binary stands in ``argv``: before ``args`` when both are given, else the
        first word named llama-server."""
        if self.args and len(self.argv) > len(self.args) and self.argv[-len(self.args):] == self.args:
            return len(self.argv) - len(self.args) - 1
        if self.args and self.argv == ():
            return None
        return next((i for i, a in enumerate(self.argv) if os.path.basename(a).startswith(SERVER_NAME)), None)

    @property
    def server(self) -> str | None:
        i = self.server_index
        return self.argv[i] if i is not None else None

    @property
    def wrapper(self) -> tuple[str, ...]:
        """The words before the binary (numactl, the NUMA-balancing wrapper)."""
        i = self.server_index
        return self.argv[:i] if i is not None else ()

    @property
    def server_args(self) -> tuple[str, ...]:
        if self.args:
            return self.args
        i = self.server_index
        return self.argv[i + 1:] if i is not None else ()

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "WorkerEntry":
        if not isinstance(d, Mapping):
            raise _fail(where, f"a JSON {type(d).__name__}, not an object")
        args, argv = _strings(d, "args", where), _strings(d, "argv", where)
        if not args and not argv:
            raise _fail(where, "has neither 'args' nor 'argv'")
        env = d.get("env") or {}
        if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
            raise _fail(f"{where}.env", "not an object of strings")
        settings = None
        if d.get("settings"):
            try:
                settings = WorkerSettings.from_dict(d["settings"])
            except (TypeError, ValueError) as e:
                raise _fail(f"{where}.settings", str(e).splitlines()[0]) from None
        p = d.get("predicted") or {}
        try:
            pp = {int(k): float(v) for k, v in (p.get("pp") or {}).items()}
            tg = float(p["tg"]) if p.get("tg") else None
            devices = {str(k): int(v) for k, v in (d.get("devices") or {
                m["device"]: m["total"] for m in d.get("memory") or () if "device" in m}).items()}
            gpus = tuple(int(g) for g in d.get("gpus") or ())
            cel = d.get("cpu_expert_layers")
            cel = tuple(int(i) for i in cel) if cel is not None else None
            port = int(d.get("port") or 0)
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            raise _fail(where, f"a predicted, devices, gpus, port or cpu_expert_layers value is malformed ({e})"
                        ) from None
        decisions = tuple(Decision(str(x.get("what", "")), str(x.get("value", "")), str(x.get("why", "")))
                          for x in d.get("decisions") or () if isinstance(x, Mapping))
        entry = cls(name=str(d.get("name") or ""), node=str(d.get("node") or ""),
                    host=str(d.get("host") or "127.0.0.1"), port=port, gpus=gpus, args=args, argv=argv,
                    env=dict(env), settings=settings, decisions=decisions, predicted_tg=tg, predicted_pp=pp,
                    devices=devices, cpu_expert_layers=cel, details=dict(d))
        if not args and entry.server_index is None:
            raise _fail(f"{where}.argv", f"has no {SERVER_NAME} binary in it")
        return entry

    def to_dict(self) -> dict:
        """The worker's JSON as it was built or read, with its exact command (argv, env) and a display line."""
        d = dict(self.details)
        d["argv"] = list(self.argv)
        d["env"] = dict(self.env)
        d["command"] = LaunchSpec(self.name, self.argv, self.env).shell_line() if self.argv else ""
        return d


def _strings(d: Mapping, key: str, where: str) -> tuple[str, ...]:
    v = d.get(key) or ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(a, str) for a in v):
        raise _fail(f"{where}.{key}", "not a list of strings")
    return tuple(v)


@dataclass(frozen=True)
class PlanDocument:
    """The whole plan as a document (see the module docstring)."""

    workers: tuple[WorkerEntry, ...]
    model: Mapping[str, Any] = field(default_factory=dict)
    backend: BackendInfo | None = None
    decisions: tuple[Decision, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    version: int = VERSION

    @classmethod
    def from_plan(cls, plan: Plan, specs: Sequence[LaunchSpec], backend: BackendInfo,
                  notes: Sequence[str] = ()) -> "PlanDocument":
        """The document of a plan and the LaunchSpecs rendered from it (one per worker, in order)."""
        workers = []
        for i, (w, spec) in enumerate(zip(plan.workers, specs)):
            d = {**w.to_dict(), "argv": list(spec.argv), "env": dict(spec.env)}
            entry = WorkerEntry.from_dict(d, f"workers[{i}]")
            workers.append(entry)
        return cls(workers=tuple(workers), model=dict(plan.model), backend=backend, decisions=plan.decisions,
                   warnings=plan.warnings, notes=tuple(notes))

    @classmethod
    def from_resolved(cls, res) -> "PlanDocument":
        """The document of an ``orchestrator.resolve.Resolved`` (its plan, specs, backend and notes)."""
        return cls.from_plan(res.plan, res.specs, res.backend, res.notes)

    def to_dict(self) -> dict:
        # the plan's own key order first (model, decisions, warnings, workers), as `plan --json` always printed
        return {"version": self.version, "model": dict(self.model),
                "decisions": [d.to_dict() for d in self.decisions], "warnings": list(self.warnings),
                "workers": [w.to_dict() for w in self.workers],
                **({"backend": self.backend.to_dict()} if self.backend is not None else {}),
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan JSON") -> "PlanDocument":
        """Read a document back; ConfigError naming ``source`` and the field when it is not one."""
        if not isinstance(data, Mapping):
            raise _fail(source, f"a JSON {type(data).__name__}, not an object")
        version = data.get("version", VERSION)
        if not isinstance(version, int) or version < 1:
            raise _fail(f"{source}: version", f"{version!r} is not a document version")
        if version > VERSION:
            raise ConfigError(f"{source}: version {version} is newer than this orchestrator reads ({VERSION}); "
                              "plan again with this version or upgrade")
        workers = data.get("workers")
        if not isinstance(workers, list) or not workers:
            raise _fail(source, "expected a non-empty 'workers' list")
        backend = None
        if data.get("backend"):
            try:
                backend = BackendInfo.from_dict(data["backend"])
            except (KeyError, TypeError, ValueError) as e:
                raise _fail(f"{source}: backend", f"malformed ({e})") from None
        model = data.get("model") or {}
        if not isinstance(model, Mapping):
            raise _fail(f"{source}: model", "not an object")
        decisions = tuple(Decision(str(x.get("what", "")), str(x.get("value", "")), str(x.get("why", "")))
                          for x in data.get("decisions") or () if isinstance(x, Mapping))
        return cls(workers=tuple(WorkerEntry.from_dict(w, f"{source}: workers[{i}]") for i, w in enumerate(workers)),
                   model=dict(model), backend=backend, decisions=decisions,
                   warnings=tuple(str(w) for w in data.get("warnings") or ()),
                   notes=tuple(str(n) for n in data.get("notes") or ()), version=version)

    def worker(self, index: int, source: str = "plan JSON") -> WorkerEntry:
        if not 0 <= index < len(self.workers):
            raise ConfigError(f"{source}: worker {index} does not exist (it has {len(self.workers)})")
        return self.workers[index]

    @property
    def n_layers(self) -> int | None:
        n = self.model.get("n_layers")
        return n if isinstance(n, int) and n > 0 else None


def json_schema() -> dict:
    """The JSON schema of version :data:`VERSION` (written to docs/plan-document.schema.json)."""
    strings = {"type": "array", "items": {"type": "string"}}
    decision = {"type": "object", "required": ["what", "value", "why"],
                "properties": {"what": {"type": "string"}, "value": {"type": "string"}, "why": {"type": "string"}}}
    worker = {
        "type": "object", "required": ["name", "node", "host", "port", "args", "argv", "env", "settings"],
        "properties": {
            "name": {"type": "string"}, "node": {"type": "string"}, "host": {"type": "string"},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "gpus": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "args": {**strings, "description": "llama-server's own flags"},
            "argv": {**strings, "description": "the whole command: wrappers, the llama-server binary, args"},
            "command": {"type": "string", "description": "env and argv as a shell line, for display only"},
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "settings": {"type": "object", "description": (
                "WorkerSettings: what args and env are rendered from; the expert cache's fields are expert_cache_*, "
                "and documents with their older names (moe_cache_mib, moe_cache_prefill_ahead ..., "
                "moe_cache_device_slots) are still read")},
            "decisions": {"type": "array", "items": decision},
            "predicted": {"type": "object", "properties": {
                "tg": {"type": ["number", "null"]},
                "pp": {"type": "object", "additionalProperties": {"type": "number"}}}},
            "devices": {"type": "object", "additionalProperties": {"type": "integer"}},
            "memory": {"type": "array", "items": {"type": "object"}},
            "placement": {"type": "array", "items": {"type": "object"}},
            "cpu_expert_layers": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "expert_cache": {"type": "object"},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/orchestrator/docs/plan-document.schema.json",
        "title": "orchestrator plan document",
        "description": "What `orchestrator plan --json` prints and `bench --plan-json` reads "
                       "(orchestrator.plan.document).",
        "type": "object", "required": ["version", "model", "workers", "backend"],
        "properties": {
            "version": {"const": VERSION},
            "model": {"type": "object"},
            "decisions": {"type": "array", "items": decision},
            "warnings": strings, "notes": strings,
            "backend": {"type": "object", "required": ["server", "flavor"],
                        "properties": {"server": {"type": "string"}, "flavor": {"type": "string"}}},
            "workers": {"type": "array", "minItems": 1, "items": worker},
        },
    }


if __name__ == "__main__":      # python -m orchestrator.plan.document > docs/plan-document.schema.json
    import json

    print(json.dumps(json_schema(), indent=1))
