"""The model, summarised as the numbers placement and prediction need (bytes and parameters per layer)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.model.classes import TensorClass
from orchestrator.model.info import ModelInfo
from orchestrator.model.memory import cuda_tensor_bytes

# Tensors llama.cpp keeps with the input layer: always on the CPU ("little benefit to offloading the input layer").
_INPUT_CLASSES = {TensorClass.EMBEDDINGS}
_FFN_CLASSES = {TensorClass.ROUTER, TensorClass.DENSE_FFN, TensorClass.SHARED_EXPERT}
# llama.cpp's graphs keep, after the last layer's attention, only the rows of the tokens whose output is needed
# (inp_out_ids: src/models/qwen3moe.cpp, glm4-moe.cpp, deepseek2.cpp, ... `il == n_layer - 1 && inp_out_ids`), so
# a prompt, which needs its last token's logits only, runs the last layer's feed-forward for that one token. gpt-oss's
# graph (openai-moe.cpp) gathers them only for masked next-token embeddings: its last layer runs every token.
LAST_FFN_EVERY_TOKEN = frozenset({"gpt-oss"})


@dataclass(frozen=True)
class ModelCosts:
    arch: str
    n_layers: int                         # block_count as llama.cpp counts it (nextn layers included)
    n_compute_layers: int                 # layers actually evaluated (nextn/MTP layers excluded)
    n_expert: int
    n_expert_used: int
    layer_always: tuple[int, ...]         # bytes per layer that every token reads (attention, norms, router, dense/shared FFN)
    layer_experts: tuple[int, ...]        # routed-expert bytes per layer
    layer_always_params: tuple[int, ...]
    layer_expert_params: tuple[int, ...]  # parameters of ONE routed expert in that layer (gate+up+down)
    input_bytes: int                      # token embeddings: kept on the CPU by llama.cpp
    output_bytes: int                     # output head + final norm: on the GPU holding the output layer
    output_params: int
    # multiply-adds of attention per query token and per position of context it attends to, summed over the
    # evaluated layers: heads x (key width + value width); what prompts pay more of the longer the context
    attn_pair_macs: int = 0
    # VRAM of the routed-expert tensors of a layer beside the weights its MUL_MAT_IDs read (gpt-oss's
    # ffn_*_exps.bias, an ADD_ID each on the experts' output): included in layer_experts; where the expert cache
    # serves a host-resident layer these stay on its GPU, or each of their ops would run on the CPU between the
    # layer's GPU splits
    layer_expert_side_bytes: tuple[int, ...] = ()
    # the layer whose feed-forward a prompt's micro-batches skip (the last evaluated one; None where the graph runs
    # it for every token), and the parameters of that feed-forward beside its routed experts (router, dense FFN,
    # shared experts)
    prompt_skip_ffn_layer: int | None = None
    prompt_skip_ffn_params: int = 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, e in enumerate(self.layer_experts) if e > 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_always) + sum(self.layer_experts) + self.input_bytes + self.output_bytes

    def expert_bytes_per_token(self, layers) -> float:
        """Bytes of routed experts read per generated token from ``layers``."""
        if not self.n_expert:
            return 0.0
        return sum(self.layer_experts[i] for i in layers) * self.n_expert_used / self.n_expert

    def bytes_per_expert(self, layer: int) -> float:
        return self.layer_experts[layer] / self.n_expert if self.n_expert else 0.0


def model_costs(model: ModelInfo) -> ModelCosts:
    n = model.n_layers
    skip_from = n - (model.n_nextn_layers or 0)        # llama.cpp skips loading nextn (MTP) layers
    always = [0] * n
    experts = [0] * n
    always_p = [0] * n
    expert_p = [0] * n
    side = [0] * n
    ffn_p = [0] * n
    input_b = output_b = output_p = 0
    has_output = False
    embd_b = embd_p = 0
    for t in model.tensors:
        size = cuda_tensor_bytes(t)  # what the tensor takes in VRAM (quantized rows padded): budgets are VRAM
        if t.layer is None:
            if t.cls in _INPUT_CLASSES:
                input_b += size
                embd_b, embd_p = size, t.n_elements
            elif t.cls == TensorClass.OTHER:
                continue
            else:
                output_b += size
                output_p += t.n_elements
                if t.cls == TensorClass.OUTPUT and t.name.startswith("output."):
                    has_output = True
            continue
        if t.layer >= skip_from or t.layer >= n or t.cls == TensorClass.OTHER:
            continue
        if t.cls == TensorClass.ROUTED_EXPERT:
            experts[t.layer] += size
            expert_p[t.layer] += t.n_elements
            if not t.name.endswith(".weight"):
                side[t.layer] += size
        else:
            always[t.layer] += size
            always_p[t.layer] += t.n_elements
            if t.cls in _FFN_CLASSES:
                ffn_p[t.layer] += t.n_elements
    if not has_output:  # tied embeddings: llama.cpp duplicates token_embd as the output head
        output_b += embd_b
        output_p += embd_p
    n_exp = model.n_expert or 0
    per_expert_p = [p // n_exp if n_exp else 0 for p in expert_p]
    skip = skip_from - 1 if skip_from > 0 and model.arch not in LAST_FFN_EVERY_TOKEN else None
    return ModelCosts(
        arch=model.arch, n_layers=n, n_compute_layers=skip_from, n_expert=n_exp,
        n_expert_used=model.n_expert_used or 0, layer_always=tuple(always), layer_experts=tuple(experts),
        layer_always_params=tuple(always_p), layer_expert_params=tuple(per_expert_p),
        input_bytes=input_b, output_bytes=output_b, output_params=output_p,
        attn_pair_macs=_attn_pair_macs(model, skip_from), layer_expert_side_bytes=tuple(side),
        prompt_skip_ffn_layer=skip, prompt_skip_ffn_params=ffn_p[skip] if skip is not None else 0,
    )


def _attn_pair_macs(model: ModelInfo, n_compute: int) -> int:
    """Heads x (key + value width) summed over the evaluated layers (recurrent layers have no attention)."""
    heads = tuple(model.n_head_layers or ()) or (model.n_head or 0,) * model.n_layers
    width = (model.head_dim_k or 0) + (model.head_dim_v or 0)
    recurrent = set(model.recurrent_layers or ())
    return sum(int(heads[i] if i < len(heads) else model.n_head or 0) * width
               for i in range(n_compute) if i not in recurrent)
