"""LaunchSpec: exactly what one worker process runs. ``plan`` prints it, ``up`` and ``bench`` execute it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Mapping

from orchestrator.launch.settings import WorkerSettings


@dataclass(frozen=True)
class LaunchSpec:
    """One llama-server worker process, fully resolved.

    ``argv`` is the complete command line, wrappers included (``disable-numa-balancing.sh numactl ... --
    llama-server ...``); ``env`` holds only the variables set on top of the inherited environment
    (``CUDA_VISIBLE_DEVICES``, ``GGML_OP_OFFLOAD_MIN_BATCH`` ...). Never a shell string.
    """

    name: str                                   # worker name, unique in a deployment ("w0", "socket1", ...)
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"                     # where llama-server listens
    port: int = 8081
    node: str | None = None                     # the machine (topology node name) it must run on; None = local
    resources: Mapping[str, float] = field(default_factory=dict)  # Ray resources the worker actor reserves
    model_alias: str = "model"                  # the name clients use in the OpenAI API ("model": ...)
    settings: WorkerSettings | None = None      # what the argv was rendered from (None: a hand-written argv)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def connect_url(self) -> str:
        """The URL to reach the server from its own machine: a wildcard host (``0.0.0.0``, ``::``, empty) means
        loopback there, and an IPv6 address gets its brackets."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def shell_line(self) -> str:
        """For display only: the env and argv quoted as a user would type them."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)

    def to_dict(self) -> dict:
        return {"name": self.name, "argv": list(self.argv), "env": dict(self.env), "host": self.host,
                "port": self.port, "node": self.node, "resources": dict(self.resources),
                "model_alias": self.model_alias,
                **({"settings": self.settings.to_dict()} if self.settings is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "LaunchSpec":
        return cls(name=d["name"], argv=tuple(d["argv"]), env=dict(d.get("env", {})), host=d.get("host", "127.0.0.1"),
                   port=int(d.get("port", 8081)), node=d.get("node"), resources=dict(d.get("resources", {})),
                   model_alias=d.get("model_alias", "model"),
                   settings=WorkerSettings.from_dict(d["settings"]) if d.get("settings") else None)
