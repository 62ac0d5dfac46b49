"""A tiny llama-architecture GGUF that a real llama-server loads and generates from (random weights).

Used by the cluster and launch tests and by ``lab/bench/gateway_overhead.py``::

    python tests/tiny_llama.py out.gguf [--embd 64 --layers 2 --ff 128 --heads 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def write_tiny_llama(path: Path | str, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, n_ff: int = 128,
                     seed: int = 0) -> Path:
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    tokens, scores, types = [], [], []

    def tok(text: str, score: float, kind) -> None:
        tokens.append(text.encode())
        scores.append(score)
        types.append(kind)

    tok("<unk>", 0.0, gguf.TokenType.UNKNOWN)
    tok("<s>", 0.0, gguf.TokenType.CONTROL)
    tok("</s>", 0.0, gguf.TokenType.CONTROL)
    # byte fallback only for ASCII: whatever the random weights generate is valid UTF-8 (ik_llama.cpp's server
    # answers 500 on invalid UTF-8); prompts must be ASCII, which the tests' are
    for b in range(128):
        tok(f"<0x{b:02X}>", 0.0, gguf.TokenType.BYTE)
    tok("\u2581", -0.5, gguf.TokenType.NORMAL)
    for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,!?<>|_/"):
        tok(c, -1.0 - i, gguf.TokenType.NORMAL)
        tok("\u2581" + c, -1.5 - i, gguf.TokenType.NORMAL)
    n_vocab = len(tokens)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    rand("token_embd.weight", n_vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    rand("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            rand(f"blk.{i}.{n}.weight", n_embd, n_embd)
        rand(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
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
