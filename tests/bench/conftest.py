"""Fixtures for the bench tests: a tiny Qwen3-MoE-shaped GGUF that the real llama-server loads in well under a
second on a slow CPU (4 layers, 8 experts of which 2 are used, a 512-token byte-level vocabulary)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.model.writer import TensorInfo, Typed, write_gguf

N_VOCAB = 512
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
N_LAYER = 4
N_EXPERT = 8
N_EXPERT_USED = 2
N_FF_EXP = 64


def _byte_chars() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the rest for U+0100..."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_tiny_moe(path: Path, *, seed: int = 0, n_layer: int = N_LAYER) -> Path:
    rng = np.random.default_rng(seed)
    # byte-level BPE vocabulary: 256 byte tokens, merged pairs, then 2 control tokens
    byte_chars = _byte_chars()
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
    types = [1] * (len(tokens) - 2) + [3] * 2     # NORMAL, CONTROL (llama_token_type)
    a = "qwen3moe"
    metadata = {
        "general.architecture": a,
        "general.name": "bench-tiny-moe",
        f"{a}.context_length": 8192,
        f"{a}.embedding_length": N_EMBD,
        f"{a}.block_count": n_layer,
        f"{a}.feed_forward_length": N_FF_EXP * N_EXPERT_USED,
        f"{a}.expert_feed_forward_length": N_FF_EXP,
        f"{a}.attention.head_count": N_HEAD,
        f"{a}.attention.head_count_kv": N_HEAD_KV,
        f"{a}.attention.key_length": HEAD_DIM,
        f"{a}.attention.value_length": HEAD_DIM,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.expert_count": N_EXPERT,
        f"{a}.expert_used_count": N_EXPERT_USED,
        "general.file_type": 1,                     # llama_ftype MOSTLY_F16
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed("i32[]", types),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.ggml.add_bos_token": False,
    }
    tensors: list[tuple[str, np.ndarray]] = []

    def t(name: str, *shape: int, scale: float = 0.05, dtype=np.float16) -> None:
        # numpy shape is the reverse of ggml's ne
        tensors.append((name, (rng.standard_normal(tuple(reversed(shape))) * scale).astype(dtype)))

    def ones(name: str, n: int) -> None:
        tensors.append((name, np.ones(n, dtype=np.float32)))

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
    infos = [TensorInfo(name, data.shape[::-1], "f32" if data.dtype == np.float32 else "f16")
             for name, data in tensors]
    write_gguf(path, metadata, infos, ([data] for _, data in tensors))
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
