"""Real-architecture GGUF models for memory calibration: the tensor names, shapes and metadata llama.cpp
expects for ``qwen3moe``, ``deepseek2`` (MLA), ``gpt-oss`` (sliding-window attention, MXFP4 experts) and a
dense ``llama``, at the real per-layer widths of a named model with fewer layers and experts when asked.

The shapes are the product's :class:`orchestrator.model.shapes.ModelShape` (the synth-model table, plus a dense
Llama-3.1-8B here). KV-cache and compute-buffer sizes depend on the per-layer widths (heads, head sizes, latent
ranks, window) and on the vocabulary, not on how many experts there are, so a model with real widths and few
layers and experts calibrates the memory model on a small machine; the full presets are for the GPU machine.

The files are written by :mod:`orchestrator.model.writer` with no data (sparse: every weight reads as zero, a
valid value for every type used here), so a 20 GB model is written in a second and takes no disk; llama-server
loads it and decodes a batch with it, which is all memory calibration needs. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from orchestrator.model.shapes import SHAPES, ModelShape
from orchestrator.model.writer import TensorInfo, Typed, write_gguf


@dataclass(frozen=True)
class WeightTypes:
    """The tensor types of a calibration file (the recorded runs used these; gpt-oss's experts are MXFP4)."""

    attn: str = "Q8_0"      # attention, dense and shared-expert FFN
    experts: str = "Q4_0"   # routed experts
    embd: str = "Q8_0"      # token embeddings and output


# Llama-3.1-8B (config.json of meta-llama/Llama-3.1-8B): a dense model, to check the memory model away from MoE
LLAMA_8B = ModelShape(like="llama-8b", arch="llama", title="llama-8b", n_vocab=128256, n_embd=4096, n_layer=32,
                      n_head=32, n_head_kv=8, head_dim=128, n_ff=14336, n_ff_exp=0, n_expert=0, n_expert_used=0,
                      n_ctx_train=131072, rope_freq_base=500000.0, rms_eps=1e-5)

PRESETS: dict[str, ModelShape] = {
    **{like: SHAPES[like] for like in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")},
    # gpt-oss has no dense FFN; the recorded runs' files carry no feed_forward_length
    "gpt-oss-120b": replace(SHAPES["gpt-oss-120b"], n_ff=0),
    LLAMA_8B.like: LLAMA_8B,
}
TYPES: dict[str, WeightTypes] = {"llama-8b": WeightTypes(attn="Q4_0")}

# Every calibration file has this RoPE base and norm epsilon (the recorded runs' files had them; neither changes
# a buffer size).
ROPE_FREQ_BASE = 10000.0
RMS_EPS = 1e-6


def variant(shape: ModelShape, *, layers: int | None = None, experts: int | None = None,
            vocab: int | None = None, embd: int | None = None) -> ModelShape:
    """``shape`` with fewer layers (the leading dense layers kept below the depth), fewer experts (no more used
    than there are), another vocabulary or width."""
    changes: dict[str, Any] = {}
    if layers is not None:
        changes["n_layer"] = layers
        changes["n_dense_lead"] = min(shape.n_dense_lead, max(layers - 1, 0))
    if experts is not None and shape.n_expert:
        changes["n_expert"] = experts
        changes["n_expert_used"] = min(shape.n_expert_used, experts)
    if vocab is not None:
        changes["n_vocab"] = vocab
    if embd is not None:
        changes["n_embd"] = embd
    return replace(shape, **changes)


def build(shape: ModelShape, types: WeightTypes | None = None) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata and tensor index of a model llama.cpp loads as ``shape.arch``."""
    s, a = shape, shape.arch
    types = types or TYPES.get(s.like, WeightTypes())
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": s.like,
        "general.alignment": 32,
        f"{a}.block_count": s.n_layer,
        f"{a}.context_length": s.n_ctx_train,
        f"{a}.embedding_length": s.n_embd,
        f"{a}.attention.head_count": s.n_head,
        f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.attention.layer_norm_rms_epsilon": RMS_EPS,
        f"{a}.rope.freq_base": ROPE_FREQ_BASE,
    }
    if s.n_ff:
        md[f"{a}.feed_forward_length"] = s.n_ff
    if s.n_expert:
        md[f"{a}.expert_count"] = s.n_expert
        md[f"{a}.expert_used_count"] = s.n_expert_used
        md[f"{a}.expert_feed_forward_length"] = s.n_ff_exp
    md.update(spm_vocab(s.n_vocab))

    E, V, bt = s.n_embd, s.n_vocab, types.embd
    ts = [TensorInfo("token_embd.weight", (E, V), bt), TensorInfo("output_norm.weight", (E,), "F32"),
          TensorInfo("output.weight", (E, V), bt)]
    if a == "deepseek2":
        _deepseek2(s, types, md, ts)
    elif a == "gpt-oss":
        _gpt_oss(s, types, md, ts)
    elif a in ("qwen3moe", "qwen3", "llama"):
        _qwen_llama(s, types, md, ts)
    else:
        raise ValueError(f"no calibration template for architecture {a!r}")
    return md, ts


def _moe(s: ModelShape, types: WeightTypes, i: int, ts: list[TensorInfo], *, bias: bool = False) -> None:
    E, F, X = s.n_embd, s.n_ff_exp, s.n_expert
    et = "MXFP4" if s.mxfp4_experts else types.experts
    p = f"blk.{i}."
    ts.append(TensorInfo(p + "ffn_gate_inp.weight", (E, X), "F32"))
    ts.append(TensorInfo(p + "ffn_gate_exps.weight", (E, F, X), et))
    ts.append(TensorInfo(p + "ffn_up_exps.weight", (E, F, X), et))
    ts.append(TensorInfo(p + "ffn_down_exps.weight", (F, E, X), et))
    if bias:
        ts.append(TensorInfo(p + "ffn_gate_inp.bias", (X,), "F32"))
        ts.append(TensorInfo(p + "ffn_gate_exps.bias", (F, X), "F32"))
        ts.append(TensorInfo(p + "ffn_up_exps.bias", (F, X), "F32"))
        ts.append(TensorInfo(p + "ffn_down_exps.bias", (E, X), "F32"))


def _dense(s: ModelShape, types: WeightTypes, i: int, ts: list[TensorInfo]) -> None:
    E, F, at = s.n_embd, s.n_ff, types.attn
    p = f"blk.{i}."
    ts.append(TensorInfo(p + "ffn_gate.weight", (E, F), at))
    ts.append(TensorInfo(p + "ffn_up.weight", (E, F), at))
    ts.append(TensorInfo(p + "ffn_down.weight", (F, E), at))


def _qwen_llama(s: ModelShape, types: WeightTypes, md: dict, ts: list[TensorInfo]) -> None:
    a, E, H, KV, D, at = s.arch, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, types.attn
    md[f"{a}.attention.key_length"] = D
    md[f"{a}.attention.value_length"] = D
    md[f"{a}.rope.dimension_count"] = D
    for i in range(s.n_layer):
        p = f"blk.{i}."
        ts += [TensorInfo(p + "attn_norm.weight", (E,), "F32"),
               TensorInfo(p + "attn_q.weight", (E, H * D), at),
               TensorInfo(p + "attn_k.weight", (E, KV * D), at),
               TensorInfo(p + "attn_v.weight", (E, KV * D), at),
               TensorInfo(p + "attn_output.weight", (H * D, E), at),
               TensorInfo(p + "ffn_norm.weight", (E,), "F32")]
        if a in ("qwen3moe", "qwen3"):
            ts += [TensorInfo(p + "attn_q_norm.weight", (D,), "F32"), TensorInfo(p + "attn_k_norm.weight", (D,), "F32")]
        if s.n_expert:
            _moe(s, types, i, ts)
        else:
            _dense(s, types, i, ts)


def _gpt_oss(s: ModelShape, types: WeightTypes, md: dict, ts: list[TensorInfo]) -> None:
    a, E, H, KV, D, at = s.arch, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, types.attn
    md[f"{a}.attention.key_length"] = D
    md[f"{a}.attention.value_length"] = D
    md[f"{a}.rope.dimension_count"] = D
    md[f"{a}.attention.sliding_window"] = s.sliding_window
    md[f"{a}.rope.scaling.type"] = s.rope_scaling
    md[f"{a}.rope.scaling.factor"] = s.rope_factor
    md[f"{a}.rope.scaling.original_context_length"] = s.rope_orig_ctx
    for i in range(s.n_layer):
        p = f"blk.{i}."
        ts += [TensorInfo(p + "attn_norm.weight", (E,), "F32"),
               TensorInfo(p + "post_attention_norm.weight", (E,), "F32"),
               TensorInfo(p + "attn_q.weight", (E, H * D), at), TensorInfo(p + "attn_q.bias", (H * D,), "F32"),
               TensorInfo(p + "attn_k.weight", (E, KV * D), at), TensorInfo(p + "attn_k.bias", (KV * D,), "F32"),
               TensorInfo(p + "attn_v.weight", (E, KV * D), at), TensorInfo(p + "attn_v.bias", (KV * D,), "F32"),
               TensorInfo(p + "attn_output.weight", (H * D, E), at),
               TensorInfo(p + "attn_output.bias", (E,), "F32"),
               TensorInfo(p + "attn_sinks.weight", (H,), "F32")]
        _moe(s, types, i, ts, bias=True)


def _deepseek2(s: ModelShape, types: WeightTypes, md: dict, ts: list[TensorInfo]) -> None:
    a, E, H, at = s.arch, s.n_embd, s.n_head, types.attn
    q, kv, rope, nope, vh = s.q_lora_rank, s.kv_lora_rank, s.qk_rope_dim, s.qk_nope_dim, s.v_head_dim
    md[f"{a}.attention.head_count_kv"] = 1
    md[f"{a}.attention.key_length"] = kv + rope
    md[f"{a}.attention.value_length"] = kv
    md[f"{a}.attention.key_length_mla"] = nope + rope
    md[f"{a}.attention.value_length_mla"] = vh
    md[f"{a}.attention.q_lora_rank"] = q
    md[f"{a}.attention.kv_lora_rank"] = kv
    md[f"{a}.rope.dimension_count"] = rope
    md[f"{a}.leading_dense_block_count"] = s.n_dense_lead
    md[f"{a}.expert_shared_count"] = s.n_expert_shared
    md[f"{a}.expert_weights_scale"] = s.expert_weights_scale
    md[f"{a}.expert_weights_norm"] = s.expert_weights_norm
    md[f"{a}.expert_gating_func"] = s.expert_gating_func
    for i in range(s.n_layer):
        p = f"blk.{i}."
        ts += [TensorInfo(p + "attn_norm.weight", (E,), "F32"),
               TensorInfo(p + "attn_q_a_norm.weight", (q,), "F32"),
               TensorInfo(p + "attn_kv_a_norm.weight", (kv,), "F32"),
               TensorInfo(p + "attn_q_a.weight", (E, q), at),
               TensorInfo(p + "attn_q_b.weight", (q, H * (nope + rope)), at),
               TensorInfo(p + "attn_kv_a_mqa.weight", (E, kv + rope), at),
               TensorInfo(p + "attn_k_b.weight", (nope, kv, H), at),
               TensorInfo(p + "attn_v_b.weight", (kv, vh, H), at),
               TensorInfo(p + "attn_output.weight", (H * vh, E), at),
               TensorInfo(p + "ffn_norm.weight", (E,), "F32")]
        if i < s.n_dense_lead:
            _dense(s, types, i, ts)
        else:
            _moe(s, types, i, ts)
            ts.append(TensorInfo(p + "exp_probs_b.bias", (s.n_expert,), "F32"))
            sh = s.n_ff_exp * s.n_expert_shared
            ts += [TensorInfo(p + "ffn_gate_shexp.weight", (E, sh), at),
                   TensorInfo(p + "ffn_up_shexp.weight", (E, sh), at),
                   TensorInfo(p + "ffn_down_shexp.weight", (sh, E), at)]


def spm_vocab(n_vocab: int) -> dict[str, Any]:
    """A SentencePiece-style ("llama") vocabulary of ``n_vocab`` tokens that llama.cpp accepts: <unk>, <s>,
    </s>, the 256 byte tokens, then filler pieces."""
    if n_vocab < 300:
        raise ValueError("n_vocab must be at least 300")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        a, b = divmod(i, 26)
        piece = "\u2581" + letters[b] if a == 0 else f"\u2581{letters[b]}{a}"
        tokens.append(piece)
        types.append(1)
        i += 1
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(j) for j in range(n_vocab - 259)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": Typed("i32[]", types),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }


def write_model(path: str, shape: ModelShape) -> int:
    md, ts = build(shape)
    return write_gguf(path, md, ts)
