"""synth-model --locality: the weights that make routing local in time (read back from the written file).
The routing they produce is measured through llama.cpp in tests/integration/test_routing.py and recorded in
tests/model/test_routing_calibration.py."""

from __future__ import annotations

import numpy as np
import pytest

from dataclasses import replace

from orchestrator.errors import ModelError
from orchestrator.model import shapes as S
from orchestrator.model import synth

gguf = pytest.importorskip("gguf")


def _tensors(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: t for t in r.tensors}


def _q8_values(t, n_embd):
    """Dequantize a Q8_0 tensor's raw blocks: (rows, n_embd)."""
    raw = np.asarray(t.data, np.uint8).reshape(-1, 34)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)
    q = raw[:, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(-1, n_embd)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("loc")
    out = {}
    for name, loc in (("default", None), ("off", 0.0)):
        out[name] = synth.write_model(d / f"{name}.gguf", "qwen3-30b-a3b", scale=0.125, quant="q8_0", seed=2,
                                      locality=loc, fsync=False)
    return out


def test_default_locality_writes_the_window_and_the_context_block(models):
    res = models["default"]
    assert res.locality == synth.DEFAULT_LOCALITY
    shape = res.shape
    lp = synth.locality_plan(shape, res.locality)
    t = _tensors(res.path)
    emb = _q8_values(t["token_embd.weight"], shape.n_embd)
    assert np.allclose(emb[:, :32], emb[0, :32]) and emb[0, 0] > 0.5          # bias block: same for every token
    assert not emb[:, 32:64].any()                                              # context block: nothing
    qn = np.asarray(t["blk.0.attn_q_norm.weight"].data)
    assert qn[lp.rope_dim] == pytest.approx(lp.norm_weight) and np.count_nonzero(qn) == 1
    q = _q8_values(t["blk.0.attn_q.weight"], shape.n_embd)
    win = q[lp.rope_dim::shape.head_dim]
    assert win.shape[0] == shape.n_head and not win[:, 32:].any() and (win[:, :32] > 0).all()
    v = _q8_values(t["blk.3.attn_v.weight"], shape.n_embd)
    assert not v[:, :64].any() and v[:, 64:].any()
    o = _q8_values(t["blk.3.attn_output.weight"], shape.n_head * shape.head_dim)   # rows: residual dims
    assert not o[:32].any() and o[32:64].std() > 2 * o[64:].std()
    router = np.asarray(t["blk.5.ffn_gate_inp.weight"].data)                        # (n_expert, n_embd)
    assert not router[:, :32].any() and router[:, 32:64].std() > 3 * router[:, 64:].std()
    down = np.asarray(t["blk.2.ffn_down_exps.weight"].data, np.uint8).reshape(shape.n_expert, shape.n_embd, -1)
    assert not down[:, :64].any() and down[:, 64:].any()
    # the window: a Gaussian of about LOCALITY_WINDOW tokens that does not come back within 4096 tokens
    assert 2 * np.pi / lp.theta > 4096
    assert 1 / (lp.theta * np.sqrt(lp.score)) == pytest.approx(synth.LOCALITY_WINDOW)


def test_locality_zero_is_the_independent_generator(models):
    t = _tensors(models["off"].path)
    n = models["off"].shape.n_embd
    assert (np.asarray(t["blk.0.attn_q_norm.weight"].data) == 1).all()
    emb = _q8_values(t["token_embd.weight"], n)
    assert emb[:, 32:64].any() and not np.allclose(emb[:, :32], emb[0, :32])
    # same size either way: locality changes values, never the tensors
    assert models["off"].bytes == models["default"].bytes


def test_locality_levels_and_limits():
    qwen = S.scaled(S.get("qwen3-30b-a3b"), 0.125)
    assert synth.default_locality(qwen) == synth.DEFAULT_LOCALITY
    for like in ("deepseek-v3", "kimi-k2", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air", "glm-4.5"):
        assert synth.default_locality(S.scaled(S.get(like), 0.05)) == synth.DEFAULT_LOCALITY, like
    assert synth.locality_plan(qwen, 0.0) is None
    # MLA without a q_lora (DeepSeek-V2-Lite's layout) cannot make the window's query independent of the token
    lite = replace(S.scaled(S.get("deepseek-v3"), 0.05), q_lora_rank=0)
    assert synth.default_locality(lite) == 0.0
    with pytest.raises(ModelError, match="has no q_lora"):
        synth.locality_plan(lite, 0.5)
    with pytest.raises(ModelError, match="0 <= L < 1"):
        synth.locality_plan(qwen, 1.0)
    # more locality: more router gain on the context block, in every layer
    lo, hi = synth.locality_plan(qwen, 0.5), synth.locality_plan(qwen, 0.9)
    for layer in (0, 5):
        assert synth._context_router_gain(qwen, hi, layer) > synth._context_router_gain(qwen, lo, layer)


def test_cli_writes_locality_for_every_family(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "m.gguf"
    res = subprocess.run([sys.executable, "-m", "orchestrator", "synth-model", str(out), "--like", "kimi-k2",
                          "--scale", "0.05", "--layers", "2", "--locality", "high", "--dry-run"],
                         capture_output=True, text=True, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and f"routing locality {synth.HIGH_LOCALITY:g}" in res.stderr, res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fam")
    return {like: synth.write_model(d / f"{like}.gguf", like, scale=scale, layers=layers, quant="q8_0", seed=3,
                                    fsync=False)
            for like, scale, layers in (("deepseek-v3", 0.05, 4), ("gpt-oss-20b", 0.1, 2), ("glm-4.5-air", 0.05, 3))}


def test_mla_window_reads_only_the_bias_block(family_models):
    """deepseek2: q_a has one live row reading the bias block; q_b gives every head one RoPE dim from it; kv_a's
    rope rows hold the window dim only, its latent rows do not read the bias or context blocks."""
    res = family_models["deepseek-v3"]
    s, lp = res.shape, synth.locality_plan(res.shape, res.locality)
    # a low peak score (the keys vary with each token's residual), its period past a profile's 1024 positions
    assert lp.mode == "mla" and lp.score < 40 and 2 * np.pi / lp.theta > 1024
    t = _tensors(res.path)
    qa = _q8_values(t["blk.1.attn_q_a.weight"], s.n_embd)
    assert qa[0, :32].all() and not qa[0, 32:].any() and not qa[1:].any()
    k_mla = s.qk_nope_dim + s.qk_rope_dim
    qb = _q8_values(t["blk.1.attn_q_b.weight"], s.q_lora_rank).reshape(s.n_head, k_mla, s.q_lora_rank)
    live = qb[:, s.qk_nope_dim + 2 * lp.rope_dim]
    assert (live[:, 0] > 0).all() and not live[:, 1:].any()
    qb[:, s.qk_nope_dim + 2 * lp.rope_dim] = 0
    assert not qb.any()                                   # the nope part and every other rope dim: zero
    kv = _q8_values(t["blk.1.attn_kv_a_mqa.weight"], s.n_embd)
    assert not kv[: s.kv_lora_rank, :64].any() and kv[: s.kv_lora_rank, 64:].any()
    rope = kv[s.kv_lora_rank:]
    assert (rope[2 * lp.rope_dim, :32] > 0).all() and np.count_nonzero(rope) == 32
    # deeper layers read the bias block up by the residual's expected growth (the attention norm divides by it)
    deep = _q8_values(t["blk.3.attn_kv_a_mqa.weight"], s.n_embd)[s.kv_lora_rank + 2 * lp.rope_dim, 0]
    grow = synth._residual_rms(s, 3) / synth._residual_rms(s, 1)
    assert grow > 1.05 and deep / rope[2 * lp.rope_dim, 0] == pytest.approx(grow, rel=0.02)
    for name in ("blk.0.ffn_down.weight", "blk.3.ffn_down_shexp.weight"):   # dense and shared expert
        down = _q8_values(t[name], t[name].shape[0])
        assert not down[:64].any() and down[64:].any(), name
    router = np.asarray(t["blk.3.ffn_gate_inp.weight"].data)
    assert not router[:, :32].any() and router[:, 32:64].std() > 3 * router[:, 64:].std()


def test_direct_window_without_qk_norms(family_models):
    """gpt-oss and glm-4.5-air have no q/k norms: every q/k row is zero and the window's q and k are the
    projections' biases on its dim, the same for every token (q.k = the planned score exactly); nothing writes
    the bias and context blocks (biases included)."""
    for like in ("gpt-oss-20b", "glm-4.5-air"):
        res = family_models[like]
        s, lp = res.shape, synth.locality_plan(res.shape, res.locality)
        assert lp.mode == "direct" and 2 * np.pi / lp.theta > 4096, like
        t = _tensors(res.path)
        layer = s.n_layer - 1
        for w in ("attn_q", "attn_k"):
            assert not _q8_values(t[f"blk.{layer}.{w}.weight"], s.n_embd).any(), (like, w)
            b = np.array(t[f"blk.{layer}.{w}.bias"].data).reshape(-1, s.head_dim)
            assert (b[:, lp.rope_dim] == np.float32(lp.read)).all(), (like, w)
            b[:, lp.rope_dim] = 0
            assert not b.any(), (like, w)
        q_k = lp.read ** 2 * synth._kq_scale(s) * synth._rope_amplitude(s) ** 2
        assert q_k == pytest.approx(lp.score) and lp.score == pytest.approx(1 / (lp.theta * lp.window) ** 2)
        o = np.asarray(t[f"blk.{layer}.attn_output.weight"].data)
        assert o.size
        if like == "gpt-oss-20b":
            assert not np.asarray(t[f"blk.{layer}.attn_output.bias"].data)[:64].any()
            assert not np.asarray(t[f"blk.{layer}.ffn_down_exps.bias"].data)[:, :64].any()


def test_context_gain_follows_the_share_of_experts_a_token_picks():
    """A router that picks a smaller share of its experts than the calibration's 8 of 128 gets the context at
    proportionally lower odds (never higher); Qwen3's shapes keep the calibration's gain."""
    def gain(like):
        s = S.scaled(S.get(like), 0.1)
        return synth._context_router_gain(s, synth.locality_plan(s, synth.DEFAULT_LOCALITY), 4), s

    q, qs = gain("qwen3-30b-a3b")

    def plain(s):
        lp = synth.locality_plan(s, synth.DEFAULT_LOCALITY)
        ctx_rms = 2.0 / np.sqrt(1.77 * lp.window) * np.sqrt(5)      # five window averages by layer 4
        return np.sqrt(lp.share / (1 - lp.share) * (s.n_embd - 64) / 32) / ctx_rms

    assert q == pytest.approx(plain(qs))
    for like, odds in (("deepseek-v3", 0.5), ("kimi-k2", 1 / 3), ("gpt-oss-120b", 0.5), ("gpt-oss-20b", 1.0)):
        g, s = gain(like)
        base = plain(s)
        assert g == pytest.approx(base * np.sqrt(odds)), like


def test_mla_window_is_narrowed_by_the_shares_response():
    """The MLA window narrows by how much more its router's context share moves with the context's strength than
    the calibration's (odds o: o / (1 + o)^2), on the pair of the full width (the same period), its score at most
    _MLA_SCORE_MAX; never wider than LOCALITY_WINDOW. The other attention kinds keep LOCALITY_WINDOW."""
    def response(o):
        return o / (1 + o) ** 2

    cal = synth.DEFAULT_LOCALITY / (1 - synth.DEFAULT_LOCALITY)
    for like, pick_odds in (("deepseek-v3", 0.5), ("kimi-k2", 1 / 3)):
        s = S.scaled(S.get(like), 0.1)
        lp = synth.locality_plan(s, synth.DEFAULT_LOCALITY)
        wide = synth.locality_plan(s, 0.01)             # odds near 0: the responses' ratio is above 1, not taken
        assert wide.window == synth.LOCALITY_WINDOW and lp.theta == wide.theta and lp.rope_dim == wide.rope_dim
        want = synth.LOCALITY_WINDOW * response(cal) / response(cal * pick_odds)
        assert lp.window == pytest.approx(max(want, 1 / (lp.theta * np.sqrt(synth._MLA_SCORE_MAX))))
        assert lp.window < synth.LOCALITY_WINDOW and lp.score <= synth._MLA_SCORE_MAX * (1 + 1e-9)
        assert lp.score == pytest.approx(1 / (lp.theta * lp.window) ** 2) and 2 * np.pi / lp.theta > 1024
    ds = synth.locality_plan(S.scaled(S.get("deepseek-v3"), 0.1), synth.DEFAULT_LOCALITY)
    assert ds.window == pytest.approx(synth.LOCALITY_WINDOW * response(cal) / response(cal / 2))   # 33.4: uncapped
    for like in ("qwen3-30b-a3b", "gpt-oss-120b", "glm-4.5-air", "glm-4.5"):
        assert synth.locality_plan(S.scaled(S.get(like), 0.1), synth.DEFAULT_LOCALITY).window == \
            synth.LOCALITY_WINDOW, like


# sha256 of small cuts of every family but deepseek2 (seed 3, default locality), as the generator writes them.
# A change made for one attention kind (the MLA window) must leave the other families' files byte for byte as they
# were: their routing is what docs/model.md measured. A deliberate change to their weights updates these hashes
# and re-measures those families (docs/model.md, "Model families").
OTHER_FAMILY_FILES = {
    ("qwen3-30b-a3b", 0.05, 2): "1c86e26babb9f5de72d7188f61dd9cf465f400e98c50f6f3720fe78ec43a2fd6",
    ("qwen3-235b-a22b", 0.03, 2): "1e8ca92b36bd1e9a17183481496c016334d9689c87a2b3c55e44a642f0a4de46",
    ("gpt-oss-20b", 0.1, 2): "a48eca24c843ec26f54104918affbfe3d6b477a56729eae8e67f431386589dd2",
    ("gpt-oss-120b", 0.05, 2): "83decacd5b484d7b6e46b70b80893df92a376163c94ff6f07cd73d3b37b0f4c9",
    ("glm-4.5-air", 0.05, 3): "d731d1337b29cd8f507d58de52fe8ce7903e404ee4664b8663eaa4a9b725ca09",
    ("glm-4.5", 0.05, 4): "46637d98d7fc46180ae9434956985c90d796b84763d228c220b30a26aa80a312",
}


@pytest.mark.parametrize("like,scale,layers", list(OTHER_FAMILY_FILES), ids=[k[0] for k in OTHER_FAMILY_FILES])
def test_other_families_files_are_unchanged(tmp_path, like, scale, layers):
    import hashlib

    res = synth.write_model(tmp_path / f"{like}.gguf", like, scale=scale, layers=layers, seed=3, fsync=False)
    assert res.shape.arch != "deepseek2" and res.locality == synth.DEFAULT_LOCALITY
    assert hashlib.sha256(res.path.read_bytes()).hexdigest() == OTHER_FAMILY_FILES[(like, scale, layers)]
