"""The planner stays readable: no function in orchestrator/plan takes more than MAX_PARAMETERS parameters (positional
and keyword-only, ``self``/``cls`` not counted, ``*args``/``**kwargs`` one each; group them into a small frozen
dataclass instead) or runs longer than MAX_LINES lines (its ``def`` to its last line, docstring included: split it
into steps whose names say what they decide)."""

from __future__ import annotations

import ast
from pathlib import Path

import orchestrator.plan

MAX_PARAMETERS = 8
MAX_LINES = 75
PLAN = Path(orchestrator.plan.__file__).resolve().parent


def _functions(source: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def line_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return fn.end_lineno - fn.lineno + 1


def too_wide_or_long(source: str, where: str) -> list[str]:
    out = []
    for fn in _functions(source):
        n, lines = parameter_count(fn), line_count(fn)
        if n > MAX_PARAMETERS:
            out.append(f"{where}:{fn.lineno} {fn.name} takes {n} parameters (at most {MAX_PARAMETERS})")
        if lines > MAX_LINES:
            out.append(f"{where}:{fn.lineno} {fn.name} is {lines} lines long (at most {MAX_LINES})")
    return out


def test_no_planner_function_is_too_wide_or_too_long():
    files = sorted(PLAN.rglob("*.py"))
    assert len(files) > 10 and PLAN.name == "plan"
    found = [msg for f in files for msg in too_wide_or_long(f.read_text(), str(f.relative_to(PLAN.parent.parent)))]
    assert not found, "\n".join(found)


def test_the_walk_finds_a_wide_and_a_long_function():
    wide = "def f(a, b, c, d, e, f, g, h, *, i):\n    pass\n"
    method = "class C:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n"
    long = "def g():\n" + "    x = 1\n" * MAX_LINES
    assert too_wide_or_long(wide, "w.py") == ["w.py:1 f takes 9 parameters (at most 8)"]
    assert too_wide_or_long(method, "m.py") == []                       # self is not counted
    assert too_wide_or_long("def v(a, *args, **kw):\n    pass\n", "v.py") == []
    assert too_wide_or_long(long, "l.py") == [f"l.py:1 g is {MAX_LINES + 1} lines long (at most {MAX_LINES})"]
