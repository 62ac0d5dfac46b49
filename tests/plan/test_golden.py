"""Golden files of the exact commands `orchestrator plan` prints (and `up` runs) for each example topology x
model shape. Regenerate after an intended change with ORCHESTRATOR_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from planfixtures import shape_model

from orchestrator.paths import REPO_ROOT
from orchestrator.resolve import nominal_backend, resolve

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = [  # (topology, model shape, quant, flavor, overrides): 1, 2, 4 and 8 GPUs
    ("1socket-1gpu-24g", "qwen3-30b-a3b", "q8_0", "mainline", {}),
    ("1socket-1gpu-24g", "qwen3-30b-a3b", "q4_0", "mainline", {}),
    ("2socket-2gpu", "qwen3-235b-a22b", "q4_0", "mainline", {}),
    ("2socket-2gpu", "gpt-oss-120b", "q8_0", "mainline", {}),
    ("2socket-8gpu", "deepseek-v3", "q4_0", "mainline", {}),
    ("2socket-8gpu", "qwen3-235b-a22b", "q4_0", "mainline", {}),
    ("2socket-8gpu", "deepseek-v3", "q4_0", "ik_llama.cpp", {}),
    ("2socket-8gpu", "qwen3-235b-a22b", "q4_0", "mainline", {"nodes.0.gpus": [0, 1, 2, 3]}),
    ("2socket-8gpu", "deepseek-v3", "q4_0", "mainline", {"workers.layout": "gpu-group"}),
    ("2socket-8gpu", "qwen3-235b-a22b", "q4_0", "mainline", {"nodes.0.vram_limit": "12GiB"}),
    # the recorded two-H200 machine under a VRAM limit per GPU: -sm layer with the expert cache split by layers
    # (like@N: the shape cut to N layers)
    ("h200", "qwen3-235b-a22b@24", "q4_0", "mainline", {"nodes.0.machine": "tests/fixtures/machines/h200x2.tar.gz",
                                                         "nodes.0.vram_limit": "12GiB"}),
    ("h200", "qwen3-30b-a3b", "q4_0", "mainline", {"nodes.0.machine": "tests/fixtures/machines/h200x2.tar.gz",
                                                    "nodes.0.vram_limit": "6GiB"}),
    # the demo's two CPU replicas on recorded machines of several NUMA nodes: one replica per node, each on its
    # node's cores and memory (the two-node guest of tests/vm, and a two-socket Xeon)
    ("demo", "qwen3-30b-a3b@1", "q4_0", "mainline", {"nodes.0.machine": "tests/fixtures/machines/numa-guest.tar.gz"}),
    ("demo", "qwen3-30b-a3b@8", "q4_0", "mainline",
     {"nodes.0.machine": "tests/fixtures/sysfs/32em64t-2n8c+dax+nvme+mic+dimms.tar.bz2"}),
    # 4 sockets x 2 nodes, the layout left to the plan: one replica per node (the demo's two replicas would
    # each get two sockets)
    ("demo", "qwen3-30b-a3b@8", "q4_0", "mainline",
     {"nodes.0.machine": "tests/fixtures/sysfs/64amd64-4s2n4ca2co.tar.bz2", "workers.layout": "auto",
      "workers.replicas": "auto", "nodes.0.ram_reserve": "2GiB"}),
]


def render(res, model_path: Path) -> str:
    out = []
    for w, spec in zip(res.plan.workers, res.specs):
        out.append(f"# worker {w.name} ({w.node}) gpus={','.join(map(str, w.gpus)) or '-'}")
        for k, v in sorted(spec.env.items()):
            out.append(f"env {k}={v}")
        for a in spec.argv:
            out.append(a.replace(str(model_path), "<MODEL>").replace(str(REPO_ROOT), "<REPO>"))
        out.append("")
    return "\n".join(out)


def _case_id(case) -> str:
    topology, like, quant, flavor, over = case
    extra = "".join(f"__{k.split('.')[-1]}={_id_value(k, v)}" for k, v in over.items())
    return f"{topology}__{like}-{quant}__{flavor}{extra}"


def _id_value(key: str, value) -> str:
    if isinstance(value, list):
        return "-".join(map(str, value))
    if key.endswith(".machine"):
        return Path(value).name.split(".")[0]        # a recorded machine: its name
    return str(value)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_golden_commands(case, model_dir):
    topology, like, quant, flavor, over = case
    like, _, layers = like.partition("@")
    model = shape_model(model_dir, like, quant, layers=int(layers) if layers else None)
    # a recorded machine is named from the repository root (overrides are read from the working directory)
    over = {k: str(REPO_ROOT / v) if k.endswith(".machine") else v for k, v in over.items()}
    res = resolve(REPO_ROOT / "topologies" / f"{topology}.yaml", overrides={"model.path": model.paths[0], **over},
                  backend=nominal_backend(flavor, cuda=True))
    text = render(res, Path(model.paths[0]))
    golden = GOLDEN / f"{_case_id(case)}.txt"
    if os.environ.get("ORCHESTRATOR_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"missing golden file {golden} (ORCHESTRATOR_UPDATE_GOLDEN=1 writes it)"
    assert text == golden.read_text(), f"commands differ from {golden.name} (ORCHESTRATOR_UPDATE_GOLDEN=1 to accept)"
