"""The GGUF reader against the reference reader (gguf.GGUFReader) on files from the project's writer: same
tensors, shapes, types, sizes, offsets; then what it derives from them."""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from orchestrator.errors import ModelError
from orchestrator.model import TensorClass, read_model
from lab.calibmodels import build
from orchestrator.model.reader import read_gguf

ARCHS = ("deepseek2", "gpt-oss", "llama", "qwen3moe")


@pytest.mark.parametrize("arch", ARCHS)
def test_index_matches_reference_reader(tiny_models, arch):
    path = tiny_models[arch]
    m = read_model(path)
    ref = gguf.GGUFReader(path)
    assert [t.name for t in m.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(m.tensors, ref.tensors):
        assert list(t.shape) == [int(x) for x in r.shape], t.name
        assert t.type == r.tensor_type.name, t.name
        assert t.bytes == int(r.n_bytes), t.name
        assert t.n_elements == int(r.n_elements), t.name
        assert t.offset == int(r.data_offset), t.name
    g = read_gguf(path)
    for key in ("general.architecture", f"{m.arch}.block_count", f"{m.arch}.embedding_length",
                "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id"):
        field = ref.fields[key]
        assert g.metadata[key] == field.contents(), key
    assert len(g.metadata["tokenizer.ggml.tokens"]) == len(ref.fields["tokenizer.ggml.tokens"].data)


def test_qwen3moe_hparams_and_classes(tiny_models, tiny_specs):
    spec = tiny_specs["qwen3moe"]
    m = read_model(tiny_models["qwen3moe"])
    assert (m.arch, m.n_layers, m.n_embd, m.n_head, m.n_head_kv) == ("qwen3moe", 3, 64, 4, 2)
    assert (m.head_dim_k, m.head_dim_v, m.n_expert, m.n_expert_used, m.n_ff_exp) == (32, 32, 8, 2, 32)
    assert (m.n_vocab, m.n_ctx_train, m.mla, m.swa_layers, m.n_nextn_layers) == (320, 4096, None, (), 0)
    assert m.moe_layers == (0, 1, 2) and m.n_dense_lead == 0
    assert m.name == spec.like
    cls = {t.name: t.cls for t in m.tensors}
    assert cls["token_embd.weight"] is TensorClass.EMBEDDINGS
    assert cls["output.weight"] is TensorClass.OUTPUT
    assert cls["output_norm.weight"] is TensorClass.NORM
    assert cls["blk.1.attn_q.weight"] is TensorClass.ATTENTION
    assert cls["blk.1.attn_k_norm.weight"] is TensorClass.NORM
    assert cls["blk.1.ffn_gate_inp.weight"] is TensorClass.ROUTER
    assert cls["blk.1.ffn_down_exps.weight"] is TensorClass.ROUTED_EXPERT
    # experts: 3 tensors of E*F*X Q4_0 per layer
    per_layer = 3 * (64 * 32 * 8 // 32 * 18)
    assert m.expert_bytes(1) == per_layer
    assert m.bytes_per_expert(1) == per_layer // 8
    assert sum(m.bytes_by_class().values()) == sum(t.bytes for t in m.tensors) == m.weights_bytes
    assert sum(sum(m.layer_bytes(i).values()) for i in range(3)) + sum(m.global_bytes().values()) == m.weights_bytes
    # active parameters: everything but the experts, plus 2 of 8 experts
    routed = sum(t.n_elements for t in m.tensors if t.cls is TensorClass.ROUTED_EXPERT)
    embd = m.tensor("token_embd.weight").n_elements
    assert m.params_total == sum(t.n_elements for t in m.tensors)
    assert m.params_active == m.params_total - embd - routed + routed * 2 // 8


def test_deepseek2_mla_dense_lead_shared_experts(tiny_models):
    m = read_model(tiny_models["deepseek2"])
    assert m.arch == "deepseek2" and m.n_head_kv == 1
    assert m.mla is not None
    assert (m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.qk_rope_head_dim) == (32, 32, 32)
    assert (m.mla.k_head_dim, m.mla.v_head_dim, m.mla.qk_nope_head_dim) == (64, 32, 32)
    assert (m.head_dim_k, m.head_dim_v) == (64, 32)        # the cache widths: latent + rope, latent
    assert m.n_dense_lead == 1 and m.moe_layers == (1, 2) and m.dense_layers == (0,)
    assert m.n_expert_shared == 1
    by = {t.name: t.cls for t in m.tensors}
    assert by["blk.0.ffn_up.weight"] is TensorClass.DENSE_FFN
    assert by["blk.1.ffn_up_shexp.weight"] is TensorClass.SHARED_EXPERT
    assert by["blk.1.exp_probs_b.bias"] is TensorClass.ROUTER
    assert by["blk.1.attn_kv_a_mqa.weight"] is TensorClass.ATTENTION
    assert by["blk.1.attn_k_b.weight"] is TensorClass.ATTENTION
    assert by["blk.1.attn_kv_a_norm.weight"] is TensorClass.NORM
    assert m.layer_bytes(0)[TensorClass.ROUTED_EXPERT] == 0 and m.layer_bytes(0)[TensorClass.DENSE_FFN] > 0
    assert m.bytes_per_expert(0) == 0 or m.expert_bytes(0) == 0


def test_gpt_oss_sliding_window_layers_and_expert_biases(tiny_models):
    m = read_model(tiny_models["gpt-oss"])
    assert m.sliding_window == 128
    assert m.swa_layers == (0, 2)          # llama.cpp: pattern 2, layer il is SWA when il % 2 < 1
    assert m.is_swa(0) and not m.is_swa(1)
    biases = [t for t in m.tensors if t.name.endswith("_exps.bias")]
    assert biases and all(t.cls is TensorClass.ROUTED_EXPERT for t in biases)
    assert m.tensor("blk.0.attn_sinks.weight").cls is TensorClass.ATTENTION
    assert m.tensor("blk.0.ffn_gate_inp.bias").cls is TensorClass.ROUTER


def test_dense_llama_has_no_experts(tiny_models):
    m = read_model(tiny_models["llama"])
    assert (m.n_expert, m.n_expert_used, m.moe_layers) == (0, 0, ())
    assert m.params_active == m.params_total - m.tensor("token_embd.weight").n_elements
    assert m.bytes_by_class()[TensorClass.DENSE_FFN] > 0


def test_json_schema(tiny_models):
    j = read_model(tiny_models["qwen3moe"]).to_json()
    for key in ("arch", "n_layers", "n_experts", "n_experts_used", "tensors", "totals", "params_total",
                "params_active", "moe_layers", "schema"):
        assert key in j
    t = j["tensors"][0]
    assert set(t) >= {"name", "class", "layer", "bytes", "type"}
    assert set(j["totals"]) == {c.value for c in TensorClass}
    assert sum(j["totals"].values()) == j["total_bytes"] == sum(x["bytes"] for x in j["tensors"])


def test_sharded_model_reads_as_one_from_any_shard(write_model, tiny_specs):
    paths = write_model(tiny_specs["qwen3moe"], "split.gguf", split_max_tensors=10)
    assert len(paths) == 4
    whole = read_model(paths[0])
    assert read_model(paths[2]).tensors == whole.tensors
    assert whole.paths == tuple(str(p) for p in paths)
    assert {t.shard for t in whole.tensors} == {0, 1, 2, 3}
    assert whole.file_bytes == sum(p.stat().st_size for p in paths)
    assert len(whole.tensors) == len(build(tiny_specs["qwen3moe"])[1])


def test_missing_shard_is_named(write_model, tiny_specs):
    paths = write_model(tiny_specs["qwen3moe"], "split.gguf", split_max_tensors=10)
    paths[2].unlink()
    with pytest.raises(ModelError) as e:
        read_model(paths[0])
    assert str(paths[2]) in str(e.value) and "missing shard 3 of 4" in str(e.value)


def test_mismatched_shard_is_named(write_model, tiny_specs):
    paths = write_model(tiny_specs["qwen3moe"], "a.gguf", split_max_tensors=10)
    other = write_model(tiny_specs["qwen3moe"], "b.gguf", split_max_tensors=20)     # 2 shards
    # put shard 2 of the 2-shard model in place of shard 2 of the 4-shard model
    paths[1].write_bytes(other[1].read_bytes())
    with pytest.raises(ModelError) as e:
        read_model(paths[0])
    assert str(paths[1]) in str(e.value) and "mismatched shard" in str(e.value)


def test_missing_expert_count_is_inferred_with_a_warning(write_model, tiny_specs, caplog):
    def drop(md):
        del md["qwen3moe.expert_count"]
    (path,) = write_model(tiny_specs["qwen3moe"], metadata_edit=drop)
    m = read_model(path)
    assert m.n_expert == 8
    assert len(m.warnings) == 1 and str(path) in m.warnings[0] and "inferred 8 experts" in m.warnings[0]


def test_zero_expert_count_is_inferred(write_model, tiny_specs):
    def zero(md):
        md["qwen3moe.expert_count"] = 0
    (path,) = write_model(tiny_specs["qwen3moe"], metadata_edit=zero)
    assert read_model(path).n_expert == 8


def test_expert_used_larger_than_count_is_an_error(write_model, tiny_specs):
    def bad(md):
        md["qwen3moe.expert_used_count"] = 9
    (path,) = write_model(tiny_specs["qwen3moe"], metadata_edit=bad)
    with pytest.raises(ModelError, match=r"expert_used_count \(9\) is larger than .*expert_count \(8\)"):
        read_model(path)


def test_nextn_layers_are_other_and_not_loaded(write_model, tiny_specs):
    spec = dataclasses.replace(tiny_specs["deepseek2"], n_layer=4)

    def mtp(md):
        md["deepseek2.nextn_predict_layers"] = 1
    (path,) = write_model(spec, metadata_edit=mtp)
    m = read_model(path)
    assert m.n_layers == 4 and m.n_nextn_layers == 1 and m.n_trunk_layers == 3
    assert all(t.cls is TensorClass.OTHER for t in m.tensors if t.layer == 3)
    nextn = sum(t.bytes for t in m.tensors if t.layer == 3)
    assert m.loaded_bytes() == m.weights_bytes - nextn
    assert m.loaded_bytes(mtp=True) == m.weights_bytes
    assert 3 not in m.moe_layers
