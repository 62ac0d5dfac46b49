"""Full-size model headers (sparse files): the counts people know these models by."""

import pytest

from orchestrator.model import read_model
from lab.calibmodels import PRESETS, build
from orchestrator.model.writer import write_gguf_split
from orchestrator.model.memory import kv_bytes_per_token


@pytest.mark.parametrize("preset,total,active", [("deepseek-v3", 671.0, 36.6), ("qwen3-235b-a22b", 235.1, 21.6),
                                                 ("gpt-oss-120b", 116.8, 5.1), ("qwen3-30b-a3b", 30.5, 3.0)])
def test_parameter_counts(tmp_path, preset, total, active):
    md, ts = build(PRESETS[preset])
    paths = write_gguf_split(tmp_path / preset, md, ts, 4)
    m = read_model(paths[-1])
    assert round(m.params_total / 1e9, 1) == total
    assert round(m.params_active / 1e9, 1) == active
    assert len(m.paths) == 4


def test_deepseek_v3_shape(tmp_path):
    md, ts = build(PRESETS["deepseek-v3"])
    m = read_model(write_gguf_split(tmp_path / "dsv3", md, ts, 9)[0])
    assert (m.n_layers, m.n_expert, m.n_expert_used, m.n_dense_lead) == (61, 256, 8, 3)
    assert m.moe_layers == tuple(range(3, 61))
    # MLA: 576 halves per token and layer
    assert kv_bytes_per_token(m) == 61 * 576 * 2
    # one routed expert of a layer: gate+up+down 7168 x 2048 at Q4_0
    assert m.bytes_per_expert(10) == 3 * 7168 * 2048 // 32 * 18
