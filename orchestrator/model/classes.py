"""Tensor classes: what each GGUF tensor is for, from its name alone.

The names are llama.cpp's (``src/llama-arch.cpp``): global tensors (``token_embd``, ``output``, ``output_norm``)
and per-layer tensors ``blk.N.<name>.<suffix>``. The classes are the units the planner places:

- ``routed_expert``: ``ffn_{gate,up,down,gate_up}_exps`` and ``ffn_*_chexps`` (weights, biases, scales) --
  exactly what llama.cpp's ``--cpu-moe`` regex ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` moves;
- ``shared_expert``: ``*_shexp`` (including the shared-expert gate ``ffn_gate_inp_shexp``);
- ``router``: ``ffn_gate_inp`` and the expert score bias ``exp_probs_b``;
- ``dense_ffn``: ``ffn_gate``/``ffn_up``/``ffn_down`` of dense layers;
- ``attention``: every ``attn_*`` projection, MLA's ``attn_q_a/q_b/kv_a_mqa/kv_b/k_b/v_b``, ``attn_sinks``;
- ``norm``: every ``*norm*`` tensor (attention-internal q/k norms included: they are vectors);
- ``embeddings``/``output``: the vocabulary matrices;
- ``other``: everything else, and every tensor of a NextN/MTP layer (llama.cpp skips those unless MTP
  speculative decoding is on).
"""

from __future__ import annotations

import re
from enum import Enum


class TensorClass(str, Enum):
    EMBEDDINGS = "embeddings"
    OUTPUT = "output"
    NORM = "norm"
    ATTENTION = "attention"
    ROUTER = "router"
    DENSE_FFN = "dense_ffn"
    SHARED_EXPERT = "shared_expert"
    ROUTED_EXPERT = "routed_expert"
    OTHER = "other"

    def __str__(self) -> str:  # "routed_expert", not "TensorClass.ROUTED_EXPERT"
        return self.value


_LAYER_RE = re.compile(r"^(?:enc\.|dec\.)?blk\.(\d+)\.(.+)$")
# the part of a per-layer name before its suffix (.weight/.bias/.scale ...)
_ROUTED_RE = re.compile(r"^ffn_(?:gate_up|up|down|gate)_(?:ch)?exps(?:\.|$)")
_SHARED_RE = re.compile(r"^ffn_\w*_shexp(?:\.|$)")
_ROUTER_RE = re.compile(r"^(?:ffn_gate_inp|exp_probs_b|ffn_exp_probs_b)(?:\.|$)")
_DENSE_RE = re.compile(r"^ffn_(?:gate_up|up|down|gate)(?:_\d+)?(?:\.|$)")
_ATTN_RE = re.compile(r"^(?:attn_|vis_attn_|indexer)")


def split_layer(name: str) -> tuple[int | None, str]:
    """``"blk.12.ffn_up_exps.weight"`` -> ``(12, "ffn_up_exps.weight")``; global tensors -> ``(None, name)``."""
    m = _LAYER_RE.match(name)
    if m:
        return int(m.group(1)), m.group(2)
    return None, name


def classify(name: str, *, nextn_from: int | None = None) -> tuple[TensorClass, int | None]:
    """Class and layer of a tensor. Layers ``>= nextn_from`` (NextN/MTP blocks) are ``OTHER``."""
    layer, rest = split_layer(name)
    if layer is None:
        base = rest.split(".", 1)[0]
        if base in ("token_embd", "per_layer_token_embd", "token_types", "position_embd"):
            return TensorClass.EMBEDDINGS, None
        if base in ("output", "cls", "cls_out"):
            return TensorClass.OUTPUT, None
        if "norm" in base:
            return TensorClass.NORM, None
        return TensorClass.OTHER, None
    if nextn_from is not None and layer >= nextn_from:
        return TensorClass.OTHER, layer
    if rest.startswith("nextn."):
        return TensorClass.OTHER, layer
    if _ROUTED_RE.match(rest):
        return TensorClass.ROUTED_EXPERT, layer
    if _SHARED_RE.match(rest):
        return TensorClass.SHARED_EXPERT, layer
    if _ROUTER_RE.match(rest):
        return TensorClass.ROUTER, layer
    base = rest.split(".", 1)[0]
    if "norm" in base:
        return TensorClass.NORM, layer
    if _DENSE_RE.match(rest):
        return TensorClass.DENSE_FFN, layer
    if _ATTN_RE.match(rest):
        return TensorClass.ATTENTION, layer
    return TensorClass.OTHER, layer
