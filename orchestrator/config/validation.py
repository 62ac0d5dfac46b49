"""Validation errors as one line each (``FILE:LINE: key.path: what (expected …)``) and dotted-key changes of a
validated topology. Knows the schema only through the root model it is given, so the loader and the schema can
both use it without importing each other."""

from __future__ import annotations

import os
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.config._yaml import Locations
from orchestrator.config.keys import display_key, split_key
from orchestrator.config.types import Accepts, describe, did_you_mean
from orchestrator.errors import ConfigError


def fmt(source: str, line: int | None, path: tuple, message: str) -> str:
    where = f"{source}:{line}" if line else source
    return f"{where}: {display_key(path)}: {message}" if path else f"{where}: {message}"


def _model_at(root: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The section model that owns the mapping at ``path`` (``("nodes", 0)`` → NodeConfig)."""
    model: type[BaseModel] = root
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


def _where_else(root: type[BaseModel], key: str) -> list[str]:
    """Sections (other than the one at hand) that have a key named ``key``."""
    out = []
    if key in root.model_fields:
        out.append(key)
    for section, model in _sections(root).items():
        if key in model.model_fields:
            out.append(f"{section}[].{key}" if section == "nodes" else f"{section}.{key}")
    return out


def _sections(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The section models of ``root`` by key (``{"model": ModelConfig, "nodes": NodeConfig, ...}``)."""
    out = {}
    for name, field in root.model_fields.items():
        model = _model_of(field.annotation)
        if model is not None:
            out[name] = model
    return out


def _unknown_key(root: type[BaseModel], path: tuple) -> str:
    key = path[-1]
    model = _model_at(root, path[:-1])
    valid = list(model.model_fields) if model is not None else []
    hint = did_you_mean(key, valid) if isinstance(key, str) else None
    if hint:
        return f"unknown key (did you mean '{hint}'?)"
    elsewhere = [w for w in _where_else(root, key) if isinstance(key, str)]
    if elsewhere:
        return f"unknown key here (it belongs at {' or '.join(elsewhere)})"
    return f"unknown key (valid keys: {', '.join(valid)})"


def _describe_error(root: type[BaseModel], e: dict, path: tuple) -> str:
    kind = e["type"]
    value = e.get("input")
    if kind in ("config_value", "config_cross"):
        return e["ctx"]["message"]
    if kind == "extra_forbidden":
        return _unknown_key(root, path)
    if kind == "missing":
        model = _model_at(root, path[:-1])
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


def first_error(root: type[BaseModel], err: ValidationError, source: str, locs: Locations) -> str:
    """The one line a user sees for a failed validation of ``root``: the earliest error in the file, its line,
    its key and what to write instead (+N more)."""
    found: list[tuple[int, int, tuple, str]] = []
    suggested: set[tuple] = set()  # (parent path, key) that an unknown key's did-you-mean already points at
    for order, e in enumerate(err.errors(include_url=False)):
        path = tuple(e["loc"])
        if e["type"] == "config_cross":
            path = path + split_key(e["ctx"]["key"])
        message = _describe_error(root, e, path)
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
    return fmt(source, line or None, path, message) + more


def validate_changes(topo: Any, changes: dict[str, Any]) -> Any:
    """``topo`` with dotted keys changed, validated exactly like its file (see ``Topology.override``)."""
    data = _lists(topo.model_dump(exclude_unset=True))
    for key, value in changes.items():
        path = split_key(key)
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
        # the file's own relative paths are absolute already; a relative path typed on the command line is the
        # shell's: from the current directory
        new = type(topo).model_validate(data, context={"base_dir": os.getcwd()})
    except ValidationError as err:
        raise ConfigError(first_error(type(topo), err, "override", Locations())) from None
    new._source = topo._source
    if topo._locations is not None:
        new._locations = topo._locations.replacing(split_key(k) for k in changes)
    return new


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value
