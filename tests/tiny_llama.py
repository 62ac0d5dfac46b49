"""A tiny llama-architecture GGUF that a real llama-server loads and generates from (random weights).

Used by the cluster and launch tests and by ``lab/bench/gateway_overhead.py``::

    python tests/tiny_llama.py out.gguf [--embd 64 --layers 2 --ff 128 --heads 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the checkout: run as a script too
from orchestrator.model.writer import TensorInfo, Typed, write_gguf  # noqa: E402

# llama.cpp's token types (llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


def write_tiny_llama(path: Path | str, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, n_ff: int = 128,
                     seed: int = 0) -> Path:
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []

    def tok(text: str, score: float, kind: int) -> None:
        tokens.append(text)
        scores.append(score)
        types.append(kind)

    tok("<unk>", 0.0, _UNKNOWN)
    tok("<s>", 0.0, _CONTROL)
    tok("</s>", 0.0, _CONTROL)
    # byte fallback only for ASCII: whatever the random weights generate is valid UTF-8 (ik_llama.cpp's server
    # answers 500 on invalid UTF-8); prompts must be ASCII, which the tests' are
    for b in range(128):
        tok(f"<0x{b:02X}>", 0.0, _BYTE)
    tok("\u2581", -0.5, _NORMAL)
    for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,!?<>|_/"):
        tok(c, -1.0 - i, _NORMAL)
        tok("\u2581" + c, -1.5 - i, _NORMAL)
    n_vocab = len(tokens)
    metadata = {
        "general.architecture": "llama",
        "llama.context_length": 4096,
        "llama.embedding_length": n_embd,
        "llama.block_count": n_layer,
        "llama.feed_forward_length": n_ff,
        "llama.attention.head_count": n_head,
        "llama.attention.head_count_kv": n_head,
        "llama.rope.dimension_count": n_embd // n_head,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "general.file_type": 0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": Typed("i32[]", types),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tensors: list[tuple[str, np.ndarray]] = []

    def rand(name: str, *shape: int) -> None:   # numpy's shape: ggml's ne reversed
        tensors.append((name, (rng.standard_normal(shape) * 0.02).astype(np.float32)))

    def ones(name: str) -> None:
        tensors.append((name, np.ones(n_embd, np.float32)))

    rand("token_embd.weight", n_vocab, n_embd)
    ones("output_norm.weight")
    rand("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        ones(f"blk.{i}.attn_norm.weight")
        ones(f"blk.{i}.ffn_norm.weight")
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            rand(f"blk.{i}.{n}.weight", n_embd, n_embd)
        rand(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    write_gguf(path, metadata, [TensorInfo(name, a.shape[::-1], "f32") for name, a in tensors],
               ([a] for _, a in tensors))
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ff", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    a = ap.parse_args()
    print(write_tiny_llama(a.out, a.embd, a.layers, a.heads, a.ff))
