"""Shapes of the synthetic models: tensor sets, sizes and the rules that keep a scaled model loadable."""

from __future__ import annotations

import pytest

from orchestrator.errors import ModelError
from orchestrator.model import shapes as S

SCALES = (0.01, 0.03, 0.05, 0.1, 0.125, 0.25, 0.5, 1.0)


def test_qwen3_30b_full_size_matches_the_real_q4_0_file():
    s = S.get("qwen3-30b-a3b")
    specs = S.tensor_specs(s, "q4_0")
    # the real Qwen3-30B-A3B GGUF has 579 tensors: 12 per layer x 48 + token_embd, output_norm, output
    assert len(specs) == 579
    by = {t.name: t for t in specs}
    assert by["blk.0.ffn_gate_exps.weight"].ne == (2048, 768, 128)
    assert by["blk.0.ffn_down_exps.weight"].ne == (768, 2048, 128)
    assert by["blk.47.attn_q.weight"].ne == (2048, 4096)
    assert by["blk.47.attn_k.weight"].ne == (2048, 512)
    assert by["blk.0.attn_output.weight"].ne == (4096, 2048)
    assert by["blk.0.attn_q_norm.weight"].ne == (128,)
    assert by["token_embd.weight"].ne == (2048, 151936)
    # llama-quantize keeps norms and the router in F32 and gives output.weight Q6_K
    assert by["blk.3.ffn_gate_inp.weight"].type == "f32"
    assert by["blk.3.ffn_norm.weight"].type == "f32"
    assert by["output.weight"].type == "q6_k"
    assert by["token_embd.weight"].type == "q4_0"
    size = S.total_bytes(specs)
    assert 17.0e9 < size < 17.6e9   # the real Qwen3-30B-A3B-Q4_0.gguf is ~17.4 GB


def test_deepseek_v3_has_mla_dense_leading_layers_and_shared_expert():
    s = S.get("deepseek-v3")
    specs = S.tensor_specs(s, "q4_0")
    names = {t.name: t for t in specs}
    assert len(specs) == 1086
    for i in range(3):  # leading dense layers
        assert f"blk.{i}.ffn_gate.weight" in names and f"blk.{i}.ffn_gate_exps.weight" not in names
    assert names["blk.0.ffn_gate.weight"].ne == (7168, 18432)
    assert names["blk.3.ffn_gate_exps.weight"].ne == (7168, 2048, 256)
    assert names["blk.3.ffn_gate_shexp.weight"].ne == (7168, 2048)
    assert names["blk.3.exp_probs_b.bias"].ne == (256,)
    assert names["blk.3.exp_probs_b.bias"].type == "f32"
    assert names["blk.60.attn_q_a.weight"].ne == (7168, 1536)
    assert names["blk.60.attn_q_b.weight"].ne == (1536, 128 * 192)
    assert names["blk.60.attn_kv_a_mqa.weight"].ne == (7168, 512 + 64)
    assert names["blk.60.attn_k_b.weight"].ne == (128, 512, 128)
    assert names["blk.60.attn_v_b.weight"].ne == (512, 128, 128)
    assert names["blk.60.attn_output.weight"].ne == (128 * 128, 7168)
    kv = {k: v for k, v, _ in S.metadata(s)}
    assert kv["deepseek2.expert_gating_func"] == 2          # sigmoid
    assert kv["deepseek2.expert_group_count"] == 8
    assert kv["deepseek2.expert_group_used_count"] == 4
    assert kv["deepseek2.leading_dense_block_count"] == 3
    assert kv["deepseek2.attention.key_length_mla"] == 192
    assert kv["deepseek2.attention.head_count_kv"] == 1
    assert kv["deepseek2.expert_weights_scale"] == 2.5
    assert kv["deepseek2.expert_weights_norm"] is True


def test_gpt_oss_has_mxfp4_experts_sinks_biases_and_sliding_window():
    s = S.get("gpt-oss-120b")
    specs = {t.name: t for t in S.tensor_specs(s, "q8_0")}
    assert specs["blk.0.ffn_up_exps.weight"].type == "mxfp4"
    assert specs["blk.0.ffn_up_exps.weight"].ne == (2880, 2880, 128)
    assert specs["blk.0.attn_sinks.weight"].ne == (64,)
    assert specs["blk.0.ffn_down_exps.bias"].ne == (2880, 128)
    assert specs["blk.35.attn_q.weight"].ne == (2880, 64 * 64)
    assert specs["output.weight"].type == "q8_0"  # 2880 is not a multiple of 256: llama-quantize falls back
    kv = {k: v for k, v, _ in S.metadata(s, "q8_0")}
    assert kv["gpt-oss.attention.sliding_window"] == 128
    assert kv["general.file_type"] == 38  # MOSTLY_MXFP4_MOE


def test_expert_quant_changes_the_routed_experts_only():
    base = S.scaled(S.get("gpt-oss-20b"), layers=4)
    q4x = S.with_expert_quant(base, "q4_0")
    a = {t.name: t for t in S.tensor_specs(base)}
    b = {t.name: t for t in S.tensor_specs(q4x)}
    assert a.keys() == b.keys()
    changed = {n for n in a if a[n].type != b[n].type}
    assert changed == {f"blk.{i}.ffn_{k}_exps.weight" for i in range(4) for k in ("gate", "up", "down")}
    assert {b[n].type for n in changed} == {"q4_0"} and {a[n].type for n in changed} == {"mxfp4"}
    assert b["blk.0.attn_q.weight"].type == "q8_0" and b["blk.0.ffn_down_exps.bias"].type == "f32"
    # Q4_0 blocks are one byte larger than MXFP4's: 18 against 17 bytes per 32 weights
    exp = [n for n in changed]
    assert sum(b[n].nbytes for n in exp) * 17 == sum(a[n].nbytes for n in exp) * 18
    kv = {k: v for k, v, _ in S.metadata(q4x)}
    assert kv["general.file_type"] == S.FILE_TYPE["q8_0"]
    # and the other way: Qwen3's experts in MXFP4, the file then typed as llama-quantize's MXFP4_MOE
    mx = S.with_expert_quant(S.scaled(S.get("qwen3-30b-a3b"), 0.1), "mxfp4")
    specs = S.tensor_specs(mx, "q4_0")
    assert {t.type for t in specs if t.is_expert} == {"mxfp4"}
    assert {k: v for k, v, _ in S.metadata(mx, "q4_0")}["general.file_type"] == S.FILE_TYPE["mxfp4_moe"]
    assert S.with_expert_quant(base, None) is base
    with pytest.raises(ModelError, match=r"--expert-quant 'q5_0': expected one of q4_0, q8_0, mxfp4"):
        S.with_expert_quant(base, "q5_0")


def test_qwen3_235b_per_layer_size_and_layers_override():
    full = S.get("qwen3-235b-a22b")
    s30 = S.scaled(full, 1.0, layers=30)
    assert (s30.n_embd, s30.n_layer, s30.n_expert) == (4096, 30, 128)
    one = S.total_bytes(S.tensor_specs(S.scaled(full, layers=1)))
    two = S.total_bytes(S.tensor_specs(S.scaled(full, layers=2)))
    per_layer = two - one
    assert 1.3e9 < per_layer < 1.5e9
    assert S.total_bytes(S.tensor_specs(s30)) == one + 29 * per_layer


@pytest.mark.parametrize("like", S.names())
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("quant", S.QUANTS)
def test_scaled_shapes_stay_loadable(like, scale, quant):
    s = S.scaled(S.get(like), scale)
    real = S.get(like)
    specs = S.tensor_specs(s, quant)
    for t in specs:
        blk = S.BLOCK[t.type][0]
        assert t.ne[0] % blk == 0, (t.name, t.ne, t.type)
        assert all(d > 0 for d in t.ne)
    assert len({t.name for t in specs}) == len(specs)
    assert s.n_head % s.n_head_kv == 0
    assert s.n_expert == real.n_expert and s.n_expert_used == real.n_expert_used
    assert s.n_expert >= s.n_expert_used
    assert s.head_dim == real.head_dim and s.kv_lora_rank == real.kv_lora_rank and s.qk_rope_dim == real.qk_rope_dim
    assert s.n_layer >= 2
    if real.n_dense_lead:
        assert 1 <= s.n_dense_lead < s.n_layer
    if real.sliding_window:
        assert s.n_layer % 2 == 0
    if scale == 1.0:
        assert s == real
    else:
        assert s.n_embd <= real.n_embd and s.n_layer <= real.n_layer and s.n_vocab <= real.n_vocab
    # every special token fits the (possibly shrunk) vocabulary
    for sp in s.specials:
        assert 0 <= sp.token_id(s.n_vocab) < s.n_vocab


def test_full_size_special_token_ids_are_the_real_ones():
    def ids(like):
        s = S.get(like)
        return {sp.text: sp.token_id(s.n_vocab) for sp in s.specials}
    assert ids("qwen3-30b-a3b")["<|im_end|>"] == 151645
    assert ids("qwen3-30b-a3b")["<|endoftext|>"] == 151643
    assert ids("deepseek-v3")["<｜end▁of▁sentence｜>"] == 1
    assert ids("deepseek-v3")["<｜Assistant｜>"] == 128804
    assert ids("gpt-oss-120b")["<|return|>"] == 200002
    assert ids("gpt-oss-120b")["<|startoftext|>"] == 199998


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ModelError) as e:
        S.get("llama-4-maverick")
    msg = str(e.value)
    assert "llama-4-maverick" in msg
    for name in S.names():
        assert name in msg
    assert "\n" not in msg


def test_aliases():
    assert S.get("DeepSeek-R1").like == "deepseek-v3"
    assert S.get("qwen3-30b").like == "qwen3-30b-a3b"


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_scale_out_of_range(bad):
    with pytest.raises(ModelError, match="--scale"):
        S.scaled(S.get("qwen3-30b-a3b"), bad)


def test_bad_layers():
    with pytest.raises(ModelError, match="--layers"):
        S.scaled(S.get("qwen3-30b-a3b"), layers=0)
    with pytest.raises(ModelError, match="even"):
        S.scaled(S.get("gpt-oss-120b"), layers=3)
    # deepseek keeps at least one leading dense layer and one MoE layer
    s = S.scaled(S.get("deepseek-v3"), layers=2)
    assert (s.n_layer, s.n_dense_lead) == (2, 1)
    s = S.scaled(S.get("deepseek-v3"), layers=10)
    assert (s.n_layer, s.n_dense_lead) == (10, 3)
    with pytest.raises(ModelError, match="at least 2 layers"):
        S.scaled(S.get("deepseek-v3"), layers=1)


def test_bad_quant():
    with pytest.raises(ModelError, match="--quant"):
        S.tensor_specs(S.get("qwen3-30b-a3b"), "q2_k")


def test_default_quant_follows_the_released_files():
    # gpt-oss ships MXFP4 experts with Q8_0 around them (llama-quantize MXFP4_MOE); the others default to Q4_0
    g = S.get("gpt-oss-120b")
    types = {t.type for t in S.tensor_specs(g) if t.type != "f32"}
    assert types == {"mxfp4", "q8_0"}
    q = S.get("qwen3-30b-a3b")
    assert {t.type for t in S.tensor_specs(q) if t.type != "f32"} == {"q4_0", "q6_k"}
    assert dict((k, v) for k, v, _ in S.metadata(q))["general.file_type"] == 2
