"""docs/glossary.md names what exists: its topology keys are keys of the schema, its llama-server flags are flags
the tool detects or passes, its WorkerSettings fields are fields; and the topology spells the cache by the
project's name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from orchestrator.config.reference import reference_markdown
from orchestrator.launch.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
GLOSSARY = (REPO / "docs" / "glossary.md").read_text()
KEYS = set(re.findall(r"(?m)^\| `([^`]+)` \|", reference_markdown()))


def _column(section: str, header: str) -> list[str]:
    """The cells of the column ``header`` of the first table under the heading ``section``."""
    body = GLOSSARY.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip()[1:-1])] for ln in body.splitlines()
            if ln.startswith("|") and not re.match(r"\|[-| ]+\|$", ln)]
    i = rows[0].index(header)
    return [r[i] for r in rows[1:]]


def test_topology_keys_are_keys_of_the_schema():
    named = set(re.findall(r"`((?:model|nodes|workers|gateway|ray|backend)\.\w+)", GLOSSARY))
    assert len(named) >= 10, named
    assert named <= KEYS, sorted(named - KEYS)


def test_flags_are_the_ones_the_tool_detects_or_passes():
    source = "".join(p.read_text() for p in (REPO / "orchestrator").rglob("*.py"))
    flags = set(re.findall(r"`(--[a-z][a-z-]+)", GLOSSARY))
    assert {"--moe-cache-mib", "--moe-cache-slots", "--moe-cache-prefill-ahead"} <= flags
    missing = sorted(f for f in flags if not re.search(rf"{re.escape(f)}(?![a-z-])", source))
    assert not missing, missing


def test_worker_settings_fields_are_fields():
    fields = {f.name for f in dataclasses.fields(WorkerSettings)}
    cells = _column("The expert cache", "`WorkerSettings` field")
    named = {n for c in cells for n in re.findall(r"`(\w+)`", c)}
    named |= set(re.findall(r"WorkerSettings\.(\w+)", GLOSSARY))
    assert len(named) >= 8, named
    assert named <= fields, sorted(named - fields)


def test_the_topology_spells_the_cache_by_the_projects_name():
    """The glossary's name is "expert cache"; "moe cache" is only the flags' spelling."""
    assert "**expert cache** (`expert_cache`)" in GLOSSARY
    assert not [k for k in KEYS if "moe_cache" in k]
    assert {"workers.expert_cache", "workers.expert_cache_staging", "workers.expert_cache_slots"} <= KEYS
