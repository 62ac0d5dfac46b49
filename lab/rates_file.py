"""The fitted constants of the plan's speed model as the lab's fit scripts write them: orchestrator/_data/rates.json.

Each constant there carries its value, unit and resolution (the value is the fit rounded to it), the runs it was
fitted or measured on, and the fit (a command under "fits") that computes it again, or none. A fit script given
``--write`` stores what it fitted through :func:`write_fitted`, rounded to each constant's resolution, and leaves
the other constants as they are.
"""

from __future__ import annotations

import json
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

from orchestrator.fitted_rates import PATH as RATES_JSON


def rounded(value: float, resolution: str) -> float:
    """``value`` to the nearest multiple of ``resolution`` (a decimal string such as "1e-6" or "0.001")."""
    return float(Decimal(repr(float(value))).quantize(Decimal(resolution), rounding=ROUND_HALF_EVEN))


def load(path: Path = RATES_JSON) -> dict:
    return json.loads(Path(path).read_text())


def dump(doc: dict, path: Path = RATES_JSON) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def write_fitted(values: dict[str, float | dict], path: Path | str | None = None) -> list[str]:
    """Store fitted ``values`` (constant name -> value, or -> {key: value}) in the rates file at ``path`` (default:
    the product's), each rounded to its constant's resolution; returns one line per constant written. A name the
    file does not hold is an error: the file says where each constant comes from, so a new one is added there
    first, with its unit, resolution and source."""
    path = Path(path) if path else RATES_JSON
    doc = load(path)
    lines = []
    for name, value in values.items():
        if name not in doc["constants"]:
            raise SystemExit(f"{path}: no constant {name}; add it with its unit, resolution and source first")
        c = doc["constants"][name]
        if isinstance(value, dict):
            c["value"] = {str(k): rounded(v, c["resolution"]) for k, v in value.items()}
        else:
            c["value"] = rounded(value, c["resolution"])
        lines.append(f"wrote {name} = {c['value']} ({c['unit']}) to {path}")
    dump(doc, path)
    return lines
