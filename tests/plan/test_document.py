"""The plan document: built from real plans, valid against the schema in docs/, read back as it was written,
and a bad document refused with one line naming the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
from planfixtures import shape_model

from orchestrator.errors import ConfigError
from orchestrator.paths import REPO_ROOT
from orchestrator.plan.document import VERSION, PlanDocument, json_schema
from orchestrator.resolve import nominal_backend, resolve

SCHEMA = REPO_ROOT / "docs" / "plan-document.schema.json"
CASES = [("1socket-1gpu-24g", "qwen3-30b-a3b", {}), ("2socket-8gpu", "deepseek-v3", {"workers.layout": "gpu-group"}),
         ("2socket-2gpu", "qwen3-235b-a22b", {"nodes.0.gpus": "none"})]


def test_the_schema_in_docs_is_current():
    if os.environ.get("ORCHESTRATOR_UPDATE_GOLDEN") == "1":
        SCHEMA.write_text(json.dumps(json_schema(), indent=1) + "\n")
    assert json.loads(SCHEMA.read_text()) == json_schema(), (
        f"{SCHEMA} is stale: python -m orchestrator.plan.document > {SCHEMA.relative_to(REPO_ROOT)}")


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def document(request, model_dir):
    topology, like, over = request.param
    model = shape_model(model_dir, like, "q4_0")
    res = resolve(REPO_ROOT / "topologies" / f"{topology}.yaml", overrides={"model.path": model.paths[0], **over},
                  backend=nominal_backend("mainline", cuda=True))
    return res, PlanDocument.from_resolved(res)


def test_a_real_plan_is_a_valid_document(document):
    res, doc = document
    data = json.loads(json.dumps(doc.to_dict()))
    jsonschema.validate(data, json.loads(SCHEMA.read_text()))
    assert data["version"] == VERSION and len(data["workers"]) == len(res.specs)
    for w, spec in zip(data["workers"], res.specs):
        assert w["argv"] == list(spec.argv) and w["env"] == dict(spec.env) and w["command"] == spec.shell_line()


def test_a_document_reads_back_as_it_was_written(document):
    res, doc = document
    data = json.loads(json.dumps(doc.to_dict()))
    back = PlanDocument.from_dict(data)
    assert back.to_dict() == data
    for entry, w, spec in zip(back.workers, res.plan.workers, res.specs):
        assert entry.settings == w.settings and entry.args == w.args
        assert entry.wrapper + (entry.server,) + entry.server_args == spec.argv
        assert entry.predicted_tg == pytest.approx(w.predicted.tg, rel=1e-3)
    assert back.backend == res.backend and back.n_layers == res.plan.model["n_layers"]


def test_a_document_without_a_version_is_version_1(document):
    _, doc = document
    data = doc.to_dict()
    del data["version"]
    assert PlanDocument.from_dict(data).version == 1


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(version=VERSION + 1), rf"plan JSON: version {VERSION + 1} is newer than this orchestrator"),
    (lambda d: d.update(workers=[]), r"plan JSON: expected a non-empty 'workers' list"),
    (lambda d: d["workers"][0].update(argv="llama-server -m x"), r"plan JSON: workers\[0\]\.argv: not a list"),
    (lambda d: d["workers"][0].update(args=[], argv=["numactl", "--", "server"]),
     r"plan JSON: workers\[0\]\.argv: has no llama-server binary"),
    (lambda d: d["workers"][0]["settings"].update(load_mode="bogus"), r"plan JSON: workers\[0\]\.settings: "),
    (lambda d: d["workers"][0].update(env={"A": 1}), r"plan JSON: workers\[0\]\.env: not an object of strings"),
])
def test_a_bad_document_is_one_line_naming_the_field(document, change, message):
    _, doc = document
    data = json.loads(json.dumps(doc.to_dict()))
    change(data)
    with pytest.raises(ConfigError, match=message) as e:
        PlanDocument.from_dict(data)
    assert "\n" not in str(e.value)
