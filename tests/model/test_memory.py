"""The memory model's rules, computed by hand from llama.cpp's (src/llama-context.cpp, src/llama-kv-cache*.cpp)."""

from __future__ import annotations

import dataclasses

import pytest

from orchestrator.model import TensorClass, read_model
from orchestrator.model.memory import (MiB, LayerOffload, ServerSettings, compute_buffer_estimate, context_layout,
                                       cuda_tensor_bytes, kv_bytes_per_token, kv_cache_bytes,
                                       kv_cache_bytes_by_layer, offloaded_weight_bytes, predict_memory)


@pytest.fixture(scope="module")
def models(tiny_models):
    return {k: read_model(v) for k, v in tiny_models.items()}


def test_ctx_is_padded_to_256(models):
    m = models["qwen3moe"]                   # 3 layers, 2 KV heads x 32
    lay = context_layout(m, 1000)
    assert (lay.n_ctx, lay.n_ctx_seq, lay.n_stream, lay.cells_full) == (1024, 1024, 1, 1024)
    assert kv_cache_bytes(m, 1000) == 3 * 1024 * (64 + 64) * 2


def test_parallel_sequences_get_their_own_padded_streams(models):
    m = models["qwen3moe"]
    lay = context_layout(m, 1000, 3)         # 1024 / 3 = 341 -> 512 cells per stream, n_ctx becomes 1536
    assert (lay.n_ctx, lay.n_ctx_seq, lay.n_stream) == (1536, 512, 3)
    assert kv_cache_bytes(m, 1000, 3) == 3 * 512 * 3 * (64 + 64) * 2
    uni = context_layout(m, 1000, 3, kv_unified=True)
    assert (uni.n_ctx, uni.n_ctx_seq, uni.n_stream) == (1024, 1024, 1)
    assert kv_cache_bytes(m, 1000, 3, kv_unified=True) == 3 * 1024 * (64 + 64) * 2


def test_quantized_cache_rows(models):
    m = models["qwen3moe"]
    q8_row = 64 // 32 * 34
    assert kv_cache_bytes(m, 1024, type_k="q8_0", type_v="q8_0") == 3 * 1024 * 2 * q8_row
    assert kv_cache_bytes(m, 1024, type_k="q8_0", type_v="f16") == 3 * 1024 * (q8_row + 128)


def test_mla_caches_the_latent_only(models):
    m = models["deepseek2"]                  # kv_lora 32 + rope 32, one KV head, 3 layers
    assert kv_cache_bytes(m, 2048) == 3 * 2048 * 64 * 2
    assert kv_bytes_per_token(m) == 3 * 64 * 2
    with pytest.raises(ValueError, match="type_k and type_v must be the same"):
        kv_cache_bytes(m, 2048, type_k="q8_0", type_v="f16")


def test_sliding_window_layers(models):
    m = models["gpt-oss"]                    # window 128, layers 0 and 2 SWA, 2 KV heads x 32
    per_cell = (64 + 64) * 2
    lay = context_layout(m, 8192, n_ubatch=512)
    assert lay.cells_swa == 768              # pad256(min(8192, 128 + 512))
    by = kv_cache_bytes_by_layer(m, 8192, n_ubatch=512)
    assert by == {0: 768 * per_cell, 1: 8192 * per_cell, 2: 768 * per_cell, 3: 8192 * per_cell}
    # the micro-batch is at most n_batch (llama-server's default 2048)
    assert context_layout(m, 8192, n_ubatch=4096).cells_swa == 2304
    assert context_layout(m, 8192, n_ubatch=4096, n_batch=4096).cells_swa == 4352
    # unified: the window is per sequence
    assert context_layout(m, 8192, 4, n_ubatch=512, kv_unified=True).cells_swa == pad256(128 * 4 + 512)
    # non-unified: per stream
    assert context_layout(m, 8192, 4, n_ubatch=512).cells_swa == 768
    assert context_layout(m, 8192, swa_full=True).cells_swa == 8192
    assert kv_bytes_per_token(m) == 2 * per_cell


def pad256(x):
    return (x + 255) // 256 * 256


def test_layers_subset_and_nextn_excluded(write_model, tiny_specs):
    spec = dataclasses.replace(tiny_specs["qwen3moe"], n_layer=4)

    def mtp(md):
        md["qwen3moe.nextn_predict_layers"] = 1
    (path,) = write_model(spec, metadata_edit=mtp)
    m = read_model(path)
    per_layer = 1024 * 128 * 2
    assert kv_cache_bytes(m, 1024) == 3 * per_layer          # the MTP block has no cache
    assert kv_cache_bytes(m, 1024, layers=[0, 2, 3]) == 2 * per_layer


def test_v_is_padded_to_the_widest_layer_without_flash_attention(write_model, tiny_specs):
    def varying(md):
        md["qwen3moe.attention.head_count_kv"] = [2, 1, 2]
    (path,) = write_model(tiny_specs["qwen3moe"], metadata_edit=varying)
    m = read_model(path)
    assert m.n_head_kv_layers == (2, 1, 2)
    fa = kv_cache_bytes_by_layer(m, 256)
    nofa = kv_cache_bytes_by_layer(m, 256, flash_attn=False)
    assert fa[1] == 256 * (32 + 32) * 2
    assert nofa[1] == 256 * (32 + 64) * 2     # V row padded to 2 heads


def test_compute_masks_scores_and_outputs(models, write_model, tiny_specs):
    m = models["qwen3moe"]
    fa = compute_buffer_estimate(m, n_ubatch=512, n_ctx=4096)
    assert fa.masks == 512 * 4096 * 2         # f16 mask [n_kv, T]
    nofa = compute_buffer_estimate(m, n_ubatch=512, n_ctx=4096, flash_attn=False)
    assert nofa.masks == 512 * 4096 * 4       # f32 without flash attention
    assert nofa.scores == 512 * 4096 * m.n_head * 4
    # activations are linear in the micro-batch
    big = compute_buffer_estimate(m, n_ubatch=1024, n_ctx=4096)
    assert big.activations == 2 * fa.activations
    # one output per micro-batch token (llama-fit-params, ik_llama.cpp): the logits dominate
    (path,) = write_model(dataclasses.replace(tiny_specs["qwen3moe"], n_vocab=32000))
    big_vocab = read_model(path)
    out = compute_buffer_estimate(big_vocab, n_ubatch=512, n_ctx=4096, n_outputs=512)
    assert out.phase == "output" and out.outputs >= 512 * 32000 * 4
    assert compute_buffer_estimate(big_vocab, n_ubatch=512, n_ctx=4096).phase != "output"


def test_cuda_extras(models):
    m = models["qwen3moe"]
    plain = compute_buffer_estimate(m, n_ubatch=512, n_ctx=4096, device="CUDA0")
    q8 = compute_buffer_estimate(m, n_ubatch=512, n_ctx=4096, device="CUDA0", type_k="q8_0", type_v="q8_0")
    assert plain.fa_f16_kv == 0
    assert q8.fa_f16_kv == 4096 * (64 + 64) * 2      # f16 K and V of one layer for the FA kernels
    w = compute_buffer_estimate(m, n_ubatch=512, n_ctx=4096, device="CUDA0", offloaded_weight_bytes=10 * MiB)
    assert w.weight_copy == 10 * MiB
    small = compute_buffer_estimate(m, n_ubatch=16, n_ctx=4096, device="CUDA0", offloaded_weight_bytes=10 * MiB)
    assert small.weight_copy == 0                    # below GGML_OP_OFFLOAD_MIN_BATCH nothing is offloaded
    assert compute_buffer_estimate(m, n_ubatch=512, n_ctx=4096, device="CPU",
                                   offloaded_weight_bytes=10 * MiB).weight_copy == 0


def test_cuda_tensor_padding(models):
    m = models["qwen3moe"]
    t = m.tensor("blk.0.ffn_up_exps.weight")          # Q4_0, rows of 64: padded to 512 elements on CUDA
    assert cuda_tensor_bytes(t) >= t.bytes + 448 // 32 * 18
    f = m.tensor("blk.0.attn_norm.weight")             # F32: no row padding, 128-byte alignment
    assert cuda_tensor_bytes(f) == 256
    experts = [t for t in m.tensors if t.cls is TensorClass.ROUTED_EXPERT and t.layer == 0]
    assert offloaded_weight_bytes(experts) == max(cuda_tensor_bytes(t) for t in experts)


def test_predict_all_on_cpu_adds_up(models):
    m = models["deepseek2"]
    s = ServerSettings(n_ctx=4096, n_ubatch=512)
    p = predict_memory(m, s)
    assert set(p) == {"CPU"}
    cpu = p["CPU"]
    assert cpu.kv == kv_cache_bytes(m, 4096)
    assert cpu.weights >= m.loaded_bytes()
    assert cpu.total == cpu.weights + cpu.kv + cpu.compute + cpu.output


def test_predict_experts_on_host_rest_on_gpu(models):
    m = models["qwen3moe"]
    layers = tuple(range(m.n_layers))
    p = predict_memory(m, ServerSettings(n_ctx=4096, n_ubatch=512),
                       LayerOffload(gpu_layers=layers, cpu_moe_layers=m.moe_layers))
    gpu, cpu = p["CUDA0"], p["CPU"]
    experts = sum(t.bytes for t in m.tensors if t.cls is TensorClass.ROUTED_EXPERT)
    embd = m.tensor("token_embd.weight").bytes
    assert cpu.weights >= experts + embd
    assert gpu.kv == kv_cache_bytes(m, 4096) and cpu.kv == 0
    assert gpu.weights >= m.weights_bytes - experts - embd
    assert gpu.compute > compute_buffer_estimate(m, n_ubatch=512, n_ctx=4096, device="CUDA0").total
    assert gpu.overhead > 0


def test_ik_llama_cpp_layout_by_the_flavor_name_the_planner_passes(models):
    """ik_llama.cpp keeps one unified stream, pads to 32 cells without flash attention and gives sliding-window
    layers the full cache. The planner names the flavor as BackendInfo does ("ik_llama.cpp"): that name selects
    this layout, and a name that is no flavor is a bug, never a silent mainline layout."""
    m = models["qwen3moe"]
    lay = context_layout(m, 1100, 3, flash_attn=False, flavor="ik_llama.cpp")
    assert (lay.n_ctx, lay.n_ctx_seq, lay.n_stream) == (1120, 1120, 1)
    main = context_layout(m, 1100, 3, flash_attn=False, flavor="mainline")
    assert (main.n_ctx, main.n_ctx_seq, main.n_stream) == (1536, 512, 3)
    g = models["gpt-oss"]
    assert context_layout(g, 8192, flavor="ik_llama.cpp").cells_swa == 8192
    with pytest.raises(ValueError):
        context_layout(m, 1024, flavor="ik")
