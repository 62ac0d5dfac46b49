"""The architecture as the tests see it: import-linter's contracts (pyproject.toml) hold, planning loads no
side-effect modules at run time either, plan/ calls no file or shell builtins, and no private name crosses
from one package to another."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "orchestrator"
# private names still imported across packages, each with the change that removes it
KNOWN_PRIVATE_CROSSINGS: set[tuple[str, str]] = set()


def _lint_imports(config: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.exists(), f"{exe} missing: install the test extra (pip install -e '.[test]')"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([str(exe), "--no-cache", str(config)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_import_contracts_hold():
    res = _lint_imports(ROOT / "pyproject.toml")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_a_broken_contract_fails(tmp_path):
    """The same run fails when a contract is broken: a contract forbidding what plan/ really imports."""
    text = (ROOT / "pyproject.toml").read_text() + (
        '\n[[tool.importlinter.contracts]]\nid = "canary"\nname = "canary"\ntype = "forbidden"\n'
        'source_modules = ["orchestrator.plan"]\nforbidden_modules = ["orchestrator.launch.settings"]\n')
    cfg = tmp_path / "pyproject.toml"
    cfg.write_text(text)
    res = _lint_imports(cfg)
    assert res.returncode != 0 and "canary" in res.stdout and "BROKEN" in res.stdout


def test_planning_loads_no_side_effect_modules():
    """import-linter reads the static graph; this checks what importing the planner really loads."""
    forbidden = ("subprocess", "ray", "socket", "fcntl", "tarfile", "aiohttp", "urllib.request", "asyncio",
                 "orchestrator.backend.detect", "orchestrator.hardware.sysfs", "orchestrator.launch.process")
    code = ("import sys; import orchestrator.plan.planner, orchestrator.launch.llama_args; "
            f"print(','.join(m for m in {forbidden!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.strip()
    assert out == "", f"importing the planner loads {out}"


def test_plan_calls_no_file_or_shell_builtins():
    bad = []
    for f in sorted((PKG / "plan").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {
                    "open", "exec", "eval", "__import__"}:
                bad.append(f"{f.name}:{node.lineno} calls {node.func.id}()")
            if isinstance(node, ast.Attribute) and node.attr in {"system", "popen", "read_text", "write_text",
                                                                  "read_bytes", "write_bytes"}:
                bad.append(f"{f.name}:{node.lineno} uses .{node.attr}")
    assert not bad, "plan/ must stay pure:\n" + "\n".join(bad)


def test_no_private_name_crosses_packages():
    found = set()
    for f in sorted(PKG.rglob("*.py")):
        mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        pkg = mod.split(".")[:2]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestrator."):
                if node.module.split(".")[:2] == pkg:
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.add((mod, f"{node.module}.{a.name}"))
    assert found <= KNOWN_PRIVATE_CROSSINGS, sorted(found - KNOWN_PRIVATE_CROSSINGS)


def test_every_topology_key_says_where_it_is_decided():
    """docs/where-keys-are-decided.md names every key of the schema and only modules that exist."""
    import re

    from orchestrator.config.reference import keys

    text = (ROOT / "docs" / "where-keys-are-decided.md").read_text()
    named = set(re.findall(r"`([a-z_]+(?:\[\])?\.[a-z_]+)`", text))
    missing = [k.key for k in keys() if k.key not in named]
    assert not missing, f"docs/where-keys-are-decided.md does not say where these are decided: {missing}"
    paths = set(re.findall(r"`(orchestrator/[a-z_/]+\.py)`", text))
    assert paths and all((ROOT / p).is_file() for p in paths), sorted(p for p in paths if not (ROOT / p).is_file())
