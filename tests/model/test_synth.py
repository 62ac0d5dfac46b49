"""The synthetic GGUF writer: the file read back with gguf's own reader, weight statistics, the tokenizer, and
what is left on disk when writing fails or is interrupted."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.errors import ModelError
from orchestrator.model import shapes as S
from orchestrator.model import synth

gguf = pytest.importorskip("gguf")  # the reader used to check the file; the writer itself does not need it

REPO = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for like, scale, quant in (("qwen3-30b-a3b", 0.05, "q4_0"), ("deepseek-v3", 0.03, "q8_0"),
                               ("gpt-oss-120b", 0.05, "q4_0")):
        path = d / f"{like}.gguf"
        out[like] = (synth.write_model(path, like, scale=scale, quant=quant, seed=7), quant)
    return out


@pytest.mark.parametrize("like", ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"])
def test_file_reads_back_with_every_tensor_and_key(small_models, like):
    res, quant = small_models[like]
    specs = S.tensor_specs(res.shape, quant)
    r = gguf.GGUFReader(res.path)
    assert [t.name for t in r.tensors] == [s.name for s in specs]
    for t, s in zip(r.tensors, specs):
        assert tuple(int(x) for x in t.shape) == s.ne, t.name
        assert int(t.tensor_type) == S.GGML_TYPE_ID[s.type], t.name
        assert int(t.n_bytes) == s.nbytes, t.name
    fields = r.fields
    for key, val, kind in S.metadata(res.shape, quant):
        f = fields[key]
        got = f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]
        if kind == "f32":
            assert got == pytest.approx(val, rel=1e-6), key
        else:
            assert got == val, key
    n_vocab = res.shape.n_vocab
    assert len(fields["tokenizer.ggml.tokens"].data) == n_vocab
    assert len(fields["tokenizer.ggml.token_type"].data) == n_vocab
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert os.path.getsize(res.path) == res.bytes
    # the data section ends exactly at the end of the file
    last = r.tensors[-1]
    assert last.data_offset + last.n_bytes <= res.bytes < last.data_offset + last.n_bytes + synth.ALIGNMENT


def test_same_seed_same_file_other_seed_other_weights(tmp_path):
    a = synth.write_model(tmp_path / "a.gguf", "qwen3-30b-a3b", scale=0.03, seed=1).path
    b = synth.write_model(tmp_path / "b.gguf", "qwen3-30b-a3b", scale=0.03, seed=1).path
    c = synth.write_model(tmp_path / "c.gguf", "qwen3-30b-a3b", scale=0.03, seed=2).path
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    assert os.path.getsize(a) == os.path.getsize(c)


def test_experts_and_layers_get_different_weights(small_models):
    res, _ = small_models["qwen3-30b-a3b"]
    r = gguf.GGUFReader(res.path)
    t = {x.name: x for x in r.tensors}
    up0 = np.asarray(t["blk.0.ffn_up_exps.weight"].data).reshape(res.shape.n_expert, -1)
    assert len({bytes(up0[e]) for e in range(res.shape.n_expert)}) == res.shape.n_expert
    up1 = np.asarray(t["blk.1.ffn_up_exps.weight"].data).reshape(res.shape.n_expert, -1)
    assert bytes(up0) != bytes(up1)
    emb = np.asarray(t["token_embd.weight"].data).reshape(res.shape.n_vocab, -1)
    assert len({bytes(row) for row in emb[:2000]}) == 2000


def _q4_0_values(blocks: np.ndarray) -> np.ndarray:
    """Reference dequantization of q4_0 blocks (18 bytes: f16 scale, 16 bytes of nibbles)."""
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8.0
    return q * d


def _q8_0_values(blocks: np.ndarray) -> np.ndarray:
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * d


def _mxfp4_values(blocks: np.ndarray) -> np.ndarray:
    table = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
    scale = np.ldexp(np.float32(1.0), blocks[:, :1].astype(np.int32) - 128)
    qs = blocks[:, 1:]
    return np.concatenate([table[qs & 0x0F], table[qs >> 4]], axis=1) * scale


@pytest.mark.parametrize("qtype,decode", [("q4_0", _q4_0_values), ("q8_0", _q8_0_values),
                                          ("mxfp4", _mxfp4_values)])
def test_blocks_have_the_target_rms_no_bias_and_finite_scales(qtype, decode):
    rng = synth._Rng(3)
    target = 0.02
    blocks = synth.make_blocks(qtype, 20000, target, rng)
    v = decode(blocks)
    assert np.isfinite(v).all()
    rms = float(np.sqrt(np.mean(v.astype(np.float64) ** 2)))
    assert rms == pytest.approx(target, rel=0.3 if qtype == "mxfp4" else 0.05)  # mxfp4: power-of-two scales
    # no common bias: the mean is tiny next to the RMS
    assert abs(float(v.mean())) < 0.01 * rms
    if qtype != "mxfp4":
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32).ravel()
        assert np.isfinite(d).all() and (d != 0).all()
        assert 0.45 < float((d < 0).mean()) < 0.55      # random sign per block
        assert len(np.unique(np.abs(d))) == 1            # one fixed magnitude


def test_naive_blocks_carry_the_bias_that_collapses_routing():
    blocks = synth.make_blocks("q4_0", 20000, 0.02, synth._Rng(3), signed=False)
    v = _q4_0_values(blocks)
    rms = float(np.sqrt(np.mean(v ** 2)))
    assert float(v.mean()) < -0.08 * rms   # q - 8 averages -0.5: every weight leans the same way


def test_q6_k_blocks():
    blocks = synth.make_blocks("q6_k", 5000, 0.02, synth._Rng(4))
    assert blocks.shape == (5000, 210)
    sc = blocks[:, 192:208].view(np.int8)
    assert set(np.unique(sc)) == {-synth._Q6_K_SUBSCALE, synth._Q6_K_SUBSCALE}
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    assert np.isfinite(d).all() and (d > 0).all()


def test_vocab_is_a_consistent_byte_level_bpe():
    s = S.scaled(S.get("qwen3-30b-a3b"), 0.05)
    tokens, types, merges, special = synth.build_vocab(s)
    assert len(tokens) == len(types) == s.n_vocab
    assert len(set(tokens)) == len(tokens)  # llama.cpp maps text -> id: duplicates would break it
    index = set(tokens)
    for m in merges:
        left, right = m.split(" ")
        assert left in index and right in index and left + right in index
    assert len(merges) == len(set(merges))
    assert special["eos"] == s.n_vocab - 291 and tokens[special["eos"]] == "<|im_end|>"
    assert types[special["eos"]] == 3
    # all 256 byte tokens exist (byte-level BPE can encode any input)
    assert len(set(synth._bytes_to_unicode()) & index) == 256


def test_full_size_vocab_has_the_real_size_and_ids():
    s = S.get("gpt-oss-120b")
    tokens, types, merges, special = synth.build_vocab(s)
    assert len(tokens) == 201088
    assert special == {"bos": 199998, "pad": 199999, "eos": 200002}
    assert tokens[200006] == "<|start|>"


def test_unknown_like_and_bad_scale_are_model_errors(tmp_path):
    with pytest.raises(ModelError, match="valid names: deepseek-v3"):
        synth.write_model(tmp_path / "x.gguf", "mixtral")
    with pytest.raises(ModelError, match="--scale"):
        synth.write_model(tmp_path / "x.gguf", "qwen3-30b-a3b", scale=2.0)
    assert list(tmp_path.iterdir()) == []


def test_missing_directory_or_directory_as_out(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        synth.write_model(tmp_path / "nope" / "x.gguf", "qwen3-30b-a3b", scale=0.03)
    with pytest.raises(ModelError, match="is a directory"):
        synth.write_model(tmp_path, "qwen3-30b-a3b", scale=0.03)
    with pytest.raises(ModelError, match="cannot write"):
        synth.write_model("/proc/orchestrator-synth-test.gguf", "qwen3-30b-a3b", scale=0.03)
    assert list(tmp_path.iterdir()) == []


def test_interrupt_mid_write_removes_the_partial_file(tmp_path):
    out = tmp_path / "m.gguf"

    def boom(done, total):
        assert (tmp_path / "m.gguf.part").exists()
        if done > total // 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synth.write_model(out, "qwen3-30b-a3b", scale=0.05, progress=boom)
    assert list(tmp_path.iterdir()) == []


def test_existing_out_is_replaced_only_when_complete(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")

    def boom(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synth.write_model(out, "qwen3-30b-a3b", scale=0.03, progress=boom)
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    synth.write_model(out, "qwen3-30b-a3b", scale=0.03)
    assert out.read_bytes()[:4] == b"GGUF"


def _cli(*args, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "orchestrator", "synth-model", *args], capture_output=True,
                          text=True, env=env, **kw)


def test_cli_write_failure_is_one_line_and_leaves_nothing(tmp_path):
    # a file size limit makes write() fail with EFBIG half way, like a full disk
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))

    out = tmp_path / "m.gguf"
    res = _cli(str(out), "--like", "qwen3-30b-a3b", "--scale", "0.05", preexec_fn=limit)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    err = [ln for ln in res.stderr.splitlines() if "error" in ln]
    assert len(err) == 1 and str(out) in err[0] and "write failed" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_cli_unknown_like_lists_names():
    res = _cli("x.gguf", "--like", "nope")
    assert res.returncode == 2
    assert "valid names" in res.stderr and "qwen3-235b-a22b" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_list_and_dry_run():
    res = _cli("--list")
    assert res.returncode == 0
    assert all(name in res.stdout for name in S.names())
    res = _cli("--like", "qwen3-30b-a3b", "--dry-run")
    assert res.returncode == 0
    assert int(res.stdout.strip()) == S.total_bytes(S.tensor_specs(S.get("qwen3-30b-a3b")))


def test_cli_expert_quant_writes_the_experts_in_that_type(tmp_path):
    from orchestrator.model import read_model

    out = tmp_path / "oss.gguf"
    res = _cli(str(out), "--like", "gpt-oss-20b", "--scale", "0.05", "--expert-quant", "q4_0")
    assert res.returncode == 0, res.stderr
    assert "experts q4_0" in res.stderr
    types = {t.name: t.type for t in read_model(out).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == "Q4_0" and types["blk.1.ffn_down_exps.weight"] == "Q4_0"
    assert types["blk.0.attn_q.weight"] == "Q8_0"
    bad = _cli(str(tmp_path / "x.gguf"), "--like", "gpt-oss-20b", "--expert-quant", "q5_0")
    assert bad.returncode == 2 and "invalid choice: 'q5_0'" in bad.stderr and not (tmp_path / "x.gguf").exists()


def _interactive_stop_signals() -> None:
    """The writer gets the stop signals a program started from a shell gets, whatever this run inherited
    (`nohup` ignores SIGHUP, and an ignored SIGHUP stays ignored by design)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_cli_signal_mid_write_leaves_nothing(tmp_path, sig):
    """A real signal to a real writer: the partial file is removed and nothing else is left."""
    out = tmp_path / "big.gguf"
    part = tmp_path / "big.gguf.part"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "synth-model", str(out), "--like",
                             "qwen3-30b-a3b", "--layers", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=_interactive_stop_signals)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if part.exists() and part.stat().st_size > (32 << 20):
                break
            if proc.poll() is not None:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the writer finished before it could be interrupted"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT
    assert "interrupted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("like", S.names())
@pytest.mark.parametrize("quant", S.QUANTS)
def test_every_full_size_scale_is_a_normal_f16(like, quant):
    """Subnormal or zero scales would be legal but not sane: every block scale of every tensor is a normal f16."""
    for sp in S.tensor_specs(S.get(like), quant):
        if sp.type == "f32":
            continue
        b = synth.make_blocks(sp.type, 64, synth._scale_for(sp), synth._Rng(0))
        if sp.type in ("q4_0", "q8_0"):
            d = np.abs(b[:, :2].copy().view(np.float16).astype(np.float32))
        elif sp.type == "q6_k":
            d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
        else:
            d = np.ldexp(np.float32(1.0), b[:, :1].astype(np.int32) - 128)
        assert (d >= np.finfo(np.float16).tiny).all() and np.isfinite(d).all(), sp.name
