"""orchestrator model PATH: what a GGUF model is made of and what it costs in memory."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Read a GGUF model: tensor classes, sizes per layer, KV cache and memory needs"
DESCRIPTION = (
    "Read a GGUF model's header (all shards; never the tensor data) and print its tensor classes by size, the "
    "layers grouped into ranges of identical make-up, and the memory llama.cpp will need for a context: KV "
    "cache, compute buffer and output buffer, for everything on the host. --json prints the documented JSON "
    "(docs/model.md)."
)

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="model .gguf (for a split model, any of its shards), or a model URL, "
                   "hf://ORG/REPO/FILE.gguf or ORG/REPO:QUANT (only the header is read)")
    p.add_argument("--ctx", type=_positive, default=4096, help="context size in tokens (default: 4096)")
    p.add_argument("--parallel", type=_positive, default=1, help="parallel sequences, llama-server -np (default: 1)")
    p.add_argument("--ubatch", type=_positive, default=512, help="micro-batch, llama-server -ub (default: 512)")
    p.add_argument("--batch", type=_positive, default=2048,
                   help="logical batch, llama-server -b (default: 2048); the micro-batch is at most this")
    p.add_argument("--kv", choices=KV_TYPES, default="f16", help="KV cache type for K and V (default: f16)")
    p.add_argument("--kv-unified", action="store_true", help="one KV stream shared by all sequences (-kvu)")
    p.add_argument("--no-flash-attn", action="store_true", help="size for flash attention off (-fa off)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--no-tensors", action="store_true", help="leave the per-tensor list out of --json")
    p.add_argument("--routing", action="store_true",
                   help="measure how the model routes in decode order through llama.cpp and cache the profile "
                        "(expert-cache hit rate by size) by the file's identity; the plan reads it")
    p.add_argument("--prompts", metavar="FILE",
                   help="with --routing: decode this text file instead of the built-in corpus")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--text", dest="trace_input", action="store_const", const="text",
                      help="with --routing: decode text even for a model written by synth-model (the built-in "
                           "corpus of chat turns, prose, code and German, or --prompts FILE), then the model's own "
                           "sampled continuation; the default for every other model")
    what.add_argument("--random", dest="trace_input", action="store_const", const="random",
                      help="with --routing: decode uniformly random token ids instead of text; the default for a "
                           "model written by synth-model (its GGUF general.organization says so)")
    p.add_argument("--tokens", type=_positive, default=1024, help="with --routing: tokens to decode (default 1024)")
    p.add_argument("--sample", type=float, metavar="T",
                   help="with --routing: sample the tokens after the text (or after one random id) from the model "
                        "at temperature T (default 0.8 after text, as llama-server samples; none after random ids)")
    p.add_argument("--gpu-layers", type=_non_negative, default=0, metavar="N",
                   help="with --routing: layers llama.cpp puts on a GPU while tracing (a CUDA build; default 0: "
                        "all on the CPU). A model that fits measures many times faster; the routing is the "
                        "same up to rounding")


def run(args: argparse.Namespace) -> int:
    from orchestrator.model.remote import is_remote, read_model, read_remote_model

    model = read_remote_model(args.path).info if is_remote(args.path) else read_model(args.path)
    for w in model.warnings:
        print(f"orchestrator model: warning: {w}", file=sys.stderr)
    mem = _memory(model, args)
    routing, routing_text = _routing(args, model) if args.routing else (None, "")
    if args.json:
        out = model.to_json(tensors=not args.no_tensors)
        out["memory"] = mem
        if routing is not None:
            out["routing"] = routing
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(render(model, mem))
    if routing is not None:
        print("\n" + routing_text)
    return 0


def _routing(args, model) -> tuple[dict, str]:
    import time

    from orchestrator.errors import ModelError
    from orchestrator.model.routing import describe_input, measure_profile
    from orchestrator.model.routing_profile import format_profile

    if not model.n_expert:
        raise ModelError(f"{args.path}: --routing needs a MoE model (no routed experts)")

    def say(text: str) -> None:
        print(f"orchestrator model: routing: {text}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    prof, path, cached, traced = measure_profile(args.path, tokens=args.tokens, input=args.trace_input or "auto",
                                                 prompts=args.prompts, sample=args.sample,
                                                 gpu_layers=args.gpu_layers, say=say)
    if cached:
        say(f"measured before with these settings: {path}")
    else:
        say(f"traced in {time.monotonic() - t0:.0f} s; profile saved: {path}")
    text = (format_profile(prof) + f"\ntraced: {describe_input(traced)}, {traced['tokens']} tokens"
            + f"\n{'cached' if cached else 'saved'}: {path}")
    return {**prof.to_json(), "traced": traced, "cache_file": str(path), "cached": cached}, text


def _memory(model, args) -> dict:
    from orchestrator.model.memory import (ServerSettings, compute_buffer_estimate, context_layout,
                                           kv_bytes_per_token, kv_cache_bytes, output_buffer_bytes)

    fa = not args.no_flash_attn
    if not fa and args.kv not in ("f16", "f32", "bf16"):
        from orchestrator.errors import ConfigError
        raise ConfigError(f"--kv {args.kv} needs flash attention (llama.cpp rejects a quantized V cache without it)")
    s = ServerSettings(n_ctx=args.ctx, n_parallel=args.parallel, n_ubatch=args.ubatch, n_batch=args.batch,
                       flash_attn=fa, type_k=args.kv, type_v=args.kv, kv_unified=args.kv_unified)
    lay = context_layout(model, s.n_ctx, s.n_parallel, n_ubatch=s.n_ubatch, kv_unified=s.kv_unified,
                         flash_attn=fa, n_batch=s.n_batch)
    kv = kv_cache_bytes(model, s.n_ctx, s.n_parallel, s.type_k, s.type_v, kv_unified=s.kv_unified,
                        n_ubatch=s.n_ubatch, flash_attn=fa, n_batch=s.n_batch)
    comp = compute_buffer_estimate(model, n_ubatch=s.n_ubatch, n_ctx=s.n_ctx, device="CPU", flash_attn=fa,
                                   n_parallel=s.n_parallel, kv_unified=s.kv_unified, type_k=s.type_k,
                                   type_v=s.type_v, n_batch=s.n_batch)
    out_b = output_buffer_bytes(model, s.n_parallel)
    weights = model.loaded_bytes()
    return {
        "settings": {"n_ctx": s.n_ctx, "n_parallel": s.n_parallel, "n_ubatch": s.n_ubatch, "type_k": s.type_k,
                     "type_v": s.type_v, "kv_unified": s.kv_unified, "flash_attn": fa},
        "n_batch": s.n_batch, "n_ubatch_effective": lay.n_ubatch,
        "n_ctx_padded": lay.n_ctx, "n_ctx_seq": lay.n_ctx_seq, "n_stream": lay.n_stream,
        "swa_cells": lay.cells_swa,
        "weights": weights,
        "kv_cache": kv,
        "kv_per_token": kv_bytes_per_token(model, s.type_k, s.type_v, flash_attn=fa),
        "compute_cpu": comp.total,
        "compute_phase": comp.phase,
        "output": out_b,
        "total_cpu": weights + kv + comp.total + out_b,
    }


def _params(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


def _layer_groups(model) -> list[tuple[int, int, str, dict]]:
    """Consecutive layers with the same make-up (tensor names minus the layer number, types and bytes)."""
    from orchestrator.model.classes import split_layer

    sig: dict[int, tuple] = {}
    for t in model.tensors:
        if t.layer is None:
            continue
        _, rest = split_layer(t.name)
        sig.setdefault(t.layer, []).append((rest, t.type, t.bytes))  # type: ignore[arg-type]
    groups: list[tuple[int, int, str, dict]] = []
    moe = set(model.moe_layers)
    for layer in sorted(sig):
        key = tuple(sorted(sig[layer]))
        if model.n_nextn_layers and layer >= model.n_trunk_layers:
            kind = "mtp"
        else:
            kind = "moe" if layer in moe else "dense"
        if groups and groups[-1][1] == layer - 1 and groups[-1][2] == kind and groups[-1][3]["_key"] == key:
            a, _, k, d = groups[-1]
            groups[-1] = (a, layer, k, d)
        else:
            groups.append((layer, layer, kind, {"_key": key, "bytes": model.layer_bytes(layer)}))
    return groups


def render(model, mem: dict) -> str:
    from orchestrator.model.classes import TensorClass
    from orchestrator.units import fmt_bytes

    lines: list = []                           # text lines and rich tables, in order
    shards = len(model.paths)
    lines.append(f"model   {model.path}" + (f" (+{shards - 1} more shards)" if shards > 1 else ""))
    lines.append(f"arch    {model.arch}" + (f"  name {model.name}" if model.name else "")
                 + f"  file {fmt_bytes(model.file_bytes)}")
    layers = f"{model.n_layers} layers" + (f" ({model.n_nextn_layers} MTP)" if model.n_nextn_layers else "")
    attn = f"heads {model.n_head}/{model.n_head_kv} x {model.head_dim_k}"
    if model.mla:
        attn = (f"heads {model.n_head} MLA (kv_lora {model.mla.kv_lora_rank}, rope {model.mla.qk_rope_head_dim}, "
                f"q_lora {model.mla.q_lora_rank})")
    lines.append(f"shape   {layers}, embd {model.n_embd}, {attn}, vocab {model.n_vocab}, trained ctx {model.n_ctx_train}")
    if model.n_expert:
        moe = (f"experts {model.n_expert} ({model.n_expert_used} used"
               + (f", {model.n_expert_shared} shared" if model.n_expert_shared else "") + f"), expert ffn {model.n_ff_exp}")
        if model.n_dense_lead:
            moe += f", {model.n_dense_lead} leading dense layers (ffn {model.n_ff})"
        lines.append(f"moe     {moe}")
    if model.swa_layers:
        lines.append(f"swa     window {model.sliding_window} on {len(model.swa_layers)} of {model.n_trunk_layers} layers"
                     + (" (chunked)" if model.swa_chunked else ""))
    lines.append(f"params  {_params(model.params_total)} total, {_params(model.params_active)} active per token")

    from rich import box
    from rich.table import Table

    by_class = model.bytes_by_class()
    total = sum(by_class.values()) or 1
    classes = Table(box=box.SIMPLE_HEAD, show_footer=True)
    classes.add_column("class", footer="total")
    classes.add_column("bytes", justify="right", footer=fmt_bytes(total))
    classes.add_column("share", justify="right")
    for c in TensorClass:
        if by_class[c]:
            classes.add_row(c.value, fmt_bytes(by_class[c]), f"{by_class[c] / total * 100:.1f}%")
    lines.append(classes)

    cols = [TensorClass.ATTENTION, TensorClass.NORM, TensorClass.ROUTER, TensorClass.DENSE_FFN,
            TensorClass.SHARED_EXPERT, TensorClass.ROUTED_EXPERT, TensorClass.OTHER]
    short = {TensorClass.ATTENTION: "attention", TensorClass.NORM: "norm", TensorClass.ROUTER: "router",
             TensorClass.DENSE_FFN: "dense_ffn", TensorClass.SHARED_EXPERT: "shared", TensorClass.ROUTED_EXPERT:
             "experts", TensorClass.OTHER: "other"}
    per_layer = Table(title="per layer", title_justify="left", box=box.SIMPLE_HEAD)
    per_layer.add_column("layers", justify="right")
    per_layer.add_column("kind")
    for c in cols:
        per_layer.add_column(short[c], justify="right")
    per_layer.add_column("layer", justify="right")
    per_layer.add_column("all", justify="right")
    for a, b, kind, d in _layer_groups(model):
        per = d["bytes"]
        one = sum(per.values())
        per_layer.add_row(f"{a}" if a == b else f"{a}-{b}", kind, *(fmt_bytes(per[c]) if per[c] else "-" for c in cols),
                          fmt_bytes(one), fmt_bytes(one * (b - a + 1)))
    lines.append(per_layer)
    if model.moe_layers:
        l0 = model.moe_layers[0]
        lines.append(f"one routed expert of layer {l0}: {fmt_bytes(model.bytes_per_expert(l0))}; "
                     f"{model.n_expert_used} used per token: {fmt_bytes(model.bytes_per_expert(l0) * model.n_expert_used)}")
    glob = model.global_bytes()
    lines.append("globals: " + ", ".join(f"{c.value} {fmt_bytes(v)}" for c, v in glob.items() if v))
    lines.append("")

    s = mem["settings"]
    lines.append(f"memory for ctx {s['n_ctx']} (padded {mem['n_ctx_padded']}), parallel {s['n_parallel']}"
                 + (" unified" if s["kv_unified"] else "") + f", ubatch {mem['n_ubatch_effective']}"
                 + (f" (--ubatch {s['n_ubatch']} is capped by --batch {mem['n_batch']})"
                    if mem["n_ubatch_effective"] < min(s["n_ubatch"], mem["n_ctx_padded"]) else "")
                 + f", kv {s['type_k']}, flash attention {'on' if s['flash_attn'] else 'off'}:")
    lines.append(f"  weights loaded   {fmt_bytes(mem['weights']):>12s}")
    lines.append(f"  KV cache         {fmt_bytes(mem['kv_cache']):>12s}   ({fmt_bytes(mem['kv_per_token'])} per token of context"
                 + (f"; SWA layers {mem['swa_cells']} cells" if mem["swa_cells"] else "") + ")")
    lines.append(f"  compute (CPU)    {fmt_bytes(mem['compute_cpu']):>12s}   (peak in the {mem['compute_phase']} phase)")
    lines.append(f"  output           {fmt_bytes(mem['output']):>12s}")
    lines.append(f"  all on the host  {fmt_bytes(mem['total_cpu']):>12s}")
    for w in model.warnings:
        lines.append(f"warning: {w}")
    return _to_text(lines)


def _to_text(items: list, width: int = 200) -> str:
    import io

    from rich.console import Console
    from rich.text import Text

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)
    for item in items:
        console.print(Text(item, no_wrap=True, overflow="ignore") if isinstance(item, str) else item)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
