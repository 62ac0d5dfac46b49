"""Fixtures of the planner tests (the helpers live in planfixtures.py, importable by the tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planfixtures import backend, shape_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shape-models")


@pytest.fixture(scope="session")
def models(model_dir):
    return lambda like, quant="q4_0", **kw: shape_model(model_dir, like, quant, **kw)


@pytest.fixture()
def mainline():
    return backend("mainline")
