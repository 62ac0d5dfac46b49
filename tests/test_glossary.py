"""docs/glossary.md names what exists: its topology keys are keys of the schema, its llama-server flags are flags
the tool detects or passes, its WorkerSettings fields are fields; and the topology spells the cache by the
project's name."""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from pathlib import Path

from orchestrator.config.reference import reference_markdown
from orchestrator.launch.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
GLOSSARY = (REPO / "docs" / "glossary.md").read_text()
KEYS = set(re.findall(r"(?m)^\| `([^`]+)` \|", reference_markdown()))
FSTRING_MIDDLE = getattr(tokenize, "FSTRING_MIDDLE", None)    # Python 3.12 splits f-strings


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


def _moe_cache_words(path: Path) -> list[tuple[int, str, str]]:
    """(line, word, the 20 characters before it) of every ``moe_cache`` in a module's strings and comments (any
    case); a name that holds it comes whole, with "name" before it."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME and re.search("moe_cache", tok.string, re.I):
            found.append((tok.start[0], tok.string, "name"))
        elif tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == FSTRING_MIDDLE:
            for m in re.finditer(r"moe_cache\w*", tok.string, re.I):
                found.append((tok.start[0], m.group(0), tok.string[max(0, m.start() - 20):m.start()]))
    return found


def test_the_product_names_the_cache_expert_cache_outside_llama_servers_spellings():
    """``moe_cache`` in the product package is llama-server's spelling only: its ``/metrics`` names
    (``llamacpp:moe_cache_*``), its environment (``LLAMA_MOE_CACHE_*``) and log lines, the run records' counter
    keys named after its metrics, and the names older plan documents carry for the settings and the binary's
    features (read by ``WorkerSettings.from_dict`` and ``BackendInfo.from_dict``). No name of the project says
    it: not a settings field, not a feature, not a metric of the bench."""
    from orchestrator.backend.info import FORMER_FEATURES
    from orchestrator.backend.server_options import BY_FEATURE
    from orchestrator.bench.measure import COUNTERS, PROMPT_COUNTERS
    from orchestrator.launch.settings import FORMER_FIELDS

    assert {"expert_cache", "expert_cache_slots", "expert_cache_staging"} <= set(BY_FEATURE)
    assert not [f for f in BY_FEATURE if "moe_cache" in f]
    assert set(FORMER_FEATURES.values()) <= set(BY_FEATURE)
    allowed = set(FORMER_FEATURES) | set(FORMER_FIELDS) | {"moe_cache_device_slots", COUNTERS, PROMPT_COUNTERS}
    theirs = re.compile(r"(llamacpp:|LLAMA_(ARG_)?|ggml_backend_sched_)$", re.I)
    wrong = []
    for path in sorted((REPO / "orchestrator").rglob("*.py")):
        for line, word, before in _moe_cache_words(path):
            if before == "name" or (word not in allowed and not theirs.search(before)):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {word}")
    assert not wrong, wrong
    fields = {f.name for f in dataclasses.fields(WorkerSettings)}
    assert {"expert_cache_mib", "expert_cache_slots", "expert_cache_stage_buffers"} <= fields
    assert not [f for f in fields if "moe_cache" in f]

def test_the_plans_names_are_names_of_the_code():
    """Every name the glossary gives the plan (its fields, the document's keys, the bench's metrics) is a word of
    the product package, and none of the names it replaced is."""
    source = "".join(p.read_text() for p in (REPO / "orchestrator").rglob("*.py"))
    words = set(re.findall(r"\w+", source))
    named = {n for c in _column("The expert cache", "in the plan") for n in re.findall(r"`(\w+)`", c)}
    assert {"expert_cache_bytes", "cache_mib", "slot_assignment", "stage_buffers", "stage_mib"} <= named
    assert named <= words, sorted(named - words)
    former = {"prefill_stage_buffers", "prefill_stage_bytes", "prefill_stage_min_batch", "moe_cache_hit_rate",
              "PlanContext", "MoeCacheSize", "moe_cache_size", "staging_bytes"}
    assert not former & words, sorted(former & words)
