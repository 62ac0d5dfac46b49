"""Read topology.yaml into a :class:`Topology`; every error is one line ``FILE:LINE: key.path: what (expected …)``."""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.config._yaml import Locations, YamlError, load_yaml
from orchestrator.config.schema import SECTIONS, Topology, _split_key, display_key
from orchestrator.config.types import Accepts, describe, did_you_mean
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
        raise ConfigError(_fmt(source, err.line, err.path, err.message)) from None
    if data is None:
        raise ConfigError(f"{source}: empty topology (expected a mapping with at least 'model: FILE.gguf'; "
                          "see topologies/example.yaml)")
    if not isinstance(data, dict):
        raise ConfigError(_fmt(source, locs.line_of(()), (), f"the topology is {describe(data)} (expected a "
                                                              "mapping of sections: model:, nodes:, workers:, …)"))
    # top-level keys starting with "x-" are free for YAML anchors (`x-gpu-node: &gpu {...}`), as in compose files
    data = {k: v for k, v in data.items() if not k.startswith(EXTENSION_PREFIX)}
    base = os.fspath(base_dir) if base_dir is not None else os.getcwd()
    try:
        topo = Topology.model_validate(data, context={"base_dir": base})
    except ValidationError as err:
        raise ConfigError(_first_error(err, source, locs)) from None
    topo._source = source
    topo._locations = locs
    return topo


# ------------------------------------------------------------------------------------------------ error text


def _fmt(source: str, line: int | None, path: tuple, message: str) -> str:
    where = f"{source}:{line}" if line else source
    return f"{where}: {display_key(path)}: {message}" if path else f"{where}: {message}"


def _model_at(path: tuple) -> type[BaseModel] | None:
    """The section model that owns the mapping at ``path`` (``("nodes", 0)`` → NodeConfig)."""
    model: type[BaseModel] = Topology
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = _model_of(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def accepts_of(field) -> Accepts | None:
    return next((m for m in field.metadata if isinstance(m, Accepts)), None)


def _where_else(key: str) -> list[str]:
    """Sections (other than the one at hand) that have a key named ``key``."""
    out = []
    if key in Topology.model_fields:
        out.append(key)
    for section, model in SECTIONS.items():
        if key in model.model_fields:
            out.append(f"{section}[].{key}" if section == "nodes" else f"{section}.{key}")
    return out


def _unknown_key(path: tuple) -> str:
    key = path[-1]
    model = _model_at(path[:-1])
    valid = list(model.model_fields) if model is not None else []
    hint = did_you_mean(key, valid) if isinstance(key, str) else None
    if hint:
        return f"unknown key (did you mean '{hint}'?)"
    elsewhere = [w for w in _where_else(key) if isinstance(key, str)]
    if elsewhere:
        return f"unknown key here (it belongs at {' or '.join(elsewhere)})"
    return f"unknown key (valid keys: {', '.join(valid)})"


def _describe_error(e: dict, path: tuple) -> str:
    kind = e["type"]
    value = e.get("input")
    if kind in ("config_value", "config_cross"):
        return e["ctx"]["message"]
    if kind == "extra_forbidden":
        return _unknown_key(path)
    if kind == "missing":
        model = _model_at(path[:-1])
        field = model.model_fields.get(path[-1]) if model is not None else None
        acc = accepts_of(field) if field is not None else None
        if path == ("model",):
            return "missing required key (every topology names its model: `model: FILE.gguf`)"
        return "missing required key" + (f" (expected {acc.text})" if acc is not None else "")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"got {describe(value)} (expected a mapping of keys)"
    if kind in ("tuple_type", "list_type"):
        return f"got {describe(value)} (expected a list)"
    if kind == "too_short":
        return f"got {describe(value) if value else 'an empty list'} (expected at least one item)"
    return e.get("msg", kind)  # pragma: no cover - a type of error this schema does not produce


def _first_error(err: ValidationError, source: str, locs: Locations) -> str:
    found: list[tuple[int, int, tuple, str]] = []
    suggested: set[tuple] = set()  # (parent path, key) that an unknown key's did-you-mean already points at
    for order, e in enumerate(err.errors(include_url=False)):
        path = tuple(e["loc"])
        if e["type"] == "config_cross":
            path = path + _split_key(e["ctx"]["key"])
        message = _describe_error(e, path)
        if e["type"] == "extra_forbidden" and "did you mean '" in message:
            suggested.add(path[:-1] + (message.split("'")[1],))
        line = locs.exact(path) if e["type"] != "missing" else None
        if line is None:
            line = locs.line_of(path)
        found.append((line or 0, order, path, message))
    found = [f for f in found if not (f[3].startswith("missing required key") and f[2] in suggested)]
    found.sort(key=lambda f: (f[0], f[1]))
    line, _, path, message = found[0]
    more = f" (+{len(found) - 1} more error{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
    return _fmt(source, line or None, path, message) + more


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["workers.threads=8", "nodes.0.gpus=[0,1]"]`` → ``{"workers.threads": 8, "nodes.0.gpus": [0, 1]}``;
    each value is read as YAML, so it is typed as it would be in the file."""
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


def validate_changes(topo: Topology, changes: dict[str, Any]) -> Topology:
    data = _lists(topo.model_dump(exclude_unset=True))
    for key, value in changes.items():
        path = _split_key(key)
        if not path:
            raise ConfigError(f"override {key!r}: empty key")
        node: Any = data
        for i, part in enumerate(path[:-1]):
            nxt_is_index = isinstance(path[i + 1], int)
            if isinstance(part, int):
                if not isinstance(node, list) or part > len(node):
                    raise ConfigError(f"override {display_key(path)}: no item {part} in {display_key(path[:i])}")
                if part == len(node):
                    node.append({})
                node = node[part]
            else:
                if not isinstance(node, dict):
                    raise ConfigError(f"override {display_key(path)}: {display_key(path[:i])} is not a mapping")
                if part not in node:
                    node[part] = [] if nxt_is_index else {}
                    if part == "nodes" and nxt_is_index:
                        node[part] = [_lists(n.model_dump(exclude_unset=True)) for n in topo.nodes]
                node = node[part]
        last = path[-1]
        if isinstance(last, int) or not isinstance(node, dict):
            raise ConfigError(f"override {display_key(path)}: expected a key of a mapping")
        node[last] = value
    try:
        new = Topology.model_validate(data, context={"base_dir": os.getcwd()})
    except ValidationError as err:
        raise ConfigError(_first_error(err, "override", Locations())) from None
    new._source = topo._source
    new._locations = topo._locations
    return new


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value
