"""Tensor classes from names (llama.cpp's names, src/llama-arch.cpp)."""

import re

import pytest

from orchestrator.model.classes import TensorClass as C, classify, split_layer

CASES = [
    ("token_embd.weight", C.EMBEDDINGS, None),
    ("per_layer_token_embd.weight", C.EMBEDDINGS, None),
    ("output.weight", C.OUTPUT, None),
    ("output_norm.weight", C.NORM, None),
    ("rope_freqs.weight", C.OTHER, None),
    ("blk.0.attn_norm.weight", C.NORM, 0),
    ("blk.7.attn_q.weight", C.ATTENTION, 7),
    ("blk.7.attn_q.bias", C.ATTENTION, 7),
    ("blk.7.attn_qkv.weight", C.ATTENTION, 7),
    ("blk.7.attn_output.weight", C.ATTENTION, 7),
    ("blk.7.attn_sinks.weight", C.ATTENTION, 7),
    ("blk.7.attn_q_norm.weight", C.NORM, 7),
    ("blk.3.attn_q_a.weight", C.ATTENTION, 3),
    ("blk.3.attn_q_b.weight", C.ATTENTION, 3),
    ("blk.3.attn_kv_a_mqa.weight", C.ATTENTION, 3),
    ("blk.3.attn_kv_b.weight", C.ATTENTION, 3),
    ("blk.3.attn_k_b.weight", C.ATTENTION, 3),
    ("blk.3.attn_v_b.weight", C.ATTENTION, 3),
    ("blk.3.attn_kv_a_norm.weight", C.NORM, 3),
    ("blk.3.ffn_gate_inp.weight", C.ROUTER, 3),
    ("blk.3.ffn_gate_inp.bias", C.ROUTER, 3),
    ("blk.3.exp_probs_b.bias", C.ROUTER, 3),
    ("blk.3.ffn_up_exps.weight", C.ROUTED_EXPERT, 3),
    ("blk.3.ffn_gate_exps.weight", C.ROUTED_EXPERT, 3),
    ("blk.3.ffn_down_exps.weight", C.ROUTED_EXPERT, 3),
    ("blk.3.ffn_gate_up_exps.weight", C.ROUTED_EXPERT, 3),
    ("blk.3.ffn_down_exps.bias", C.ROUTED_EXPERT, 3),
    ("blk.3.ffn_up_chexps.weight", C.ROUTED_EXPERT, 3),
    ("blk.3.ffn_up_shexp.weight", C.SHARED_EXPERT, 3),
    ("blk.3.ffn_gate_inp_shexp.weight", C.SHARED_EXPERT, 3),
    ("blk.0.ffn_up.weight", C.DENSE_FFN, 0),
    ("blk.0.ffn_gate.weight", C.DENSE_FFN, 0),
    ("blk.0.ffn_down.weight", C.DENSE_FFN, 0),
    ("blk.0.ffn_norm.weight", C.NORM, 0),
    ("blk.0.post_attention_norm.weight", C.NORM, 0),
    ("blk.61.nextn.eh_proj.weight", C.OTHER, 61),
    ("blk.0.ssm_in.weight", C.OTHER, 0),
]


@pytest.mark.parametrize("name,cls,layer", CASES)
def test_classify(name, cls, layer):
    assert classify(name) == (cls, layer)


def test_nextn_layers_are_other():
    assert classify("blk.61.ffn_up_exps.weight", nextn_from=61) == (C.OTHER, 61)
    assert classify("blk.60.ffn_up_exps.weight", nextn_from=61) == (C.ROUTED_EXPERT, 60)


def test_routed_class_is_exactly_llama_cpp_cpu_moe_regex():
    # llama.cpp's --cpu-moe pattern; our ROUTED_EXPERT must be what it moves (weights and biases)
    cpu_moe = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")
    for name, cls, _ in CASES:
        assert (cls is C.ROUTED_EXPERT) == bool(cpu_moe.search(name)), name


def test_split_layer():
    assert split_layer("blk.12.ffn_up_exps.weight") == (12, "ffn_up_exps.weight")
    assert split_layer("output.weight") == (None, "output.weight")
    assert str(C.ROUTED_EXPERT) == "routed_expert"
