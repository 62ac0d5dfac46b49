"""The shipped topologies load; example.yaml documents every key with its default; docs/topology.md is current."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config import load_topology
from orchestrator.config.reference import keys, reference_markdown
from orchestrator.config.schema import SECTIONS

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml"))
EXAMPLE = REPO / "topologies" / "example.yaml"


def test_the_expected_examples_exist():
    names = {p.name for p in TOPOLOGIES}
    assert {"example.yaml", "demo.yaml", "1socket-1gpu-24g.yaml", "2socket-2gpu.yaml", "2socket-8gpu.yaml",
            "h200.yaml"} <= names


@pytest.mark.parametrize("path", TOPOLOGIES, ids=[p.name for p in TOPOLOGIES])
def test_every_example_loads(path):
    t = load_topology(path)
    assert t.source == str(path)
    if path.name in ("demo.yaml", "example.yaml"):
        # generated models, in <repo>/models where `orchestrator synth-model` writes them
        assert t.model.path.endswith(".gguf") and Path(t.model.path).parent == REPO / "models"
    else:
        # the real model, by its Hugging Face id (ORG/REPO:QUANT), kept as written
        from orchestrator.config.types import is_remote_model

        assert is_remote_model(t.model.path) and ":" in t.model.path and not t.model.path.startswith("/")


def test_every_key_of_the_schema_is_in_example_yaml_with_its_default():
    t = load_topology(EXAMPLE)
    locs = t._locations
    lines = EXAMPLE.read_text().splitlines()
    seen = []
    for k in keys():
        line = locs.exact(k.path)
        assert line is not None, f"{k.key} is not in topologies/example.yaml: add it with its default and a comment"
        seen.append(k.key)
        if k.required:
            continue
        section = getattr(t, k.section)
        obj = section[0] if k.section == "nodes" else section
        field = type(obj).model_fields[k.path[-1]]
        assert getattr(obj, k.path[-1]) == field.get_default(call_default_factory=True), (
            f"topologies/example.yaml:{line}: {k.key} is not its default ({k.default})")
        assert _documented(lines, line), f"topologies/example.yaml:{line}: {k.key} has no comment above it"
    assert len(seen) == sum(len(m.model_fields) for m in SECTIONS.values())


def test_example_yaml_has_nothing_but_schema_keys():
    data = yaml.safe_load(EXAMPLE.read_text())
    assert set(data) == set(SECTIONS)
    assert len(data["nodes"]) == 1


def _documented(lines: list[str], line: int) -> bool:
    """A key is documented by a comment on its line, or above it (through sibling keys, not across a blank)."""
    text = lines[line - 1]
    if "#" in text.split(":", 1)[-1]:
        return True
    indent = len(text) - len(text.lstrip(" -"))
    for prev in reversed(lines[: line - 1]):
        stripped = prev.strip()
        if not stripped:
            return False
        if stripped.startswith("#"):
            return True
        prev_indent = len(prev) - len(prev.lstrip(" -"))
        if prev_indent != indent:
            return False
    return False


def test_docs_topology_md_is_generated_from_the_schema():
    doc = (REPO / "docs" / "topology.md").read_text()
    assert doc == reference_markdown(), "run: python -m orchestrator.config --reference > docs/topology.md"
    for k in keys():
        assert f"| `{k.key}` |" in doc
        assert k.doc, f"{k.key} has no docstring in orchestrator/config/schema.py"


def test_demo_topology_is_this_machine_behind_one_local_gateway():
    t = load_topology(REPO / "topologies" / "demo.yaml")
    assert t.model.path == str(REPO / "models" / "demo-moe.gguf")
    assert (t.gateway.host, t.gateway.port) == ("127.0.0.1", 8080)
    assert t.ray.address == "local"
    assert [n.machine for n in t.nodes] == ["live"]


def test_h200_topology_is_one_live_gpu():
    t = load_topology(REPO / "topologies" / "h200.yaml")
    (node,) = t.nodes
    assert node.machine == "live" and node.gpus == "all" and node.vram_limit == 12 * 2**30


@pytest.mark.parametrize("name,machine", [
    ("1socket-1gpu-24g.yaml", "described/1socket-1gpu-24g.json"),
    ("2socket-2gpu.yaml", "described/2socket-2gpu.json"),
    ("2socket-8gpu.yaml", "described/2socket-8gpu.json"),
])
def test_machines_we_do_not_have_are_recorded_fixtures(name, machine):
    t = load_topology(REPO / "topologies" / name)
    assert [n.machine for n in t.nodes] == [str(REPO / "tests" / "fixtures" / "machines" / machine)]


# ------------------------------------------------------------------------------------ python -m orchestrator.config

def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.config", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_validator_entry_point_accepts_the_examples():
    r = _run(*[str(p.relative_to(REPO)) for p in TOPOLOGIES])
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{p.relative_to(REPO)}: ok" for p in TOPOLOGIES]


def test_validator_entry_point_reports_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: m.gguf\n")
    r = _run(str(bad), "topologies/demo.yaml")
    assert r.returncode == 2
    assert r.stderr == f"error: {bad}:1: modle: unknown key (did you mean 'model'?)\n"
    assert r.stdout == "topologies/demo.yaml: ok\n"


def test_validator_entry_point_check_files(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("model: nowhere.gguf\n")
    r = _run(str(f), "--check-files")
    assert r.returncode == 2
    assert r.stderr == f"error: {f}:1: model.path: model file {tmp_path / 'nowhere.gguf'} does not exist\n"


def test_validator_entry_point_dump_and_reference(tmp_path):
    r = _run("--dump", "topologies/h200.yaml")
    assert r.returncode == 0, r.stderr
    dumped = yaml.safe_load(r.stdout)
    assert dumped["nodes"][0]["vram_limit"] == 12 * 1024**3 and dumped["workers"]["threads"] == "auto"
    r = _run("--reference")
    assert r.returncode == 0 and r.stdout == reference_markdown()
