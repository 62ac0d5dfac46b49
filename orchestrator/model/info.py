"""What a model is made of: frozen dataclasses built by :mod:`orchestrator.model.reader`, read by the planner.

Everything here is pure: no files, no processes. Sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.model.classes import TensorClass

# JSON schema version of ModelInfo.to_json(); bump when a field changes meaning.
JSON_SCHEMA = 1


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the GGUF index. ``shape`` is in ggml order (``shape[0]`` is the row length)."""

    name: str
    cls: TensorClass
    layer: int | None
    bytes: int
    type: str                     # ggml type name: "Q4_K", "F32", "IQ4_KS" ...
    shape: tuple[int, ...]
    n_elements: int
    shard: int                    # index into ModelInfo.paths
    offset: int = 0               # absolute byte offset of the data in its shard

    def to_json(self) -> dict:
        return {"name": self.name, "class": self.cls.value, "layer": self.layer, "bytes": self.bytes,
                "type": self.type, "shape": list(self.shape), "n_elements": self.n_elements, "shard": self.shard}


@dataclass(frozen=True)
class MLAParams:
    """Multi-head latent attention (deepseek2 and its kin). The KV cache stores, per token and layer, one
    compressed latent of ``kv_lora_rank`` plus the shared RoPE key of ``qk_rope_head_dim`` (K only, no V)."""

    kv_lora_rank: int
    q_lora_rank: int              # 0 when queries are not low-rank (the "lite" models)
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    k_head_dim: int               # key length per head once decompressed (nope + rope), e.g. 192
    v_head_dim: int               # value length per head once decompressed, e.g. 128

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ModelInfo:
    """A GGUF model (all its shards), as llama.cpp will see it.

    ``n_layers`` is the GGUF ``block_count`` -- every ``blk.N`` block, the NextN/MTP blocks included, which is
    what ``-ngl`` counts; ``n_nextn_layers`` of them (the last ones) are MTP heads that llama.cpp does not
    load, compute or cache unless MTP speculative decoding is on (:attr:`n_trunk_layers` are the others).
    ``n_head_kv`` is the maximum over layers; ``n_head_kv_layers`` the per-layer values.
    For MLA models ``head_dim_k``/``head_dim_v`` are the cache widths (``kv_lora_rank + rope``, ``kv_lora_rank``)
    and the decompressed per-head sizes are in :attr:`mla`.
    """

    paths: tuple[str, ...]
    arch: str
    name: str | None
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int | None
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int | None
    n_dense_lead: int
    n_vocab: int
    n_ctx_train: int
    mla: MLAParams | None
    sliding_window: int | None
    swa_layers: tuple[int, ...]
    n_nextn_layers: int
    tensors: tuple[TensorInfo, ...]
    file_bytes: int
    # additions beyond the planner's contract
    n_head_kv_layers: tuple[int, ...] = ()
    n_head_layers: tuple[int, ...] = ()
    swa_chunked: bool = False     # llama4's chunked attention rather than a sliding window
    recurrent_layers: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()
    _by_name: dict = field(default_factory=dict, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self._by_name:
            object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})
        object.__setattr__(self, "_swa_set", frozenset(self.swa_layers))

    # ---- lookups -----------------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self.paths[0]

    @property
    def n_trunk_layers(self) -> int:
        """Layers llama.cpp computes for every token (``n_layer()``): all blocks but the NextN/MTP ones."""
        return self.n_layers - self.n_nextn_layers

    def tensor(self, name: str) -> TensorInfo:
        return self._by_name[name]

    def has_tensor(self, name: str) -> bool:
        return name in self._by_name

    def layer_tensors(self, layer: int) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if t.layer == layer)

    def kv_heads(self, layer: int) -> int:
        return self.n_head_kv_layers[layer] if self.n_head_kv_layers else self.n_head_kv

    def heads(self, layer: int) -> int:
        return self.n_head_layers[layer] if self.n_head_layers else self.n_head

    def is_swa(self, layer: int) -> bool:
        return layer in self._swa_set  # type: ignore[attr-defined]  # set in __post_init__

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def weights_bytes(self) -> int:
        """Bytes of every tensor in the files (NextN/MTP layers included)."""
        return sum(t.bytes for t in self.tensors)

    def loaded_bytes(self, *, mtp: bool = False) -> int:
        """Bytes llama.cpp allocates for weights: the NextN/MTP blocks are skipped unless ``mtp``."""
        return sum(t.bytes for t in self.tensors if mtp or not self._is_nextn(t))

    def _is_nextn(self, t: TensorInfo) -> bool:
        return self.n_nextn_layers > 0 and t.layer is not None and t.layer >= self.n_trunk_layers

    def bytes_by_class(self) -> dict[TensorClass, int]:
        out = {c: 0 for c in TensorClass}
        for t in self.tensors:
            out[t.cls] += t.bytes
        return out

    def layer_bytes(self, layer: int) -> dict[TensorClass, int]:
        out = {c: 0 for c in TensorClass}
        for t in self.tensors:
            if t.layer == layer:
                out[t.cls] += t.bytes
        return out

    def global_bytes(self) -> dict[TensorClass, int]:
        """Bytes of the tensors outside any layer (embeddings, output, output norm ...)."""
        out = {c: 0 for c in TensorClass}
        for t in self.tensors:
            if t.layer is None:
                out[t.cls] += t.bytes
        return out

    def expert_bytes(self, layer: int) -> int:
        """Bytes of this layer's routed experts (all of them)."""
        return sum(t.bytes for t in self.tensors if t.layer == layer and t.cls is TensorClass.ROUTED_EXPERT)

    def bytes_per_expert(self, layer: int) -> int:
        """Bytes of one routed expert of this layer (0 for a dense layer)."""
        if self.n_expert <= 0:
            return 0
        return self.expert_bytes(layer) // self.n_expert

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(sorted({t.layer for t in self.tensors
                             if t.cls is TensorClass.ROUTED_EXPERT and t.layer is not None}))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.n_trunk_layers) if i not in moe)

    # ---- parameters --------------------------------------------------------------------------------------
    @property
    def params_total(self) -> int:
        """Parameters in the files (every tensor, MTP blocks included)."""
        return sum(t.n_elements for t in self.tensors)

    @property
    def params_active(self) -> int:
        """Parameters used per token: every matrix of the trunk except the routed experts, plus
        ``n_expert_used / n_expert`` of them. The token embeddings are a lookup and do not count (OpenAI's
        convention for gpt-oss: 5.1 B active of 117 B); the output matrix does; MTP blocks do not."""
        total = 0
        routed = 0
        for t in self.tensors:
            if self._is_nextn(t) or t.cls is TensorClass.EMBEDDINGS:
                continue
            if t.cls is TensorClass.ROUTED_EXPERT:
                routed += t.n_elements
            else:
                total += t.n_elements
        if self.n_expert > 0 and routed:
            total += routed * self.n_expert_used // self.n_expert
        return total

    def active_bytes_per_token(self) -> int:
        """Weight bytes one decoded token reads: the trunk without embeddings, with ``n_expert_used`` experts
        per MoE layer. The memory-bandwidth cost of a token."""
        total = 0
        for t in self.tensors:
            if self._is_nextn(t) or t.cls is TensorClass.EMBEDDINGS:
                continue
            if t.cls is TensorClass.ROUTED_EXPERT and self.n_expert > 0:
                total += t.bytes * self.n_expert_used // self.n_expert
            else:
                total += t.bytes
        return total

    # ---- JSON --------------------------------------------------------------------------------------------
    def to_json(self, *, tensors: bool = True) -> dict:
        """The documented JSON form (docs/model.md, schema 1)."""
        by_class = self.bytes_by_class()
        out = {
            "schema": JSON_SCHEMA,
            "paths": list(self.paths),
            "arch": self.arch,
            "name": self.name,
            "n_layers": self.n_layers,
            "n_trunk_layers": self.n_trunk_layers,
            "n_nextn_layers": self.n_nextn_layers,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv,
            "head_dim_k": self.head_dim_k,
            "head_dim_v": self.head_dim_v,
            "n_ff": self.n_ff,
            "n_experts": self.n_expert,
            "n_experts_used": self.n_expert_used,
            "n_experts_shared": self.n_expert_shared,
            "n_ff_exp": self.n_ff_exp,
            "n_dense_lead": self.n_dense_lead,
            "n_vocab": self.n_vocab,
            "n_ctx_train": self.n_ctx_train,
            "mla": self.mla.to_json() if self.mla else None,
            "sliding_window": self.sliding_window,
            "swa_layers": list(self.swa_layers),
            "moe_layers": list(self.moe_layers),
            "file_bytes": self.file_bytes,
            "params_total": self.params_total,
            "params_active": self.params_active,
            "totals": {c.value: by_class[c] for c in TensorClass},
            "total_bytes": sum(by_class.values()),
            "warnings": list(self.warnings),
        }
        if tensors:
            out["tensors"] = [t.to_json() for t in self.tensors]
        return out
