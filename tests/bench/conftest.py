"""Fixtures for the bench tests: a tiny Qwen3-MoE-shaped GGUF that the real llama-server loads in well under a
second on a slow CPU (4 layers, 8 experts of which 2 are used, a 512-token byte-level vocabulary)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

N_VOCAB = 512
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
N_LAYER = 4
N_EXPERT = 8
N_EXPERT_USED = 2
N_FF_EXP = 64


def write_tiny_moe(path: Path, *, seed: int = 0, n_layer: int = N_LAYER) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("bench-tiny-moe")
    w.add_context_length(8192)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF_EXP * N_EXPERT_USED)
    w.add_expert_feed_forward_length(N_FF_EXP)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_EXPERT_USED)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    # byte-level BPE vocabulary: 256 byte tokens, merged pairs, then 2 control tokens
    byte_chars = gguf.vocab_bytes_to_unicode() if hasattr(gguf, "vocab_bytes_to_unicode") else None
    if byte_chars is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        byte_chars = dict(zip(bs, (chr(c) for c in cs)))
    tokens = [byte_chars[b] for b in range(256)]
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            if len(tokens) >= N_VOCAB - 2:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    tokens += ["<|bos|>", "<|eos|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)

    def t(name: str, *shape: int, scale: float = 0.05, dtype=np.float16) -> None:
        # numpy shape is the reverse of ggml's ne
        w.add_tensor(name, (rng.standard_normal(tuple(reversed(shape))) * scale).astype(dtype))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", N_EMBD, N_VOCAB)
    ones("output_norm.weight", N_EMBD)
    t("output.weight", N_EMBD, N_VOCAB)
    for i in range(n_layer):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", N_EMBD)
        t(p + "attn_q.weight", N_EMBD, HEAD_DIM * N_HEAD)
        t(p + "attn_k.weight", N_EMBD, HEAD_DIM * N_HEAD_KV)
        t(p + "attn_v.weight", N_EMBD, HEAD_DIM * N_HEAD_KV)
        t(p + "attn_output.weight", HEAD_DIM * N_HEAD, N_EMBD)
        ones(p + "attn_q_norm.weight", HEAD_DIM)
        ones(p + "attn_k_norm.weight", HEAD_DIM)
        ones(p + "ffn_norm.weight", N_EMBD)
        t(p + "ffn_gate_inp.weight", N_EMBD, N_EXPERT, dtype=np.float32)
        t(p + "ffn_gate_exps.weight", N_EMBD, N_FF_EXP, N_EXPERT)
        t(p + "ffn_up_exps.weight", N_EMBD, N_FF_EXP, N_EXPERT)
        t(p + "ffn_down_exps.weight", N_FF_EXP, N_EMBD, N_EXPERT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("bench-model") / "tiny-moe.gguf")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, llama_server_path):
    """A real llama-server on the tiny model: 2 slots of 512 tokens, 1 thread. Yields its URL."""
    from orchestrator.bench.server import default_launcher, free_port
    from orchestrator.launch.spec import LaunchSpec

    d = tmp_path_factory.mktemp("bench-server")
    model = write_tiny_moe(d / "tiny.gguf", seed=1)
    port = free_port()
    spec = LaunchSpec(name="bench-test", argv=(llama_server_path, "-m", str(model), "-c", "1024", "-np", "2",
                                               "-t", "1", "--host", "127.0.0.1", "--port", str(port)),
                      host="127.0.0.1", port=port)
    proc = default_launcher()(spec, d / "server.log")
    try:
        proc.wait_healthy(60)
        yield spec.url
    finally:
        proc.stop()
