"""A YAML reader that remembers where every key is.

PyYAML's ``safe_load`` forgets line numbers and silently keeps the last of two equal keys. Here the document is
composed into nodes (which carry their marks), then built into plain Python values while recording, for every
dotted path, the line of its key. Duplicate keys are an error; merge keys (``<<: *anchor``) work as in YAML 1.1,
keys set explicitly win over merged ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

try:  # the C composer is ~10x faster; both give the same nodes and marks
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - libyaml missing
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]


_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlError(Exception):
    """The text is not YAML we accept. ``line`` is 1-based (None when it has none)."""

    def __init__(self, line: int | None, path: tuple, message: str):
        super().__init__(message)
        self.line = line
        self.path = path
        self.message = message


@dataclass
class Locations:
    """Line (1-based) of each key path in the document; ``()`` is the document itself."""

    lines: dict[tuple, int] = field(default_factory=dict)
    # key paths whose value no longer comes from the document (changed by `--set`): they and what lies under them
    # have no line, so an error about them points at no line of the file rather than at a wrong one
    replaced: tuple[tuple, ...] = ()

    def is_replaced(self, path: tuple) -> bool:
        """``path`` or a key above it was replaced from elsewhere (the command line)."""
        path = tuple(path)
        return any(path[:len(r)] == r for r in self.replaced)

    def line_of(self, path: tuple) -> int | None:
        """The line of ``path`` or of its nearest ancestor that the file spells out (None for a replaced key)."""
        path = tuple(path)
        if self.is_replaced(path):
            return None
        while True:
            if path in self.lines:
                return self.lines[path]
            if not path:
                return None
            path = path[:-1]

    def exact(self, path: tuple) -> int | None:
        path = tuple(path)
        return None if self.is_replaced(path) else self.lines.get(path)

    def replacing(self, paths) -> "Locations":
        """These locations with ``paths`` (key paths) replaced from elsewhere."""
        return Locations(dict(self.lines), self.replaced + tuple(tuple(p) for p in paths))


def load_yaml(text: str) -> tuple[Any, Locations]:
    """Parse one YAML document: (plain value, locations). Raises YamlError."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = err.problem or "malformed YAML"
        where = f" (column {mark.column + 1})" if mark is not None else ""
        context = f" {err.context}" if err.context else ""
        lines = text.splitlines()
        if mark is not None and mark.line < len(lines) and lines[mark.line][mark.column:mark.column + 1] == "\t":
            raise YamlError(line, (), f"malformed YAML: a tab character{where}; YAML indents with spaces") from None
        raise YamlError(line, (), f"malformed YAML: {problem}{context}{where}") from None
    except yaml.YAMLError as err:  # pragma: no cover - unmarked errors are rare
        raise YamlError(None, (), f"malformed YAML: {err}") from None
    locs = Locations()
    if node is None:
        return None, locs
    locs.lines[()] = node.start_mark.line + 1
    builder = _Builder(locs)
    return builder.build(node, ()), locs


class _Builder:
    def __init__(self, locs: Locations):
        self.locs = locs
        self.constructor = _Loader("")  # only its scalar constructors are used
        self._active: set[int] = set()  # ids of nodes being built (recursive aliases)

    def build(self, node: yaml.Node, path: tuple) -> Any:
        if id(node) in self._active:
            raise YamlError(node.start_mark.line + 1, path, "recursive YAML alias")
        if isinstance(node, yaml.ScalarNode):
            try:
                return self.constructor.construct_object(node, deep=True)
            except yaml.YAMLError as err:
                raise YamlError(node.start_mark.line + 1, path, f"bad value: {getattr(err, 'problem', err)}") from None
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                out = []
                for i, item in enumerate(node.value):
                    self.locs.lines.setdefault(path + (i,), item.start_mark.line + 1)
                    out.append(self.build(item, path + (i,)))
                return out
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path)
        finally:
            self._active.discard(id(node))
        raise YamlError(node.start_mark.line + 1, path, f"unsupported YAML node {node.tag}")  # pragma: no cover

    def _key(self, knode: yaml.Node, path: tuple) -> str:
        line = knode.start_mark.line + 1
        if not isinstance(knode, yaml.ScalarNode):
            raise YamlError(line, path, "a key must be a plain name, not a list or mapping")
        key = self.constructor.construct_object(knode, deep=True)
        if not isinstance(key, str):
            hint = " (YAML reads it as a boolean: quote it)" if isinstance(key, bool) else ""
            raise YamlError(line, path, f"a key must be a name, got {key!r}{hint}")
        return key

    def _mapping(self, node: yaml.MappingNode, path: tuple) -> dict:
        out: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        merged: list[tuple[yaml.Node, int]] = []
        for knode, vnode in node.value:
            if knode.tag == _MERGE_TAG:
                merged.append((vnode, knode.start_mark.line + 1))
                continue
            key = self._key(knode, path)
            line = knode.start_mark.line + 1
            kpath = path + (key,)
            if key in first_line:
                raise YamlError(line, kpath, f"duplicate key (first set at line {first_line[key]}; "
                                             "YAML would silently keep only the last)")
            first_line[key] = line
            self.locs.lines[kpath] = line
            out[key] = self.build(vnode, kpath)
        # merge keys: explicit keys win, earlier merged mappings win over later ones (YAML 1.1 merge spec)
        for vnode, line in merged:
            sources = vnode.value if isinstance(vnode, yaml.SequenceNode) else [vnode]
            for src in sources:
                if not isinstance(src, yaml.MappingNode):
                    raise YamlError(line, path, "'<<' must merge a mapping (or a list of mappings)")
                sub = _Builder(Locations())
                sub._active = self._active
                value = sub.build(src, ())
                for key, v in value.items():
                    if key in out:
                        continue
                    out[key] = v
                    for sp, sl in sub.locs.lines.items():
                        if sp and sp[0] == key:
                            self.locs.lines.setdefault(path + sp, sl)
        return out
