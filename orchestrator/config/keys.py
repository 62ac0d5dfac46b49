"""Dotted topology keys: ``"nodes.0.gpus"`` as a path and as users read it (``nodes[0].gpus``)."""

from __future__ import annotations


def split_key(key: str | tuple) -> tuple:
    """``"nodes.0.gpus"`` → ``("nodes", 0, "gpus")``; a tuple stays."""
    if isinstance(key, tuple):
        return key
    return tuple(int(p) if p.isdigit() else p for p in key.split(".") if p)


def display_key(path: tuple) -> str:
    """``("nodes", 0, "gpus")`` → ``nodes[0].gpus``."""
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out
