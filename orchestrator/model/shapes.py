"""Shapes of real Mixture-of-Experts models, as llama.cpp sees them in a GGUF file.

A :class:`ModelShape` holds the hyper-parameters of one released model (from its ``config.json`` as llama.cpp's
``convert_hf_to_gguf.py`` maps them). :func:`tensor_specs` lists the tensors llama.cpp's loader
(``src/models/<arch>.cpp``) creates for it -- names, ggml shapes (``ne``, fastest dimension first) and the tensor
types that ``llama-quantize`` would give them for a Q4_0/Q8_0 file -- and :func:`metadata` the GGUF key/values
its ``load_hparams`` reads. :func:`scaled` shrinks a shape for tests while keeping it loadable.

Pure data and arithmetic: no numpy, no gguf, no I/O (``orchestrator.model.synth`` writes the file).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from orchestrator.errors import ModelError

# ggml type name -> (elements per block, bytes per block)
BLOCK = {
    "f32": (1, 4),
    "f16": (1, 2),
    "q4_0": (32, 18),
    "q8_0": (32, 34),
    "q6_k": (256, 210),
    "mxfp4": (32, 17),
}
# ggml type ids (ggml.h enum ggml_type)
GGML_TYPE_ID = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "q6_k": 14, "mxfp4": 39}
# llama_ftype ids (llama.h) written as general.file_type
FILE_TYPE = {"q4_0": 2, "q8_0": 7, "mxfp4_moe": 38}
QUANTS = ("q4_0", "q8_0")
EXPERT_QUANTS = ("q4_0", "q8_0", "mxfp4")


@dataclass(frozen=True)
class Special:
    """A special token: ``id`` counted from the start when ``from_end`` is false, else ``n_vocab - id``."""

    text: str
    id: int
    from_end: bool = False
    role: str = ""            # "bos" | "eos" | "pad" | "" (only listed in the vocab)

    def token_id(self, n_vocab: int) -> int:
        return n_vocab - self.id if self.from_end else self.id


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters of one model. Field names follow llama.cpp's ``llama_hparams``."""

    like: str                 # our name, e.g. "qwen3-30b-a3b"
    arch: str                 # GGUF general.architecture
    title: str                # general.name
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int             # attention.key_length == value_length (non-MLA)
    n_ff: int                 # feed_forward_length (dense FFN of leading dense layers)
    n_ff_exp: int             # expert_feed_forward_length
    n_expert: int
    n_expert_used: int
    n_ctx_train: int
    rope_freq_base: float
    rms_eps: float
    # DeepSeek-V3 (deepseek2): MLA and expert routing
    n_expert_shared: int = 0
    n_dense_lead: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    n_expert_groups: int = 0
    n_group_used: int = 0
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating_func: int = 0          # 1 softmax, 2 sigmoid (llama_expert_gating_func_type)
    # gpt-oss: sliding-window attention on every other layer, attention sinks, biases, MXFP4 experts
    sliding_window: int = 0
    # glm4moe: q/k/v biases, partial RoPE (rope.dimension_count < head_dim), optional per-head q/k norms
    n_rot: int = 0                       # rope.dimension_count where it differs from head_dim (0: head_dim)
    qk_norm: bool = False
    mxfp4_experts: bool = False
    # the routed experts' type where it is not the file's (--expert-quant; "": --quant's, gpt-oss's MXFP4)
    expert_quant: str = ""
    # rope scaling (yarn)
    rope_scaling: str = ""
    rope_factor: float = 0.0
    rope_orig_ctx: int = 0
    yarn_log_mul: float = 0.0
    yarn_beta_fast: float = 0.0
    yarn_beta_slow: float = 0.0
    # tokenizer
    tokenizer_pre: str = "qwen2"
    specials: tuple[Special, ...] = ()
    add_bos: bool = False
    chat_template: str = ""
    tied_embeddings: bool = False
    default_quant: str = "q4_0"          # gpt-oss: q8_0, the type llama-quantize's MXFP4_MOE gives non-experts
    scale: float = 1.0                   # 1.0 = the real shape
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layer - self.n_dense_lead

    def moe_layers(self) -> range:
        return range(self.n_dense_lead, self.n_layer)


_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_DEEPSEEK_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
                  "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
                  "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")
_HARMONY = ("{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")

# Qwen3: 151643.. are specials, the token list is padded to 151936 (293 ids from the end)
_QWEN3_SPECIALS = (
    Special("<|endoftext|>", 293, True, "bos"),
    Special("<|im_start|>", 292, True),
    Special("<|im_end|>", 291, True, "eos"),
    Special("<think>", 269, True),
    Special("</think>", 268, True),
)
_QWEN3_PAD = Special("<|endoftext|>", 293, True, "pad")

_DEEPSEEK_SPECIALS = (
    Special("<｜begin▁of▁sentence｜>", 0, False, "bos"),
    Special("<｜end▁of▁sentence｜>", 1, False, "eos"),
    Special("<｜▁pad▁｜>", 2, False),
    Special("<｜User｜>", 129280 - 128803, True),
    Special("<｜Assistant｜>", 129280 - 128804, True),
)

_GPT_OSS_SPECIALS = (
    Special("<|startoftext|>", 201088 - 199998, True, "bos"),
    Special("<|endoftext|>", 201088 - 199999, True, "pad"),
    Special("<|return|>", 201088 - 200002, True, "eos"),
    Special("<|channel|>", 201088 - 200005, True),
    Special("<|start|>", 201088 - 200006, True),
    Special("<|end|>", 201088 - 200007, True),
    Special("<|message|>", 201088 - 200008, True),
    Special("<|call|>", 201088 - 200012, True),
)

# GLM-4.5: 151329.. are specials in a vocabulary of 151552 (tokenizer_config.json of zai-org/GLM-4.5-Air); llama.cpp's
# converter (conversion/glm.py, _set_vocab_glm) sets eos = <|endoftext|>, eot = <|user|>, bos = [gMASK]
_GLM_SPECIALS = (
    Special("<|endoftext|>", 151552 - 151329, True, "eos"),
    Special("[gMASK]", 151552 - 151331, True, "bos"),
    Special("<sop>", 151552 - 151333, True),
    Special("<|system|>", 151552 - 151335, True),
    Special("<|user|>", 151552 - 151336, True),
    Special("<|assistant|>", 151552 - 151337, True),
    Special("<|observation|>", 151552 - 151338, True),
)
_GLM_PAD = Special("<|endoftext|>", 151552 - 151329, True, "pad")
_GLM_CHAT = ("[gMASK]<sop>{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")

# Kimi-K2: tiktoken vocabulary padded to 163840; [BOS] 163584, [EOS] 163585 (tokenizer_config.json of
# moonshotai/Kimi-K2-Instruct-0905)
_KIMI_SPECIALS = (
    Special("[BOS]", 163840 - 163584, True, "bos"),
    Special("[EOS]", 163840 - 163585, True, "eos"),
    Special("<|im_end|>", 163840 - 163586, True),
    Special("<|im_user|>", 163840 - 163587, True),
    Special("<|im_assistant|>", 163840 - 163588, True),
    Special("<|im_system|>", 163840 - 163594, True),
    Special("<|im_middle|>", 163840 - 163601, True),
)
_KIMI_CHAT = ("{% for m in messages %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content'] "
              "+ '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}")

# GLM-4.5 family (config.json of zai-org/GLM-4.5 and zai-org/GLM-4.5-Air; converter conversion/glm.py): head_dim 128,
# partial_rotary_factor 0.5 -> rope.dimension_count 64 (NEOX), rope_theta 1e6, rms_norm_eps 1e-5, attention_bias
# (q/k/v biases), sigmoid routing with e_score_correction_bias (exp_probs_b), one shared expert, n_group 1,
# norm_topk_prob; num_nextn_predict_layers 1: the MTP block is left out, as the converter's --no-mtp writes it
# (llama.cpp skips that block's tensors unless MTP is asked for)
_GLM_COMMON = dict(arch="glm4moe", n_vocab=151552, n_head=96, n_head_kv=8, head_dim=128, n_rot=64, n_expert_used=8,
                   n_ctx_train=131072, rope_freq_base=1_000_000.0, rms_eps=1e-5, n_expert_shared=1,
                   expert_weights_norm=True, expert_gating_func=2, tokenizer_pre="glm4",
                   specials=_GLM_SPECIALS + (_GLM_PAD,), add_bos=False, chat_template=_GLM_CHAT)

_QWEN3_COMMON = dict(arch="qwen3moe", n_vocab=151936, head_dim=128, n_expert=128, n_expert_used=8, n_ctx_train=40960,
                     rope_freq_base=1_000_000.0, rms_eps=1e-6, tokenizer_pre="qwen2",
                     specials=_QWEN3_SPECIALS + (_QWEN3_PAD,), add_bos=False, chat_template=_CHATML)

_GPT_OSS_COMMON = dict(arch="gpt-oss", n_vocab=201088, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880,
                       n_ff_exp=2880, n_expert_used=4, n_ctx_train=131072, rope_freq_base=150000.0, rms_eps=1e-5,
                       sliding_window=128, mxfp4_experts=True, rope_scaling="yarn", rope_factor=32.0,
                       rope_orig_ctx=4096, tokenizer_pre="gpt-4o", specials=_GPT_OSS_SPECIALS, add_bos=False,
                       chat_template=_HARMONY, default_quant="q8_0")

SHAPES: dict[str, ModelShape] = {s.like: s for s in (
    ModelShape(like="qwen3-30b-a3b", title="Qwen3-30B-A3B (synthetic)", n_embd=2048, n_layer=48, n_head=32,
               n_head_kv=4, n_ff=6144, n_ff_exp=768, **_QWEN3_COMMON),
    ModelShape(like="qwen3-235b-a22b", title="Qwen3-235B-A22B (synthetic)", n_embd=4096, n_layer=94, n_head=64,
               n_head_kv=4, n_ff=12288, n_ff_exp=1536, **_QWEN3_COMMON),
    ModelShape(like="deepseek-v3", arch="deepseek2", title="DeepSeek-V3 (synthetic)", n_vocab=129280, n_embd=7168,
               n_layer=61, n_head=128, n_head_kv=1, head_dim=0, n_ff=18432, n_ff_exp=2048, n_expert=256,
               n_expert_used=8, n_ctx_train=163840, rope_freq_base=10000.0, rms_eps=1e-6, n_expert_shared=1,
               n_dense_lead=3, q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128,
               n_expert_groups=8, n_group_used=4, expert_weights_scale=2.5, expert_weights_norm=True,
               expert_gating_func=2, rope_scaling="yarn", rope_factor=40.0, rope_orig_ctx=4096, yarn_log_mul=0.1,
               yarn_beta_fast=32.0, yarn_beta_slow=1.0, tokenizer_pre="deepseek-v3", specials=_DEEPSEEK_SPECIALS,
               add_bos=True, chat_template=_DEEPSEEK_CHAT),
    # Kimi-K2-Instruct-0905 (config.json of moonshotai/Kimi-K2-Instruct-0905): DeepSeek-V3's layout with 384
    # experts, 64 heads, one leading dense layer, no expert groups (n_group 1), routed_scaling_factor 2.827,
    # rope_theta 50000, yarn factor 64 over 4096 (beta_fast 1, beta_slow 1, mscale_all_dim 1 -> log mul 0.1)
    ModelShape(like="kimi-k2", arch="deepseek2", title="Kimi-K2 (synthetic)", n_vocab=163840, n_embd=7168,
               n_layer=61, n_head=64, n_head_kv=1, head_dim=0, n_ff=18432, n_ff_exp=2048, n_expert=384,
               n_expert_used=8, n_ctx_train=262144, rope_freq_base=50000.0, rms_eps=1e-6, n_expert_shared=1,
               n_dense_lead=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128,
               n_expert_groups=1, n_group_used=1, expert_weights_scale=2.827, expert_weights_norm=True,
               expert_gating_func=2, rope_scaling="yarn", rope_factor=64.0, rope_orig_ctx=4096, yarn_log_mul=0.1,
               yarn_beta_fast=1.0, yarn_beta_slow=1.0, tokenizer_pre="kimi-k2", specials=_KIMI_SPECIALS,
               add_bos=False, chat_template=_KIMI_CHAT),
    # GLM-4.5-Air: hidden 4096, 46 layers (the first dense, intermediate 10944), 128 experts of 1408, top 8,
    # routed_scaling_factor 1.0, no q/k norms (use_qk_norm false)
    ModelShape(like="glm-4.5-air", title="GLM-4.5-Air (synthetic)", n_embd=4096, n_layer=46, n_ff=10944,
               n_ff_exp=1408, n_expert=128, n_dense_lead=1, expert_weights_scale=1.0, **_GLM_COMMON),
    # GLM-4.5: hidden 5120, 92 layers (the first 3 dense, intermediate 12288), 160 experts of 1536, top 8,
    # routed_scaling_factor 2.5, per-head q/k norms (use_qk_norm true)
    ModelShape(like="glm-4.5", title="GLM-4.5 (synthetic)", n_embd=5120, n_layer=92, n_ff=12288, n_ff_exp=1536,
               n_expert=160, n_dense_lead=3, expert_weights_scale=2.5, qk_norm=True, **_GLM_COMMON),
    ModelShape(like="gpt-oss-120b", title="gpt-oss-120b (synthetic)", n_layer=36, n_expert=128, **_GPT_OSS_COMMON),
    ModelShape(like="gpt-oss-20b", title="gpt-oss-20b (synthetic)", n_layer=24, n_expert=32, **_GPT_OSS_COMMON),
)}
ALIASES = {"deepseek-r1": "deepseek-v3", "kimi-k2-instruct": "kimi-k2", "glm-4.5-355b": "glm-4.5",
           "qwen3-30b": "qwen3-30b-a3b", "qwen3-235b": "qwen3-235b-a22b"}


def names() -> list[str]:
    return sorted(SHAPES)


def get(like: str) -> ModelShape:
    key = ALIASES.get(like.lower(), like.lower())
    if key not in SHAPES:
        raise ModelError(f"--like {like!r}: unknown model shape; valid names: {', '.join(names())}"
                         f" (aliases: {', '.join(sorted(ALIASES))})")
    return SHAPES[key]


def _r(x: float, mult: int, lo: int) -> int:
    """Round ``x`` to a multiple of ``mult``, at least ``lo``."""
    return max(lo, int(round(x / mult)) * mult)


def scaled(shape: ModelShape, scale: float = 1.0, *, layers: int | None = None) -> ModelShape:
    """Shrink width and depth by ``scale`` (0 < scale <= 1) and/or set the depth to ``layers``.

    What stays, so the result loads and routes like the real model: the architecture and its tensor set, head
    dimensions (RoPE and attention kernels depend on them; MLA keeps kv_lora_rank 512 + rope 64), the expert
    count, experts used per token, expert groups and the shared expert, every row length a multiple of 32 (one
    quant block). Width, heads, FFN sizes, q_lora_rank, vocabulary (scale < 1 only) and depth shrink.
    """
    if not (0.0 < scale <= 1.0):
        raise ModelError(f"--scale {scale}: expected 0 < scale <= 1")
    if layers is not None and layers < 1:
        raise ModelError(f"--layers {layers}: expected a positive number of layers")
    s = shape
    if scale < 1.0:
        kv = max(1, int(round(s.n_head_kv * scale)))
        if s.arch == "deepseek2":
            n_head, kv = max(2, int(round(s.n_head * scale))), 1
        else:
            n_head = kv * max(1, int(round(s.n_head * scale / kv)))
        min_layers = 2 if s.sliding_window else (3 if s.n_dense_lead else 2)
        n_layer = max(min_layers, int(round(s.n_layer * scale)))
        if s.sliding_window and n_layer % 2:
            n_layer += 1  # keep the sliding/full alternation whole
        s = replace(
            s,
            n_embd=_r(s.n_embd * scale, 64, 128),
            n_head=n_head,
            n_head_kv=kv,
            n_ff=_r(s.n_ff * scale, 32, 64),
            n_ff_exp=_r(s.n_ff_exp * scale, 32, 64),
            q_lora_rank=_r(s.q_lora_rank * scale, 32, 64) if s.q_lora_rank else 0,
            n_layer=n_layer,
            n_dense_lead=min(s.n_dense_lead, max(1, int(round(s.n_dense_lead * scale)))) if s.n_dense_lead else 0,
            n_vocab=_r(s.n_vocab * scale, 64, 4096),
            scale=scale,
            title=s.title.replace("(synthetic)", f"(synthetic, scale {scale:g})"),
        )
    if layers is not None:
        if s.n_dense_lead and layers < 2:
            raise ModelError(f"--layers {layers}: {s.like} needs at least 2 layers (a leading dense layer and a "
                             f"MoE layer)")
        n_dense = min(s.n_dense_lead, layers - 1) if s.n_dense_lead else 0
        if s.sliding_window and layers % 2:
            raise ModelError(f"--layers {layers}: {s.like} alternates sliding-window and full attention layers; "
                             f"use an even number")
        s = replace(s, n_layer=layers, n_dense_lead=n_dense, title=s.title.replace(")", f", {layers} layers)", 1))
    if s.n_dense_lead and s.n_layer <= s.n_dense_lead:
        raise ModelError(f"{s.like}: {s.n_layer} layers leave no MoE layer after {s.n_dense_lead} dense ones")
    return s


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file. ``ne`` is ggml's order (row length first); ``role`` picks its random scale."""

    name: str
    ne: tuple[int, ...]
    type: str
    role: str

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        blk, size = BLOCK[self.type]
        if self.ne[0] % blk:
            raise ValueError(f"{self.name}: row length {self.ne[0]} is not a multiple of the {self.type} block {blk}")
        return self.n_elements // blk * size

    @property
    def is_expert(self) -> bool:
        return len(self.ne) == 3 and "_exps." in self.name


def _out_type(quant: str, n_embd: int) -> str:
    """llama-quantize's choice for output.weight: Q6_K, or Q8_0 when the row is not a multiple of 256 (or q8_0)."""
    if quant == "q8_0" or n_embd % 256:
        return "q8_0"
    return "q6_k"


def tensor_specs(s: ModelShape, quant: str | None = None) -> list[TensorSpec]:
    """Every tensor llama.cpp's loader creates for ``s``, in the order convert_hf_to_gguf writes them.

    ``quant`` (default: the model's ``default_quant``) is the type of the quantized weights."""
    quant = quant or s.default_quant
    if quant not in QUANTS:
        raise ModelError(f"--quant {quant!r}: expected one of {', '.join(QUANTS)}")
    q, E, V = quant, s.n_embd, s.n_vocab
    t: list[TensorSpec] = [TensorSpec("token_embd.weight", (E, V), q, "embd")]

    def add(name: str, ne: tuple[int, ...], typ: str, role: str) -> None:
        if s.expert_quant and role in ("exp_in", "exp_down"):
            typ = s.expert_quant
        t.append(TensorSpec(name, ne, typ, role))

    def biased_qkv(b: str) -> None:   # gpt-oss and GLM-4.5: q, k, v with biases, the output without
        qd, kvd = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        for name, n in (("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)):
            add(b + name + ".weight", (E, n), q, "attn_in")
            add(b + name + ".bias", (n,), "f32", "bias")
        add(b + "attn_output.weight", (qd, E), q, "attn_out")

    def sigmoid_ffn(b: str, i: int) -> None:   # DeepSeek-V3 and GLM-4.5: dense leading layers, then routed
        # experts behind a sigmoid router with a correction bias, and shared experts
        if i < s.n_dense_lead:
            add(b + "ffn_gate.weight", (E, s.n_ff), q, "ffn_in")
            add(b + "ffn_up.weight", (E, s.n_ff), q, "ffn_in")
            add(b + "ffn_down.weight", (s.n_ff, E), q, "ffn_down")
            return
        add(b + "ffn_gate_inp.weight", (E, s.n_expert), "f32", "router")
        add(b + "exp_probs_b.bias", (s.n_expert,), "f32", "router_bias")
        add(b + "ffn_gate_exps.weight", (E, s.n_ff_exp, s.n_expert), q, "exp_in")
        add(b + "ffn_up_exps.weight", (E, s.n_ff_exp, s.n_expert), q, "exp_in")
        add(b + "ffn_down_exps.weight", (s.n_ff_exp, E, s.n_expert), q, "exp_down")
        sh = s.n_ff_exp * s.n_expert_shared
        add(b + "ffn_gate_shexp.weight", (E, sh), q, "ffn_in")
        add(b + "ffn_up_shexp.weight", (E, sh), q, "ffn_in")
        add(b + "ffn_down_shexp.weight", (sh, E), q, "shexp_down")

    for i in range(s.n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (E,), "f32", "norm")
        if s.arch == "qwen3moe":
            qd, kvd = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
            add(b + "attn_q.weight", (E, qd), q, "attn_in")
            add(b + "attn_k.weight", (E, kvd), q, "attn_in")
            add(b + "attn_v.weight", (E, kvd), q, "attn_in")
            add(b + "attn_output.weight", (qd, E), q, "attn_out")
            add(b + "attn_q_norm.weight", (s.head_dim,), "f32", "norm")
            add(b + "attn_k_norm.weight", (s.head_dim,), "f32", "norm")
            add(b + "ffn_norm.weight", (E,), "f32", "norm")
            add(b + "ffn_gate_inp.weight", (E, s.n_expert), "f32", "router")
            add(b + "ffn_gate_exps.weight", (E, s.n_ff_exp, s.n_expert), q, "exp_in")
            add(b + "ffn_up_exps.weight", (E, s.n_ff_exp, s.n_expert), q, "exp_in")
            add(b + "ffn_down_exps.weight", (s.n_ff_exp, E, s.n_expert), q, "exp_down")
        elif s.arch == "deepseek2":
            k_mla = s.qk_nope_dim + s.qk_rope_dim
            add(b + "attn_q_a_norm.weight", (s.q_lora_rank,), "f32", "norm")
            add(b + "attn_kv_a_norm.weight", (s.kv_lora_rank,), "f32", "norm")
            add(b + "attn_q_a.weight", (E, s.q_lora_rank), q, "attn_in")
            add(b + "attn_q_b.weight", (s.q_lora_rank, s.n_head * k_mla), q, "attn_in")
            add(b + "attn_kv_a_mqa.weight", (E, s.kv_lora_rank + s.qk_rope_dim), q, "attn_in")
            add(b + "attn_k_b.weight", (s.qk_nope_dim, s.kv_lora_rank, s.n_head), q, "attn_in")
            add(b + "attn_v_b.weight", (s.kv_lora_rank, s.v_head_dim, s.n_head), q, "attn_in")
            add(b + "attn_output.weight", (s.n_head * s.v_head_dim, E), q, "attn_out")
            add(b + "ffn_norm.weight", (E,), "f32", "norm")
            sigmoid_ffn(b, i)
        elif s.arch == "gpt-oss":
            x = "mxfp4" if s.mxfp4_experts else q
            biased_qkv(b)
            add(b + "attn_output.bias", (E,), "f32", "bias")
            add(b + "attn_sinks.weight", (s.n_head,), "f32", "sinks")
            add(b + "post_attention_norm.weight", (E,), "f32", "norm")
            add(b + "ffn_gate_inp.weight", (E, s.n_expert), "f32", "router")
            add(b + "ffn_gate_inp.bias", (s.n_expert,), "f32", "router_bias")
            add(b + "ffn_gate_exps.weight", (E, s.n_ff_exp, s.n_expert), x, "exp_in")
            add(b + "ffn_gate_exps.bias", (s.n_ff_exp, s.n_expert), "f32", "bias")
            add(b + "ffn_up_exps.weight", (E, s.n_ff_exp, s.n_expert), x, "exp_in")
            add(b + "ffn_up_exps.bias", (s.n_ff_exp, s.n_expert), "f32", "bias")
            add(b + "ffn_down_exps.weight", (s.n_ff_exp, E, s.n_expert), x, "exp_down")
            add(b + "ffn_down_exps.bias", (E, s.n_expert), "f32", "bias")
        elif s.arch == "glm4moe":
            biased_qkv(b)
            if s.qk_norm:
                add(b + "attn_q_norm.weight", (s.head_dim,), "f32", "norm")
                add(b + "attn_k_norm.weight", (s.head_dim,), "f32", "norm")
            add(b + "post_attention_norm.weight", (E,), "f32", "norm")
            sigmoid_ffn(b, i)
        else:  # pragma: no cover - the table only holds the architectures above
            raise ModelError(f"{s.like}: architecture {s.arch!r} has no tensor layout")
    add("output_norm.weight", (E,), "f32", "norm")
    if not s.tied_embeddings:
        add("output.weight", (E, V), _out_type(quant, E), "output")
    return t


def fan_in(spec: TensorSpec) -> int:
    return spec.ne[0]


def with_expert_quant(s: ModelShape, expert_quant: str | None) -> ModelShape:
    """``s`` with its routed experts in ``expert_quant`` (one of EXPERT_QUANTS; None: as the shape has them), the
    rest of the file as --quant makes it: e.g. gpt-oss's experts in Q4_0 beside its Q8_0 attention, to tell the
    MXFP4 kernels' cost from the layer's other ops."""
    if not expert_quant:
        return s
    if expert_quant not in EXPERT_QUANTS:
        raise ModelError(f"--expert-quant {expert_quant!r}: expected one of {', '.join(EXPERT_QUANTS)}")
    return replace(s, expert_quant=expert_quant, mxfp4_experts=expert_quant == "mxfp4")


def file_type(s: ModelShape, quant: str | None = None) -> int:
    quant = quant or s.default_quant
    return FILE_TYPE["mxfp4_moe"] if s.mxfp4_experts else FILE_TYPE[quant]


def metadata(s: ModelShape, quant: str | None = None) -> list[tuple[str, object, str]]:
    """GGUF key/values (key, value, type) llama.cpp reads for ``s``; types: u32, i32, f32, bool, str.

    The tokenizer arrays are added by the writer (they depend on the generated vocabulary).
    """
    a = s.arch
    kv: list[tuple[str, object, str]] = [
        ("general.architecture", a, "str"),
        ("general.type", "model", "str"),
        ("general.name", s.title, "str"),
        ("general.organization", "orchestrator synth-model", "str"),
        (f"{a}.block_count", s.n_layer, "u32"),
        (f"{a}.context_length", s.n_ctx_train, "u32"),
        (f"{a}.embedding_length", s.n_embd, "u32"),
        (f"{a}.feed_forward_length", s.n_ff, "u32"),
        (f"{a}.attention.head_count", s.n_head, "u32"),
        (f"{a}.attention.head_count_kv", s.n_head_kv, "u32"),
        (f"{a}.rope.freq_base", s.rope_freq_base, "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps, "f32"),
        (f"{a}.expert_count", s.n_expert, "u32"),
        (f"{a}.expert_used_count", s.n_expert_used, "u32"),
    ]
    if a == "deepseek2":
        kv += [
            (f"{a}.expert_group_count", s.n_expert_groups, "u32"),
            (f"{a}.expert_group_used_count", s.n_group_used, "u32"),
            (f"{a}.expert_gating_func", s.expert_gating_func, "u32"),
            (f"{a}.leading_dense_block_count", s.n_dense_lead, "u32"),
            (f"{a}.vocab_size", s.n_vocab, "u32"),
            (f"{a}.attention.q_lora_rank", s.q_lora_rank, "u32"),
            (f"{a}.attention.kv_lora_rank", s.kv_lora_rank, "u32"),
            (f"{a}.attention.key_length", s.kv_lora_rank + s.qk_rope_dim, "u32"),
            (f"{a}.attention.value_length", s.kv_lora_rank, "u32"),
            (f"{a}.attention.key_length_mla", s.qk_nope_dim + s.qk_rope_dim, "u32"),
            (f"{a}.attention.value_length_mla", s.v_head_dim, "u32"),
            (f"{a}.expert_feed_forward_length", s.n_ff_exp, "u32"),
            (f"{a}.expert_shared_count", s.n_expert_shared, "u32"),
            (f"{a}.expert_weights_scale", s.expert_weights_scale, "f32"),
            (f"{a}.expert_weights_norm", s.expert_weights_norm, "bool"),
            (f"{a}.rope.dimension_count", s.qk_rope_dim, "u32"),
        ]
    else:
        kv += [
            (f"{a}.attention.key_length", s.head_dim, "u32"),
            (f"{a}.attention.value_length", s.head_dim, "u32"),
            (f"{a}.expert_feed_forward_length", s.n_ff_exp, "u32"),
        ]
    if a == "glm4moe":
        kv += [
            (f"{a}.rope.dimension_count", s.n_rot or s.head_dim, "u32"),
            (f"{a}.expert_shared_count", s.n_expert_shared, "u32"),
            (f"{a}.leading_dense_block_count", s.n_dense_lead, "u32"),
            (f"{a}.expert_gating_func", s.expert_gating_func, "u32"),
            (f"{a}.expert_weights_scale", s.expert_weights_scale, "f32"),
            (f"{a}.expert_weights_norm", s.expert_weights_norm, "bool"),
        ]
    if s.sliding_window:
        kv.append((f"{a}.attention.sliding_window", s.sliding_window, "u32"))
    if s.rope_scaling:
        kv += [
            (f"{a}.rope.scaling.type", s.rope_scaling, "str"),
            (f"{a}.rope.scaling.factor", s.rope_factor, "f32"),
            (f"{a}.rope.scaling.original_context_length", s.rope_orig_ctx, "u32"),
        ]
        if s.yarn_beta_fast:
            kv += [(f"{a}.rope.scaling.yarn_beta_fast", s.yarn_beta_fast, "f32"),
                   (f"{a}.rope.scaling.yarn_beta_slow", s.yarn_beta_slow, "f32")]
        if s.yarn_log_mul:
            kv.append((f"{a}.rope.scaling.yarn_log_multiplier", s.yarn_log_mul, "f32"))
    kv += [
        ("general.file_type", file_type(s, quant), "u32"),
        ("general.quantization_version", 2, "u32"),
    ]
    return kv


def total_bytes(specs: list[TensorSpec], alignment: int = 32) -> int:
    """Tensor data bytes, each tensor padded to ``alignment`` as in the file."""
    return sum((sp.nbytes + alignment - 1) // alignment * alignment for sp in specs)


def describe(s: ModelShape) -> str:
    parts = [f"{s.arch}", f"{s.n_layer} layers", f"n_embd {s.n_embd}", f"{s.n_head}/{s.n_head_kv} heads",
             f"{s.n_expert} experts (top {s.n_expert_used})", f"n_ff_exp {s.n_ff_exp}", f"vocab {s.n_vocab}"]
    if s.n_dense_lead:
        parts.append(f"{s.n_dense_lead} dense layers")
    if s.n_expert_shared:
        parts.append(f"{s.n_expert_shared} shared expert")
    if s.expert_quant:
        parts.append(f"experts {s.expert_quant}")
    return ", ".join(parts)
