"""The plan's fitted constants (orchestrator/_data/rates.json): each carries its provenance, the planner reads exactly
the stored values, and every recorded fit, run on its recorded data, stores again the value it holds."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab.rates_file import RATES_JSON, load, rounded, write_fitted

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
DOC = load()
FITS = DOC["fits"]


def _values(constant: dict) -> list[float]:
    v = constant["value"]
    return list(v.values()) if isinstance(v, dict) else [v]


def test_every_constant_has_its_unit_resolution_source_and_fit():
    assert len(DOC["constants"]) >= 20
    for name, c in DOC["constants"].items():
        assert set(c) == {"value", "unit", "resolution", "fit", "source", "checked_by"}, name
        assert c["unit"] and c["source"], name
        assert c["fit"] is None or c["fit"] in FITS, name
        if c["fit"] is None:
            assert "no fit script" in c["source"] or "held by" in c["source"], name
        for v in _values(c):
            assert rounded(v, c["resolution"]) == v, f"{name} is not stored at its resolution {c['resolution']}"
        # every run or fixture it names is in the repository
        for path in re.findall(r"(?:docs/benchmarks|tests/fixtures)/[\w./*-]+", c["source"]):
            assert list(REPO.glob(path.rstrip("."))), f"{name}: {path} is not in the repository"


def test_every_constant_names_the_tests_that_check_it_and_they_exist():
    """checked_by holds pytest node ids: each file exists and defines the test (and a parametrised id of the fit
    test is a fit); a constant that a fit produces is checked by that fit's rerun."""
    for name, c in DOC["constants"].items():
        assert c["checked_by"], name
        for node in c["checked_by"]:
            path, _, test = node.partition("::")
            func, _, param = test.partition("[")
            assert (REPO / path).is_file(), f"{name}: {path} is not in the repository"
            assert re.search(rf"^def {re.escape(func)}\(", (REPO / path).read_text(), re.M), f"{name}: no {node}"
            if param:
                assert param.rstrip("]") in FITS, f"{name}: {node} names no fit"
        if c["fit"]:
            assert f"test_each_fit_stores_again_the_values_it_holds[{c['fit']}]" in " ".join(c["checked_by"]), name


def test_every_fit_names_data_that_exists_and_produces_constants():
    for key, fit in FITS.items():
        assert fit["command"][0] == "python", key
        files = [a.split("=", 1)[-1] for a in fit["command"][2:] if "/" in a and not a.startswith("lab")]
        assert files and all((REPO / f).is_file() for f in files), (key, files)
        assert any(c["fit"] == key for c in DOC["constants"].values()), f"fit {key} produces no constant"


def test_the_planner_reads_the_stored_values():
    from orchestrator.plan import rates as R

    for name, c in DOC["constants"].items():
        got = getattr(R, name)
        want = {int(k): v for k, v in c["value"].items()} if isinstance(c["value"], dict) else c["value"]
        assert got == want, name


def test_write_rounds_to_the_resolution_and_refuses_an_unknown_constant(tmp_path):
    path = tmp_path / "rates.json"
    shutil.copy(RATES_JSON, path)
    write_fitted({"CACHE_LAYER_OVERHEAD_S": 71.4e-6, "PREFETCH_OVERLAP": {1: 0.004, 4: 0.3249}}, path)
    doc = json.loads(path.read_text())
    assert doc["constants"]["CACHE_LAYER_OVERHEAD_S"]["value"] == 71e-6
    assert doc["constants"]["PREFETCH_OVERLAP"]["value"] == {"1": 0.0, "4": 0.32}
    with pytest.raises(SystemExit, match="no constant NOT_A_RATE"):
        write_fitted({"NOT_A_RATE": 1.0}, path)


@pytest.mark.parametrize("key", sorted(FITS))
def test_each_fit_stores_again_the_values_it_holds(key, tmp_path):
    """The fit's recorded command, run with --write on a copy whose constants of this fit are blanked, fills them
    in with the stored values (each rounded to its resolution) and touches no other constant."""
    fit = FITS[key]
    mine = [n for n, c in DOC["constants"].items() if c["fit"] == key]
    blank = json.loads(json.dumps(DOC))
    for n in mine:
        blank["constants"][n]["value"] = None
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(blank, indent=2) + "\n")
    res = subprocess.run([sys.executable, *fit["command"][1:], "--write", str(path)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    got = json.loads(path.read_text())["constants"]
    for n, c in DOC["constants"].items():
        assert got[n]["value"] == c["value"], f"{n}: the fit {key} gives {got[n]['value']}, stored {c['value']}"
    assert all(f"wrote {n} = " in res.stdout for n in mine), res.stdout[-2000:]


def test_the_stored_pageable_share_predicts_the_memory_mapped_prompt():
    """PAGEABLE_FRACTION's own copy run is not kept; the run that measured its effect is: the plan's prompt with the
    host-resident experts memory-mapped against pinned. Replanned with the stored share, the predicted ratio is
    the measured one within 15%."""
    sys.path.insert(0, str(REPO / "lab" / "bench"))
    from fit_pageable_share import solve

    got = solve(REPO / "docs/benchmarks/h200-2026-11-29-w1-load-modes/bench.json.xz")
    measured = got["mmap"] / got["pinned"]
    predicted = got["predicted_mmap"] / got["predicted_pinned"]
    assert predicted / measured == pytest.approx(1.0, abs=0.15), (predicted, measured)
