"""The speed model's fitted constants as stored in orchestrator/_data/rates.json, read once when imported.

The file holds each constant with its unit, the runs it was fitted or measured on and the lab script that fits it
again (its "about" says how); plan/rates.py names them for the planner, which reads no file itself.
"""

from __future__ import annotations

import json
from pathlib import Path

PATH = Path(__file__).resolve().parent / "_data" / "rates.json"
CONSTANTS: dict[str, dict] = json.loads(PATH.read_text())["constants"]


def value(name: str) -> float:
    """The stored value of the constant ``name``."""
    return float(CONSTANTS[name]["value"])


def by_streams(name: str) -> dict[int, float]:
    """The stored values of the constant ``name``, one per number of streams decoding together."""
    return {int(streams): float(v) for streams, v in CONSTANTS[name]["value"].items()}
