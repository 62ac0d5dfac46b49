"""Read topology.yaml into a :class:`Topology`; every error is one line ``FILE:LINE: key.path: what (expected …)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.config._yaml import YamlError, load_yaml
from orchestrator.config.schema import Topology
from orchestrator.config.types import describe
from orchestrator.config.validation import first_error, fmt
from orchestrator.errors import ConfigError

EXTENSION_PREFIX = "x-"
MAX_BYTES = 1 << 20  # a topology is a few KiB; refuse to parse something that is clearly not one


def load_topology(path: str | os.PathLike) -> Topology:
    """Read and validate a topology file. Relative paths inside it are resolved against its folder.

    Raises ConfigError (one line naming the file, the line and the key) for anything wrong with it.
    """
    name = os.fspath(path)
    p = Path(name)
    try:
        if p.is_dir():
            raise ConfigError(f"{name}: is a directory (expected a topology .yaml file)")
        with open(p, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such file (expected a topology .yaml file; see topologies/example.yaml)") \
            from None
    except PermissionError:
        raise ConfigError(f"{name}: permission denied") from None
    except OSError as err:
        raise ConfigError(f"{name}: cannot read: {err.strerror or err}") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{name}: larger than {MAX_BYTES // 1024} KiB: not a topology file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(f"{name}:{line}: not UTF-8 text (byte {err.start})") from None
    return parse_topology(text, source=name, base_dir=os.path.dirname(os.path.abspath(name)))


def parse_topology(text: str, *, source: str = "<topology>", base_dir: str | os.PathLike | None = None) -> Topology:
    """Validate topology YAML text. ``source`` names it in errors; relative paths resolve against
    ``base_dir`` (the current directory when None)."""
    try:
        data, locs = load_yaml(text)
    except YamlError as err:
        raise ConfigError(fmt(source, err.line, err.path, err.message)) from None
    if data is None:
        raise ConfigError(f"{source}: empty topology (expected a mapping with at least 'model: FILE.gguf'; "
                          "see topologies/example.yaml)")
    if not isinstance(data, dict):
        raise ConfigError(fmt(source, locs.line_of(()), (), f"the topology is {describe(data)} (expected a "
                                                              "mapping of sections: model:, nodes:, workers:, …)"))
    # top-level keys starting with "x-" are free for YAML anchors (`x-gpu-node: &gpu {...}`), as in compose files
    data = {k: v for k, v in data.items() if not k.startswith(EXTENSION_PREFIX)}
    base = os.fspath(base_dir) if base_dir is not None else os.getcwd()
    try:
        topo = Topology.model_validate(data, context={"base_dir": base})
    except ValidationError as err:
        raise ConfigError(first_error(Topology, err, source, locs)) from None
    topo._source = source
    topo._locations = locs
    return topo


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["workers.threads=8", "nodes.0.gpus=[0,1]"]`` → ``{"workers.threads": 8, "nodes.0.gpus": [0, 1]}``;
    each value is read as YAML, so it is typed as it would be in the file. A relative path given this way is taken
    from the current directory (as the shell completes it), not from the topology's folder as the file's own
    paths are; an error about a key given this way names the file but no line of it."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, like workers.threads=8")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
    return out
