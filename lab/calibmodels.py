"""Real-architecture GGUF models for memory calibration: the tensor names, shapes and metadata llama.cpp
expects for ``qwen3moe``, ``deepseek2`` (MLA), ``gpt-oss`` (sliding-window attention, MXFP4 experts) and a
dense ``llama``, at the real per-layer widths of a named model with fewer layers and experts when asked.

KV-cache and compute-buffer sizes depend on the per-layer widths (heads, head sizes, latent ranks, window)
and on the vocabulary, not on how many experts there are, so a model with real widths and few layers and
experts calibrates the memory model on a small machine; the full presets are for the GPU machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lab.ggufwrite import TensorSpec, spm_vocab, write_gguf


@dataclass(frozen=True)
class ArchSpec:
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    n_ff: int = 0                 # dense FFN width (dense models and leading dense layers)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0
    n_dense_lead: int = 0
    # MLA (deepseek2)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    attn_type: str = "Q8_0"
    expert_type: str = "Q4_0"
    embd_type: str = "Q8_0"
    name: str = ""

    def scaled(self, *, layers: int | None = None, experts: int | None = None, vocab: int | None = None,
               embd: int | None = None) -> "ArchSpec":
        changes: dict[str, Any] = {}
        if layers is not None:
            changes["n_layers"] = layers
            changes["n_dense_lead"] = min(self.n_dense_lead, max(layers - 1, 0))
        if experts is not None and self.n_expert:
            changes["n_expert"] = experts
            changes["n_expert_used"] = min(self.n_expert_used, experts)
        if vocab is not None:
            changes["n_vocab"] = vocab
        if embd is not None:
            changes["n_embd"] = embd
        return replace(self, **changes)


PRESETS: dict[str, ArchSpec] = {
    "qwen3-30b-a3b": ArchSpec("qwen3moe", 48, 2048, 32, 4, 128, 151936, 40960, n_ff=6144, n_expert=128,
                              n_expert_used=8, n_ff_exp=768, name="qwen3-30b-a3b"),
    "qwen3-235b-a22b": ArchSpec("qwen3moe", 94, 4096, 64, 4, 128, 151936, 40960, n_ff=12288, n_expert=128,
                                n_expert_used=8, n_ff_exp=1536, name="qwen3-235b-a22b"),
    "deepseek-v3": ArchSpec("deepseek2", 61, 7168, 128, 1, 0, 129280, 163840, n_ff=18432, n_expert=256,
                            n_expert_used=8, n_ff_exp=2048, n_expert_shared=1, n_dense_lead=3,
                            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                            v_head_dim=128, name="deepseek-v3"),
    "gpt-oss-120b": ArchSpec("gpt-oss", 36, 2880, 64, 8, 64, 201088, 131072, n_expert=128, n_expert_used=4,
                             n_ff_exp=2880, sliding_window=128, expert_type="MXFP4", name="gpt-oss-120b"),
    "llama-8b": ArchSpec("llama", 32, 4096, 32, 8, 128, 128256, 131072, n_ff=14336, attn_type="Q4_0",
                         name="llama-8b"),
}


def build(spec: ArchSpec) -> tuple[dict[str, Any], list[TensorSpec]]:
    """Metadata and tensor index of a model llama.cpp loads as ``spec.arch``."""
    a = spec.arch
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": spec.name or f"calib-{a}",
        "general.alignment": 32,
        f"{a}.block_count": spec.n_layers,
        f"{a}.context_length": spec.n_ctx_train,
        f"{a}.embedding_length": spec.n_embd,
        f"{a}.attention.head_count": spec.n_head,
        f"{a}.attention.head_count_kv": spec.n_head_kv,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": 10000.0,
    }
    if spec.n_ff:
        md[f"{a}.feed_forward_length"] = spec.n_ff
    if spec.n_expert:
        md[f"{a}.expert_count"] = spec.n_expert
        md[f"{a}.expert_used_count"] = spec.n_expert_used
        md[f"{a}.expert_feed_forward_length"] = spec.n_ff_exp
    md.update(spm_vocab(spec.n_vocab))

    E, V = spec.n_embd, spec.n_vocab
    at, et, bt = spec.attn_type, spec.expert_type, spec.embd_type
    ts: list[TensorSpec] = [TensorSpec("token_embd.weight", (E, V), bt),
                            TensorSpec("output_norm.weight", (E,), "F32"),
                            TensorSpec("output.weight", (E, V), bt)]
    if a == "deepseek2":
        _deepseek2(spec, md, ts)
    elif a == "gpt-oss":
        _gpt_oss(spec, md, ts)
    elif a in ("qwen3moe", "qwen3", "llama"):
        _qwen_llama(spec, md, ts)
    else:
        raise ValueError(f"no calibration template for architecture {a!r}")
    del at, et
    return md, ts


def _moe(spec: ArchSpec, i: int, ts: list[TensorSpec], *, bias: bool = False) -> None:
    E, F, X, et = spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.expert_type
    p = f"blk.{i}."
    ts.append(TensorSpec(p + "ffn_gate_inp.weight", (E, X), "F32"))
    ts.append(TensorSpec(p + "ffn_gate_exps.weight", (E, F, X), et))
    ts.append(TensorSpec(p + "ffn_up_exps.weight", (E, F, X), et))
    ts.append(TensorSpec(p + "ffn_down_exps.weight", (F, E, X), et))
    if bias:
        ts.append(TensorSpec(p + "ffn_gate_inp.bias", (X,), "F32"))
        ts.append(TensorSpec(p + "ffn_gate_exps.bias", (F, X), "F32"))
        ts.append(TensorSpec(p + "ffn_up_exps.bias", (F, X), "F32"))
        ts.append(TensorSpec(p + "ffn_down_exps.bias", (E, X), "F32"))


def _dense(spec: ArchSpec, i: int, ts: list[TensorSpec]) -> None:
    E, F, at = spec.n_embd, spec.n_ff, spec.attn_type
    p = f"blk.{i}."
    ts.append(TensorSpec(p + "ffn_gate.weight", (E, F), at))
    ts.append(TensorSpec(p + "ffn_up.weight", (E, F), at))
    ts.append(TensorSpec(p + "ffn_down.weight", (F, E), at))


def _qwen_llama(spec: ArchSpec, md: dict, ts: list[TensorSpec]) -> None:
    a, E, H, KV, D, at = spec.arch, spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.attn_type
    md[f"{a}.attention.key_length"] = D
    md[f"{a}.attention.value_length"] = D
    md[f"{a}.rope.dimension_count"] = D
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        ts += [TensorSpec(p + "attn_norm.weight", (E,), "F32"),
               TensorSpec(p + "attn_q.weight", (E, H * D), at),
               TensorSpec(p + "attn_k.weight", (E, KV * D), at),
               TensorSpec(p + "attn_v.weight", (E, KV * D), at),
               TensorSpec(p + "attn_output.weight", (H * D, E), at),
               TensorSpec(p + "ffn_norm.weight", (E,), "F32")]
        if a in ("qwen3moe", "qwen3"):
            ts += [TensorSpec(p + "attn_q_norm.weight", (D,), "F32"), TensorSpec(p + "attn_k_norm.weight", (D,), "F32")]
        if spec.n_expert:
            _moe(spec, i, ts)
        else:
            _dense(spec, i, ts)


def _gpt_oss(spec: ArchSpec, md: dict, ts: list[TensorSpec]) -> None:
    a, E, H, KV, D, at = spec.arch, spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.attn_type
    md[f"{a}.attention.key_length"] = D
    md[f"{a}.attention.value_length"] = D
    md[f"{a}.rope.dimension_count"] = D
    md[f"{a}.attention.sliding_window"] = spec.sliding_window
    md[f"{a}.rope.scaling.type"] = "yarn"
    md[f"{a}.rope.scaling.factor"] = 32.0
    md[f"{a}.rope.scaling.original_context_length"] = 4096
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        ts += [TensorSpec(p + "attn_norm.weight", (E,), "F32"),
               TensorSpec(p + "post_attention_norm.weight", (E,), "F32"),
               TensorSpec(p + "attn_q.weight", (E, H * D), at), TensorSpec(p + "attn_q.bias", (H * D,), "F32"),
               TensorSpec(p + "attn_k.weight", (E, KV * D), at), TensorSpec(p + "attn_k.bias", (KV * D,), "F32"),
               TensorSpec(p + "attn_v.weight", (E, KV * D), at), TensorSpec(p + "attn_v.bias", (KV * D,), "F32"),
               TensorSpec(p + "attn_output.weight", (H * D, E), at),
               TensorSpec(p + "attn_output.bias", (E,), "F32"),
               TensorSpec(p + "attn_sinks.weight", (H,), "F32")]
        _moe(spec, i, ts, bias=True)


def _deepseek2(spec: ArchSpec, md: dict, ts: list[TensorSpec]) -> None:
    a, E, H, at = spec.arch, spec.n_embd, spec.n_head, spec.attn_type
    q, kv, rope, nope, vh = (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim,
                             spec.v_head_dim)
    md[f"{a}.attention.head_count_kv"] = 1
    md[f"{a}.attention.key_length"] = kv + rope
    md[f"{a}.attention.value_length"] = kv
    md[f"{a}.attention.key_length_mla"] = nope + rope
    md[f"{a}.attention.value_length_mla"] = vh
    md[f"{a}.attention.q_lora_rank"] = q
    md[f"{a}.attention.kv_lora_rank"] = kv
    md[f"{a}.rope.dimension_count"] = rope
    md[f"{a}.leading_dense_block_count"] = spec.n_dense_lead
    md[f"{a}.expert_shared_count"] = spec.n_expert_shared
    md[f"{a}.expert_weights_scale"] = 2.5
    md[f"{a}.expert_weights_norm"] = True
    md[f"{a}.expert_gating_func"] = 2
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        ts += [TensorSpec(p + "attn_norm.weight", (E,), "F32"),
               TensorSpec(p + "attn_q_a_norm.weight", (q,), "F32"),
               TensorSpec(p + "attn_kv_a_norm.weight", (kv,), "F32"),
               TensorSpec(p + "attn_q_a.weight", (E, q), at),
               TensorSpec(p + "attn_q_b.weight", (q, H * (nope + rope)), at),
               TensorSpec(p + "attn_kv_a_mqa.weight", (E, kv + rope), at),
               TensorSpec(p + "attn_k_b.weight", (nope, kv, H), at),
               TensorSpec(p + "attn_v_b.weight", (kv, vh, H), at),
               TensorSpec(p + "attn_output.weight", (H * vh, E), at),
               TensorSpec(p + "ffn_norm.weight", (E,), "F32")]
        if i < spec.n_dense_lead:
            _dense(spec, i, ts)
        else:
            _moe(spec, i, ts)
            ts.append(TensorSpec(p + "exp_probs_b.bias", (spec.n_expert,), "F32"))
            S = spec.n_ff_exp * spec.n_expert_shared
            ts += [TensorSpec(p + "ffn_gate_shexp.weight", (E, S), at),
                   TensorSpec(p + "ffn_up_shexp.weight", (E, S), at),
                   TensorSpec(p + "ffn_down_shexp.weight", (S, E), at)]


def write_model(path: str, spec: ArchSpec) -> int:
    md, ts = build(spec)
    return write_gguf(path, md, ts)
