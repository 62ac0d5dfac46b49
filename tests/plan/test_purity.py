"""plan/ stays pure: no processes, Ray, network, clocks or file access in the planning package."""

from __future__ import annotations

import ast
from pathlib import Path

PLAN = Path(__file__).resolve().parents[2] / "orchestrator" / "plan"
FORBIDDEN_MODULES = {"subprocess", "ray", "socket", "time", "urllib", "http", "aiohttp", "requests", "psutil",
                     "pynvml", "shutil", "tempfile", "multiprocessing", "threading", "asyncio"}
FORBIDDEN_CALLS = {"open", "exec", "eval"}


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module.split(".")[0], node.lineno


def test_plan_package_has_no_side_effect_imports():
    files = sorted(PLAN.rglob("*.py"))
    assert files, "orchestrator/plan is empty?"
    bad = []
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        for mod, line in _imports(tree):
            if mod in FORBIDDEN_MODULES:
                bad.append(f"{f.name}:{line} imports {mod}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                bad.append(f"{f.name}:{node.lineno} calls {node.func.id}()")
            if isinstance(node, ast.Attribute) and node.attr in {"system", "popen", "read_text", "write_text",
                                                                  "read_bytes", "write_bytes"}:
                bad.append(f"{f.name}:{node.lineno} uses .{node.attr}")
    assert not bad, "plan/ must stay pure:\n" + "\n".join(bad)


def test_plan_only_imports_inward():
    """plan reads the dataclasses of hardware, model, backend and launch's pure vocabulary; it never imports
    launch's process side, cluster, bench or cli."""
    bad = []
    for f in sorted(PLAN.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestrator."):
                top = node.module.split(".")[1]
                if node.module in {"orchestrator.launch.llama_args", "orchestrator.launch.numa",
                                   "orchestrator.launch.settings"}:
                    continue
                if top in {"launch", "cluster", "bench", "cli", "commands"}:
                    bad.append(f"{f.name} imports {node.module}")
    assert not bad, bad
