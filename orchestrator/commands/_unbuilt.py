"""Shared body of commands that are not built yet."""

from __future__ import annotations

import sys


def not_built(name: str, issue: int) -> int:
    print(f"orchestrator {name}: not built yet (tracked in issue #{issue})", file=sys.stderr)
    return 3
