"""Write a synthetic GGUF shaped like a real MoE model: random but sane weights, a working tokenizer.

The file has exactly the tensor names, ggml shapes, tensor types and GGUF metadata of the real model's Q4_0 (or
Q8_0) file (see :mod:`orchestrator.model.shapes`), so llama.cpp loads it, places it and runs it as it would the
real one: memory, bandwidth and expert-routing behaviour are those of the real model; the text it writes is noise.

How the weights are made (never element-wise quantization):

* Quantized tensors are written as ready-made blocks: random quant bytes (nibbles / int8 / MXFP4 codes) next to
  a fixed, finite f16 scale per tensor role whose **sign is random per block**. A random sign per block removes
  the common bias that raw random nibbles carry (q4_0's ``q - 8`` averages -0.5): without it every matrix adds
  the same direction to every token, the residual stream of all tokens converges, and every token picks the same
  experts. ``attn_output`` gets a smaller scale so attention, which averages over the context, cannot wash the
  tokens' own signal out of the residual stream. :mod:`orchestrator.model.routing` measures the result through
  llama.cpp (tests/integration/test_routing.py).
* Routed-expert tensors (almost all of the bytes) come from a pool of pre-formatted random blocks per role, read
  at a random block offset per expert and written with ``os.writev`` -- no per-byte work, so the write runs at
  disk speed. Everything else (embeddings, attention, routers, norms) is generated fresh.
* F32 tensors: routers are Gaussian, norms are 1, biases and attention sinks small.

The file is written to ``OUT.part`` and renamed when complete; any failure (including Ctrl-C) removes it.
The GGUF container is written by :mod:`orchestrator.model.writer` (no gguf package needed); only numpy is
imported.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from orchestrator.errors import ModelError
from orchestrator.model import shapes as S
from orchestrator.model import writer as W

ALIGNMENT = W.ALIGNMENT

# Target RMS of a tensor's elements, as gain / sqrt(row length) (the row length is the matmul fan-in).
# "embd" is absolute. Chosen so that hidden states stay O(1) through every layer and routing spreads over the
# experts like a trained model's (measured with orchestrator.model.routing; see docs/synth.md).
GAIN = {
    "embd": 1.0,          # absolute element RMS of token embeddings
    "attn_in": 1.0,
    "attn_out": 0.25,     # small: attention averages over tokens, keep it from dominating the residual
    "ffn_in": 1.0,
    "ffn_down": 0.5,
    "exp_in": 1.0,
    "exp_down": 1.0,
    "shexp_down": 0.5,
    "output": 1.0,
    "router": 1.0,
}
_ABSOLUTE = {"embd"}


@dataclass(frozen=True)
class WeightStyle:
    """How random weights are scaled: per-role gains and whether block scales get a random sign."""

    name: str
    gains: tuple[tuple[str, float], ...]
    signed: bool

    def gain(self, role: str) -> float:
        return dict(self.gains)[role]


STYLES = {
    "realistic": WeightStyle("realistic", tuple(GAIN.items()), True),
    # the naive generator: positive scales everywhere and a full-size attn_output. Routing collapses onto a few
    # experts; kept so the routing test proves that its check can fail.
    "naive": WeightStyle("naive", tuple({**GAIN, "attn_out": 1.0}.items()), False),
}

# --------------------------------------------------------------------------------------------------------------
# locality in time
#
# A trained model's consecutive tokens share many experts (an LRU holding 30% of a layer's experts hits ~89% in
# decode on Qwen3-30B-A3B); random weights route every token independently. With ``locality > 0`` the weights
# give the router a slowly varying input that comes from the context, never from the token stream:
#
# * dims 0..31 of the residual stream ("bias" block) carry the same value for every token (token embeddings),
#   and nothing else writes there (attn_output, dense and shared-expert down rows, expert down rows and the
#   output biases zero there);
# * every attention head's query and key are constants (read from that block, or biases) on one RoPE pair at
#   a low frequency theta and nothing else, so every head's score is ``A cos(theta * distance)``: a recency
#   window of about ``LOCALITY_WINDOW`` tokens (Gaussian sigma; MLA's narrower, see _mla_window) whatever the
#   tokens are. How the other q/k dims are silenced depends on the attention:
#     - per-head q/k norms (qwen3moe, glm-4.5): the norm weights keep only that pair ("qknorm");
#     - plain projections with biases (gpt-oss, glm-4.5-air): every q/k row is zero and the window's q and k
#       are the projections' biases on its dim ("direct");
#     - MLA (deepseek2): the query's low-rank input q_a reads only the bias block in one row (q_a_norm makes it
#       a constant), q_b turns that into one RoPE dim per head (the "nope" part of q is zero, so the latent
#       part of the key does not count), and kv_a's rope rows read the bias block in one dim ("mla");
#   the frequency is the pair's effective one after YaRN (ggml's ramp between the corrected dims) where the
#   model scales its RoPE. Values do not read the bias and context blocks, so the window averages the tokens'
#   own (independent) values;
# * attn_output writes that window average into dims 32..63 (the "context" block; nothing else writes there):
#   a component that changes little from one token to the next;
# * the router reads the context block with an extra gain chosen so that about ``locality`` of its logit
#   variance comes from it, and does not read the bias block. The routing function after the logits (softmax
#   top-k, sigmoid with a bias and expert groups, softmax over the top-k) keeps that: it is monotone in them.
#
# 0 leaves the weights exactly as without locality. The default is calibrated through llama.cpp (decode-order
# traces, docs/synth.md) against the Qwen3-30B-A3B facts; recorded traces are checked in
# tests/model/test_routing_calibration.py. The other families take the same default (docs/model.md, "Model
# families", says what is known of their real routing and how the generated one compares).

LOCALITY_WINDOW = 48.0     # sigma of the attention recency window, tokens
_WINDOW_SCORE = 256.0      # target peak score A: sets theta = 1 / (sigma * sqrt(A)); period 2 pi / theta tokens
_BIAS_VALUE = 1.0          # bias block value per dim (token embeddings' element RMS is 1)
_QK_READ = 4.0             # weight with which the windowed q/k rows read each bias dim (q/k norm models)
_CTX_GAIN = 2.0            # attn_output gain into the context block
_WINDOW_PERIOD_MIN = 4096  # tokens: the window's RoPE period is longer than this, where the score allows
_WINDOW_SCORE_MAX = 4096.0
# The window's score must not depend on the token: a peak score A of a few hundred turns a 1% difference between
# two tokens' q.k into several nats, and attention then sits on the one token whose key happens to be largest
# instead of averaging a window. Per-head q/k norms (qknorm) make q and k constants; the plain projections'
# biases do (direct: q = k = a bias on the window dim, every row zero). MLA has neither for its key: k_pe is
# kv_a's rope rows times the normalized hidden state, so it varies as 1 / RMS of each token's residual (a few
# percent). There the window takes a pair whose frequency gives the window's width at a peak score of
# _MLA_WINDOW_SCORE: low enough that the keys' spread stays a fraction of a nat, high enough that the window's
# period (2 pi sigma sqrt(A), 1,206 tokens at 16) lies past the 1,024 positions a routing profile covers.
# Measured through llama.cpp (docs/model.md, "Locality by position in the context"): at 6 the window's return cut
# 513-1023 by 5 points against the other bands.
_MLA_WINDOW_SCORE = 16.0
# The MLA window is then narrowed on that pair (_mla_window), which raises its peak score and with it the keys'
# spread in nats. Up to twice _MLA_WINDOW_SCORE the window still averages tens of tokens (a DeepSeek-V3 cut at 30:
# 15-45 where 59 were planned); a Kimi-K2 cut at 57 gathered on 6-27 of 52, its context stronger than planned, and
# routed 5-8 points more locally at every position than at 22. So no further.
_MLA_SCORE_MAX = 2 * _MLA_WINDOW_SCORE
DEFAULT_LOCALITY = 0.82
HIGH_LOCALITY = 0.92
LOCALITY_LEVELS = {"off": 0.0, "default": DEFAULT_LOCALITY, "high": HIGH_LOCALITY}
LOCALITY_ARCHS = ("qwen3moe", "deepseek2", "gpt-oss", "glm4moe")
_BIAS = slice(0, 32)
_CTX = slice(32, 64)


@dataclass(frozen=True)
class LocalityPlan:
    """The weights that make routing local in time (see above)."""

    share: float          # intended share of router-logit variance from the context block
    rope_dim: int         # pair index i: dims (i, i + n_rot/2) for NEOX RoPE, (2i, 2i + 1) for the normal one
    theta: float          # its effective frequency (radians per token)
    score: float          # peak attention score A
    norm_weight: float    # q/k norm weight on that dim (0 elsewhere), "qknorm" mode
    window: float
    mode: str = "qknorm"  # "qknorm" | "direct" | "mla" (how the other q/k dims are silenced)
    read: float = 0.0     # "direct"/"mla": weight with which the window rows read each bias dim
    q_b_read: float = 0.0  # "mla": q_b's weight on q_a's one live dim


def _yarn_thetas(shape: S.ModelShape, n_rot: int) -> np.ndarray:
    """Each RoPE pair's frequency as ggml applies it: YaRN (ggml ``rope_yarn``) mixes the interpolated
    ``theta / factor`` and the original ``theta`` with a ramp between the corrected dims of beta_fast and
    beta_slow. llama.cpp's loaders of these architectures do not read the file's betas (only grok's and
    mistral3's do, in the pinned source), so its defaults 32 and 1 hold whatever the header says (Kimi-K2 writes
    1 and 1, as its config)."""
    half = n_rot // 2
    thetas = shape.rope_freq_base ** (-2.0 * np.arange(half) / n_rot)
    if shape.rope_scaling != "yarn" or not shape.rope_factor:
        return thetas
    fs = 1.0 / shape.rope_factor
    beta_fast, beta_slow = 32.0, 1.0

    def corr(beta: float) -> float:
        return n_rot * np.log(shape.rope_orig_ctx / (beta * 2 * np.pi)) / (2 * np.log(shape.rope_freq_base))

    low = max(0.0, np.floor(corr(beta_fast)))
    high = min(n_rot - 1.0, np.ceil(corr(beta_slow)))
    y = (np.arange(half) - low) / max(0.001, high - low)
    mix = 1 - np.clip(y, 0, 1)                 # ext_factor 1 (llama.cpp's default under YaRN)
    return thetas * (fs * (1 - mix) + mix)


def _rope_amplitude(shape: S.ModelShape) -> float:
    """What ggml's YaRN multiplies rotated q and k by (``attn_factor * (1 + 0.1 ln factor)``), with the
    ``attn_factor`` llama.cpp's context sets: 1 / (1 + 0.1 ln factor) for deepseek2 with a log multiplier (the
    product is 1), else get_mscale(factor) / (1 + 0.1 ln factor) = 1 (the product is 1 + 0.1 ln factor)."""
    if shape.rope_scaling != "yarn" or not shape.rope_factor:
        return 1.0
    if shape.arch == "deepseek2" and shape.yarn_log_mul:
        return 1.0
    return 1.0 + 0.1 * np.log(shape.rope_factor)


def _kq_scale(shape: S.ModelShape) -> float:
    """The attention's score scale in llama.cpp's graph for the architecture."""
    if shape.arch == "deepseek2":
        # deepseek2.cpp: mscale^2 / sqrt(key_length_mla), mscale = 1 + 0.1 * (log mul / 0.1) * ln(factor)
        m = 1.0
        if shape.rope_scaling == "yarn" and shape.rope_factor and shape.yarn_log_mul:
            m = 1.0 + shape.yarn_log_mul * np.log(shape.rope_factor)
        return m * m / np.sqrt(shape.qk_nope_dim + shape.qk_rope_dim)
    if shape.arch == "gpt-oss":
        return 1.0 / np.sqrt(shape.n_rot or shape.head_dim)   # openai-moe.cpp: 1 / sqrt(n_rot)
    return 1.0 / np.sqrt(shape.head_dim)


def _locality_mode(shape: S.ModelShape) -> str:
    if shape.arch == "qwen3moe" or (shape.arch == "glm4moe" and shape.qk_norm):
        return "qknorm"
    return "mla" if shape.arch == "deepseek2" else "direct"


def default_locality(shape: S.ModelShape) -> float:
    """The calibrated locality where the shape can have it (n_embd >= 128 and, for MLA, a q_lora), else 0."""
    return DEFAULT_LOCALITY if _locality_reason(shape) is None else 0.0


def _locality_reason(shape: S.ModelShape) -> str | None:
    """Why ``shape`` cannot have routing locality, or None."""
    if shape.arch not in LOCALITY_ARCHS:
        return (f"routing locality is generated for {', '.join(LOCALITY_ARCHS)} shapes only, not {shape.like} "
                f"({shape.arch})")
    if shape.n_embd < 128:
        return (f"--locality needs n_embd >= 128 (bias and context blocks); {shape.like} at this scale has "
                f"{shape.n_embd}")
    if shape.arch == "deepseek2" and not shape.q_lora_rank:
        return (f"{shape.like} has no q_lora (its queries are not normalized), so the window's query cannot be "
                f"made independent of the token")
    return None


def locality_plan(shape: S.ModelShape, locality: float) -> LocalityPlan | None:
    """The window and gains for ``locality`` on ``shape`` (None for 0); a shape that cannot have it is a
    :class:`ModelError` naming it."""
    if locality == 0:
        return None
    if not (0.0 < locality < 1.0):
        raise ModelError(f"--locality {locality}: expected 0 <= L < 1 (or off, default, high)")
    why = _locality_reason(shape)
    if why:
        raise ModelError(f"--locality {locality}: {why}; use --locality 0")
    mode = _locality_mode(shape)
    n_rot = shape.qk_rope_dim if shape.arch == "deepseek2" else (shape.n_rot or shape.head_dim)
    thetas = _yarn_thetas(shape, n_rot)
    if mode == "mla":
        # the pair nearest the width at _MLA_WINDOW_SCORE (see there): its period is what that score gives
        want = 1.0 / (LOCALITY_WINDOW * np.sqrt(_MLA_WINDOW_SCORE))
        i = int(np.argmin(np.abs(np.log(thetas / want))))
    else:
        # the pair nearest the wanted frequency among those whose period exceeds a 4096-token prompt (the window
        # must not come back within the contexts the benchmarks use; a coarser frequency grid, as partial
        # RoPE's, takes a lower frequency and a higher peak score for the same width), unless that score passes
        # _WINDOW_SCORE_MAX (f16 rounding of the keys); with none such, the nearest pair
        want = 1.0 / (LOCALITY_WINDOW * np.sqrt(_WINDOW_SCORE))
        dist = np.abs(np.log(thetas / want))
        far = np.where((2 * np.pi / thetas > _WINDOW_PERIOD_MIN)
                       & (1.0 / (thetas * LOCALITY_WINDOW) ** 2 <= _WINDOW_SCORE_MAX), dist, np.inf)
        i = int(np.argmin(far)) if np.isfinite(far).any() else int(np.argmin(dist))
    theta = float(thetas[i])
    window = LOCALITY_WINDOW
    if mode == "mla":
        # narrowed (see _mla_window) as far as the keys' spread allows: never past _MLA_SCORE_MAX
        window = min(LOCALITY_WINDOW, max(_mla_window(shape, locality), 1.0 / (theta * np.sqrt(_MLA_SCORE_MAX))))
    score = 1.0 / (theta * window) ** 2
    # the q.k product (before the score scale and the rope amplitude) that gives the score
    qk = score / (_kq_scale(shape) * _rope_amplitude(shape) ** 2)
    norm_weight = read = q_b_read = 0.0
    if mode == "qknorm":
        # q/k after the norm: norm_weight * sqrt(head_dim) on the window dim; score = q.k / sqrt(head_dim)
        norm_weight = float(np.sqrt(score / np.sqrt(shape.head_dim)))
    elif mode == "direct":
        # q = k = read exactly on the window dim, from the projections' biases: no token's input scales them
        read = float(np.sqrt(qk))
    else:
        # q_pe = q_b_read * sqrt(q_lora_rank) (q_a_norm of one live dim); k_pe = read * 32 * bias value, kv_a's
        # window row reading the bias block up by the residual's expected RMS at its layer (_residual_rms)
        read = float(np.sqrt(qk) / (32 * _BIAS_VALUE))
        q_b_read = float(np.sqrt(qk) / np.sqrt(shape.q_lora_rank))
    return LocalityPlan(locality, i, theta, score, norm_weight, window, mode, read, q_b_read)


def _share_response(odds: float) -> float:
    """How much the context's share of the router's logit variance, o / (1 + o), moves when the context's
    variance (so the odds o) is scaled: d share / d ln o = o / (1 + o)^2, largest at odds 1."""
    return odds / (1.0 + odds) ** 2


def _mla_window(shape: S.ModelShape, locality: float) -> float:
    """The MLA window's width (sigma, tokens): the calibration's, narrowed by how much more the router's context
    share responds to the context's strength than the calibration's router does.

    At a position under the window's reach the softmax averages the fewer tokens there are (position 20 averages
    about 20, position 500 about 85 at sigma 48), so the context component is stronger there, by the inverse of
    that count in variance; nothing in deepseek2's attention can hold it back (no sink logit, as gpt-oss has; RoPE
    sees only distances; every token's key is alike). Every family's first positions are that much more local.
    The MLA shapes pick 8 of 256 or 384 experts, and their context odds are scaled down for it (_pick_odds): 2.3
    for DeepSeek-V3, 1.5 for Kimi-K2, against the calibration's 4.6, nearer the odds of 1 at which the share moves
    most with the context's strength. So their first 128 positions were 2-4 points more local than the later
    ones (experts shared with the token before: 37-42% at 1-128 against 23-26% at 513-1023; Qwen3 55 / 49%).
    The window is narrowed by the ratio of the two responses (0.70 for DeepSeek-V3, 0.62 for Kimi-K2 at the
    default locality), so that the positions under its reach, and the strength they gain, count as much in the
    routing as in the calibration's; never widened. The pair stays the one chosen for the full width (its period
    past 1,024 positions), so the peak score rises as the width's inverse square, up to _MLA_SCORE_MAX: DeepSeek-V3
    takes its full narrowing (33 tokens, score 30), Kimi-K2 stops at 40 tokens (score 32; 30 tokens were wanted)
    and keeps part of the first positions' extra locality."""
    odds = locality / (1.0 - locality)
    ratio = _share_response(odds) / _share_response(odds * _pick_odds(shape))
    return LOCALITY_WINDOW * min(1.0, ratio)


_SILU_GATE_MS = 0.3553   # E[(silu(g) u)^2] for g, u ~ N(0, 1): a SwiGLU's mean square per unit-RMS input


def _residual_rms(shape: S.ModelShape, layer: int) -> float:
    """The expected RMS of the residual stream entering ``layer`` of a generated model: the embeddings' 1 plus,
    per layer before it, the feed-forward output's mean square from the weights' gains (a SwiGLU of unit-RMS
    inputs, down-projected at its gain; routed experts weighted by normalized gates that are about equal, so a
    token's top-k add 1/k of one expert's square, times the routing scale's square; shared experts in full).
    Attention adds a window average (under 0.1% of it) and is left out."""
    ms = 1.0
    for j in range(layer):
        if j < shape.n_dense_lead or not shape.n_expert:
            ms += GAIN["ffn_down"] ** 2 * _SILU_GATE_MS
            continue
        routed = GAIN["exp_down"] ** 2 * _SILU_GATE_MS * (shape.expert_weights_scale or 1.0) ** 2
        ms += routed / shape.n_expert_used + shape.n_expert_shared * GAIN["shexp_down"] ** 2 * _SILU_GATE_MS
    return float(np.sqrt(ms))


def _context_router_gain(shape: S.ModelShape, lp: LocalityPlan, layer: int) -> float:
    """Router gain on the context block for ``layer`` so that about ``lp.share`` of the logit variance comes
    from it: the context block holds ``layer + 1`` window averages (each of RMS ~ CTX_GAIN / sqrt(1.77 sigma))
    against the other dims' ~1 (tokens' own embedding and expert outputs)."""
    ctx_rms = _CTX_GAIN / np.sqrt(1.77 * lp.window) * np.sqrt(layer + 1)
    rest = shape.n_embd - 64
    odds = lp.share / (1 - lp.share) * _pick_odds(shape)
    return float(np.sqrt(odds * rest / 32) / ctx_rms)


# The calibration's router picks 8 of 128 experts. One that picks a smaller share of them (DeepSeek-V3 8 of 256,
# Kimi-K2 8 of 384, gpt-oss-120b 4 of 128) takes its picks from further out in the logits' tail, where the shared
# context component decides more of them: at the same share of variance its routing is more local. Scaling the
# context's odds by the ratio of the pick shares (never up) keeps each family's curve at Qwen3's; measured through
# llama.cpp in docs/model.md ("Model families").
_CALIBRATION_PICK_SHARE = 8 / 128


def _pick_odds(shape: S.ModelShape) -> float:
    return min(1.0, shape.n_expert_used / shape.n_expert / _CALIBRATION_PICK_SHARE)


def _const_block(qtype: str, value: float) -> np.ndarray:
    """One block whose 32 elements all equal ``value`` (q4_0 / q8_0)."""
    blk, size = S.BLOCK[qtype]
    out = np.zeros(size, np.uint8)
    if qtype == "q4_0":
        out[0:2] = np.array([value / 7.0], np.float16).view(np.uint8)
        out[2:] = 0xFF    # codes 15: (15 - 8) * d
    elif qtype == "q8_0":
        out[0:2] = np.array([value / 31.0], np.float16).view(np.uint8)
        out[2:] = 31
    else:  # pragma: no cover - locality shapes use q4_0 / q8_0 for these tensors
        raise ValueError(qtype)
    return out


def _first_block(qtype: str, value: float) -> np.ndarray:
    """One block whose first element is ``value`` and the other 31 zero (q4_0 / q8_0)."""
    blk, size = S.BLOCK[qtype]
    out = np.zeros(size, np.uint8)
    if qtype == "q4_0":
        out[0:2] = np.array([value / 7.0], np.float16).view(np.uint8)
        out[2:] = 0x88    # codes 8: zero (low nibble element j, high nibble element j + 16)
        out[2] = 0x8F     # element 0: code 15
    elif qtype == "q8_0":
        out[0:2] = np.array([value / 31.0], np.float16).view(np.uint8)
        out[2] = 31
    else:  # pragma: no cover
        raise ValueError(qtype)
    return out


def _layer_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _window_row(shape: S.ModelShape, lp: LocalityPlan, r: np.ndarray, per_head: int, offset: int) -> np.ndarray:
    """Which of the rows ``r`` of a per-head projection (``per_head`` rows a head, RoPE dims from ``offset``)
    carry the window's RoPE dim."""
    d = r % per_head - offset
    return d == (2 * lp.rope_dim if shape.arch == "deepseek2" else lp.rope_dim)


def _patch_rows(spec: S.TensorSpec, rows: np.ndarray, row0: int, lp: LocalityPlan, shape: S.ModelShape,
                rng: "_Rng", style: "WeightStyle") -> None:
    """Rewrite blocks of the rows ``row0 .. row0 + len(rows)`` (``rows``: (n, blocks per row, block bytes)) of a
    quantized tensor for routing locality."""
    kind = spec.name.split(".")[-2] if spec.name.startswith("blk.") else spec.name.split(".")[0]
    n = rows.shape[0]
    r = np.arange(row0, row0 + n)
    if kind == "token_embd":
        rows[:, 0] = _const_block(spec.type, _BIAS_VALUE)
        rows[:, 1] = 0
    elif kind in ("attn_q", "attn_k"):
        win = _window_row(shape, lp, r, shape.head_dim, 0)
        if lp.mode == "qknorm":
            rows[win] = 0
            rows[win, 0] = _const_block(spec.type, _QK_READ)
        else:   # direct: no row is live; the window's q and k are the projections' biases
            rows[:] = 0
    elif kind == "attn_v":
        rows[:, 0:2] = 0
    elif kind == "attn_q_a":          # MLA: one live row, read from the bias block only
        rows[:] = 0
        rows[r == 0, 0] = _const_block(spec.type, _BIAS_VALUE)
    elif kind == "attn_q_b":          # MLA: per head, the window's RoPE dim reads q_a's live dim
        rows[:] = 0
        win = _window_row(shape, lp, r, shape.qk_nope_dim + shape.qk_rope_dim, shape.qk_nope_dim)
        rows[win, 0] = _first_block(spec.type, lp.q_b_read)
    elif kind == "attn_kv_a_mqa":     # MLA: the latent does not read bias/context; k_pe only the window dim
        latent = r < shape.kv_lora_rank
        rows[latent, 0:2] = 0
        rope = ~latent
        rows[rope] = 0
        win = rope & ((r - shape.kv_lora_rank) == 2 * lp.rope_dim)
        # the attention norm divides the bias block by the residual's RMS: read it back up to the planned key
        rows[win, 0] = _const_block(spec.type, lp.read * _residual_rms(shape, _layer_of(spec.name)))
    elif kind == "attn_output":
        rows[(r >= _BIAS.start) & (r < _BIAS.stop)] = 0
        ctx = (r >= _CTX.start) & (r < _CTX.stop)
        k = int(ctx.sum())
        if k:
            rms = _CTX_GAIN / np.sqrt(S.fan_in(spec))
            rows[ctx] = make_blocks(spec.type, k * rows.shape[1], rms, rng, signed=style.signed
                                    ).reshape(k, rows.shape[1], -1)
    elif kind in ("ffn_down", "ffn_down_shexp"):
        rows[r < _CTX.stop] = 0


_PATCHED = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_a", "attn_q_b", "attn_kv_a_mqa",
            "ffn_down", "ffn_down_shexp")


# RMS of the integer codes of each block format (before scaling)
_Q4_0_RMS = float(np.sqrt(np.mean((np.arange(16) - 8.0) ** 2)))                      # 4.637
_Q8_0_RMS = float(np.sqrt(np.mean(np.arange(-32, 32, dtype=np.float64) ** 2)))      # 18.5 (codes -32..31)
_Q6_K_RMS = float(np.sqrt(np.mean((np.arange(64) - 32.0) ** 2)))                     # 18.5
_Q6_K_SUBSCALE = 4                                                                   # |int8 sub-block scale|
_MXFP4_K = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)
_MXFP4_RMS = float(np.sqrt(np.mean(_MXFP4_K ** 2)))                                 # 5.85 (element = k * 2^(e-128))

POOL_BYTES = 64 << 20     # per (type, scale) pool of pre-formatted expert blocks
CHUNK_BYTES = 16 << 20    # fresh random data is generated and written in chunks of this size


@dataclass(frozen=True)
class SynthResult:
    path: Path
    shape: S.ModelShape
    quant: str
    n_tensors: int
    bytes: int
    seconds: float
    locality: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


# --------------------------------------------------------------------------------------------------------------
# tokenizer


def _bytes_to_unicode() -> list[str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest to U+0100.. (GPT-2 scheme)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    # token ids 0..255 in GPT-2 order: printable bytes first, then the remapped ones
    order = printable + [b for b in range(256) if b not in printable]
    return [table[b] for b in order]


def build_vocab(shape: S.ModelShape) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """A byte-level BPE vocabulary of exactly ``shape.n_vocab`` tokens: tokens, token types, merges, special ids.

    Ids 0..255 (after any leading specials) are the 256 byte tokens; then merged tokens built from a 70-character
    alphabet (2-character tokens, then 3-character ones, ...), each with its merge rule; special tokens sit at
    their real ids (counted from the end of the vocabulary for the ones near the end), the rest of their region
    is padding, as in the real converted files.
    """
    n = shape.n_vocab
    tokens: list[str | None] = [None] * n
    types = [1] * n  # NORMAL
    special_ids: dict[str, int] = {}
    for sp in shape.specials:
        tid = sp.token_id(n)
        if not (0 <= tid < n):
            raise ModelError(f"{shape.like}: special token {sp.text!r} id {tid} outside the vocabulary of {n}")
        tokens[tid] = sp.text
        types[tid] = 3  # CONTROL
        if sp.role:
            special_ids[sp.role] = tid
    tail_start = min([sp.token_id(n) for sp in shape.specials if sp.from_end] or [n])
    for i in range(tail_start, n):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"
            types[i] = 5  # UNUSED

    free = [i for i in range(tail_start) if tokens[i] is None]
    byte_chars = _bytes_to_unicode()
    if len(free) < 256 + 1:
        raise ModelError(f"{shape.like}: vocabulary of {n} too small for 256 byte tokens")
    for i, ch in zip(free[:256], byte_chars):
        tokens[i] = ch
    rest = free[256:]

    # merged tokens: alphabet = space marker, lower, upper, digits, some punctuation
    space = chr(0x120)  # 'Ġ' is byte 0x20 in the GPT-2 alphabet
    newline = chr(0x10A)  # 'Ċ' is byte 0x0A
    alphabet = [space] + list("etaoinshrdlcumwfgypbvkjxqz") + list("ETAOINSHRDLCUMWFGYPBVKJXQZ") + \
        list("0123456789") + list(".,:;!?-'\"()") + [newline]
    merges: list[str] = []
    seen = set(t for t in tokens if t is not None)
    need = len(rest)
    level = alphabet  # tokens of the previous length
    made: list[str] = []
    while len(made) < need:
        nxt = []
        for left in level:
            for right in alphabet:
                tok = left + right
                if tok in seen:
                    continue
                seen.add(tok)
                made.append(tok)
                merges.append(f"{left} {right}")
                nxt.append(tok)
                if len(made) >= need:
                    break
            if len(made) >= need:
                break
        level = nxt
    for i, tok in zip(rest, made):
        tokens[i] = tok
    assert all(t is not None for t in tokens)
    return tokens, types, merges, special_ids  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------------------
# block generation


class _Rng:
    """Fast uniform random bytes (SFC64) and Gaussians from one seed."""

    def __init__(self, seed: int):
        self.gen = np.random.Generator(np.random.SFC64(seed))

    def bytes(self, n: int) -> np.ndarray:
        words = self.gen.integers(0, np.iinfo(np.uint64).max, size=(n + 7) // 8, dtype=np.uint64, endpoint=True)
        return words.view(np.uint8)[:n]


def _scale_for(spec: S.TensorSpec, style: WeightStyle = STYLES["realistic"]) -> float:
    gain = style.gain(spec.role)
    return gain if spec.role in _ABSOLUTE else gain / np.sqrt(S.fan_in(spec))


def make_blocks(qtype: str, n_blocks: int, rms: float, rng: _Rng, *, signed: bool = True) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` whose elements have RMS ``rms``; random sign per block scale
    (``signed=False``: every scale positive, the naive way that collapses routing; kept to prove the check)."""
    blk, size = S.BLOCK[qtype]
    raw = rng.bytes(n_blocks * size).reshape(n_blocks, size)
    # the scale bytes are overwritten below: their random low bit picks the sign
    sign_bit = raw[:, 0] & 1 if signed else np.zeros(n_blocks, np.uint8)
    if qtype == "q4_0":
        d = np.float16(rms / _Q4_0_RMS)
        raw[:, 0:2] = np.where(sign_bit[:, None].astype(bool), -d, d).astype(np.float16).reshape(-1, 1).view(np.uint8)
    elif qtype == "q8_0":
        # int8 codes in -32..31 (like a trained tensor's, most codes are far from +-127), which keeps the f16
        # scale a normal number even for the widest rows
        qs = raw[:, 2:].view(np.int8)
        qs >>= 2
        d = np.float16(rms / _Q8_0_RMS)
        raw[:, 0:2] = np.where(sign_bit[:, None].astype(bool), -d, d).astype(np.float16).reshape(-1, 1).view(np.uint8)
    elif qtype == "q6_k":
        # ql[128] qh[64] scales[16] (int8) d (f16): random sign per 16-element sub-block, fixed |scale|
        d = np.float16(rms / (_Q6_K_RMS * _Q6_K_SUBSCALE))
        sc = raw[:, 192:208].view(np.int8)
        sc[:] = np.where((sc & 1) & signed, -_Q6_K_SUBSCALE, _Q6_K_SUBSCALE).astype(np.int8)
        raw[:, 208:210] = np.full((n_blocks, 1), d, dtype=np.float16).view(np.uint8)
    elif qtype == "mxfp4":
        # e8m0 exponent + 16 bytes of FP4 codes (symmetric table: no bias); exponent varies by one step
        # half the blocks one exponent lower: mean square = (1 + 1/4) / 2 of the upper one's
        e = 128 + int(round(np.log2(rms / (_MXFP4_RMS * np.sqrt(0.625)))))
        if not (1 <= e <= 254):
            raise ValueError(f"mxfp4 scale exponent {e} out of range")
        raw[:, 0] = e - (raw[:, 1] & 1)
    else:  # pragma: no cover
        raise ValueError(qtype)
    return raw


def _f32_data(spec: S.TensorSpec, rng: _Rng, style: WeightStyle, lp: LocalityPlan | None = None,
              mshape: S.ModelShape | None = None) -> np.ndarray:
    shape = spec.ne[::-1]
    if spec.role == "norm":
        w = np.ones(shape, np.float32)
        if lp is not None and spec.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            w[:] = 0.0
            w[lp.rope_dim] = lp.norm_weight
        return w
    if spec.role == "router":
        w = rng.gen.standard_normal(shape, dtype=np.float32) * np.float32(_scale_for(spec, style))
        if lp is not None:
            w[:, _BIAS] = 0.0
            w[:, _CTX] *= np.float32(_context_router_gain(mshape, lp, _layer_of(spec.name)))
        return w
    if spec.role in ("bias", "router_bias"):
        w = rng.gen.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if lp is not None and spec.role == "bias":
            kind = spec.name.split(".")[-2]
            if kind in ("attn_q", "attn_k"):           # the window's q/k: a constant on its dim, 0 elsewhere
                w[:] = 0.0
                w[np.arange(w.shape[-1]) % mshape.head_dim == lp.rope_dim] = np.float32(lp.read)
            elif kind in ("attn_output", "ffn_down_exps"):   # nothing else writes the bias and context blocks
                w[..., : _CTX.stop] = 0.0
        return w
    if spec.role == "sinks":
        return np.zeros(shape, np.float32)
    raise ValueError(f"{spec.name}: no f32 generator for role {spec.role}")


class _Pools:
    """Pools of pre-formatted random blocks, one per (type, scale), for the routed-expert tensors."""

    def __init__(self, rng: _Rng, pool_bytes: int, signed: bool = True):
        self.rng = rng
        self.pool_bytes = pool_bytes
        self.signed = signed
        self.pools: dict[tuple[str, float], np.ndarray] = {}

    def get(self, qtype: str, rms: float, want_bytes: int) -> np.ndarray:
        key = (qtype, float(rms))
        if key not in self.pools:
            size = S.BLOCK[qtype][1]
            n = max(1, min(self.pool_bytes, want_bytes) // size)
            self.pools[key] = make_blocks(qtype, n, rms, self.rng, signed=self.signed).reshape(-1)
        return self.pools[key]


# --------------------------------------------------------------------------------------------------------------
# writer


def _human(n: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _tensor_data(spec: S.TensorSpec, rng: _Rng, pools: _Pools, style: WeightStyle,
                 lp: LocalityPlan | None = None, mshape: S.ModelShape | None = None) -> Iterator[np.ndarray]:
    """The buffers of one tensor's data, generated as the writer takes them."""
    if spec.type == "f32":
        yield _f32_data(spec, rng, style, lp, mshape)
        return
    blk, size = S.BLOCK[spec.type]
    rms = _scale_for(spec, style)
    nbytes = spec.nbytes
    if spec.is_expert:
        pool = pools.get(spec.type, rms, nbytes)
        per_expert = nbytes // spec.ne[2]
        n_pool_blocks = len(pool) // size
        # with locality, expert outputs leave the bias and context blocks alone (rows 0..63 of down)
        quiet = 64 * (spec.ne[0] // blk) * size if (lp is not None and spec.role == "exp_down") else 0
        zeros = np.zeros(quiet, np.uint8)
        for _ in range(spec.ne[2]):
            if quiet:
                yield zeros
            left = per_expert - quiet
            while left:
                off = int(rng.gen.integers(0, n_pool_blocks)) * size
                take = min(left, len(pool) - off)
                yield pool[off:off + take]
                left -= take
    else:
        bpr = spec.ne[0] // blk
        patch = lp is not None and (spec.name.split(".")[-2] if spec.name.startswith("blk.")
                                    else spec.name.split(".")[0]) in _PATCHED
        blocks_per_chunk = max(1, CHUNK_BYTES // size)
        if patch:   # whole rows per chunk
            blocks_per_chunk = max(bpr, blocks_per_chunk // bpr * bpr)
        n_blocks = nbytes // size
        done = 0
        while done < n_blocks:
            k = min(blocks_per_chunk, n_blocks - done)
            data = make_blocks(spec.type, k, rms, rng, signed=style.signed)
            if patch:
                _patch_rows(spec, data.reshape(k // bpr, bpr, size), done // bpr, lp, mshape, rng, style)
            yield data
            done += k


def tensor_data(specs: list[S.TensorSpec], *, seed: int = 0, pool_bytes: int = POOL_BYTES,
                style: str = "realistic", rng: _Rng | None = None, locality: LocalityPlan | None = None,
                shape: S.ModelShape | None = None) -> Iterator[Iterator[np.ndarray]]:
    """The weights of ``specs``, one stream of buffers per tensor, for :mod:`orchestrator.model.writer`."""
    wstyle = STYLES[style]
    rng = rng or _Rng(seed)
    pools = _Pools(rng, pool_bytes, signed=wstyle.signed)
    for sp in specs:
        yield _tensor_data(sp, rng, pools, wstyle, locality, shape)


def write_data(fd: int, specs: list[S.TensorSpec], *, seed: int = 0, pool_bytes: int = POOL_BYTES,
               style: str = "realistic", progress: Callable[[int, int], None] | None = None,
               rng: _Rng | None = None, locality: LocalityPlan | None = None,
               shape: S.ModelShape | None = None) -> int:
    """Write the tensor data of ``specs`` (each padded to the alignment) to ``fd``; returns the bytes written.

    Also used on its own by lab/bench/synth_write.py to time the generator against /dev/null.
    """
    data = tensor_data(specs, seed=seed, pool_bytes=pool_bytes, style=style, rng=rng, locality=locality,
                       shape=shape)
    return W.write_tensor_data(fd, specs, data, alignment=ALIGNMENT, progress=progress)


def gguf_metadata(shape: S.ModelShape, quant: str | None) -> dict[str, W.Typed]:
    """The file's metadata: the shape's key/values (:func:`orchestrator.model.shapes.metadata`) and the
    generated tokenizer."""
    md = {k: W.Typed(kind, v) for k, v, kind in S.metadata(shape, quant)}
    tokens, types, merges, special = build_vocab(shape)
    md.update({
        "tokenizer.ggml.model": W.Typed("str", "gpt2"),
        "tokenizer.ggml.pre": W.Typed("str", shape.tokenizer_pre),
        "tokenizer.ggml.tokens": W.Typed("str[]", tokens),
        "tokenizer.ggml.token_type": W.Typed("i32[]", types),
        "tokenizer.ggml.merges": W.Typed("str[]", merges),
    })
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        if role in special:
            md[f"tokenizer.ggml.{key}"] = W.Typed("u32", special[role])
    md["tokenizer.ggml.add_bos_token"] = W.Typed("bool", shape.add_bos)
    if shape.chat_template:
        md["tokenizer.chat_template"] = W.Typed("str", shape.chat_template)
    return md


def plan(like: str, *, scale: float = 1.0, quant: str | None = None, layers: int | None = None,
         expert_quant: str | None = None) -> tuple[S.ModelShape, list[S.TensorSpec]]:
    shape = S.with_expert_quant(S.scaled(S.get(like), scale, layers=layers), expert_quant)
    return shape, S.tensor_specs(shape, quant)


def write_header_only(out: os.PathLike | str, like: str, *, scale: float = 1.0, quant: str | None = None,
                      layers: int | None = None, expert_quant: str | None = None) -> Path:
    """The file :func:`write_model` writes, with every weight zero: the header, and the data as a hole in a
    sparse file (no disk). What reading, planning and memory prediction need, written in milliseconds."""
    shape, specs = plan(like, scale=scale, quant=quant, layers=layers, expert_quant=expert_quant)
    W.write_gguf(out, gguf_metadata(shape, quant), specs)
    return Path(out)


def write_model(
    out: os.PathLike | str,
    like: str,
    *,
    scale: float = 1.0,
    quant: str | None = None,
    seed: int = 0,
    layers: int | None = None,
    pool_bytes: int = POOL_BYTES,
    fsync: bool = True,
    style: str = "realistic",
    progress: Callable[[int, int], None] | None = None,
    locality: float | None = None,
    expert_quant: str | None = None,
) -> SynthResult:
    """Write the synthetic model to ``out`` (via ``out.part``, renamed when complete).

    ``locality``: share of the router's input that comes from a slowly varying context component (0: every
    token routes independently; None: :func:`default_locality` of the shape). ``expert_quant``: the routed
    experts' type where it differs from ``quant`` (:func:`orchestrator.model.shapes.with_expert_quant`)."""
    out = Path(out)
    if style not in STYLES:
        raise ModelError(f"weight style {style!r}: expected one of {', '.join(STYLES)}")
    shape, specs = plan(like, scale=scale, quant=quant, layers=layers, expert_quant=expert_quant)
    if locality is None:
        locality = default_locality(shape) if style == "realistic" else 0.0
    lp = locality_plan(shape, locality)
    quant = quant or shape.default_quant
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ModelError(f"{out}: is a directory; give the output file name (e.g. {out / (like + '.gguf')})")
    if not parent.is_dir():
        raise ModelError(f"{out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ModelError(f"{out}: directory {parent} is not writable")
    t0 = time.monotonic()
    gguf = W.GGUFOut(out, gguf_metadata(shape, quant), specs, alignment=ALIGNMENT)
    try:
        with gguf:
            try:
                gguf.open()
            except OSError as e:
                raise ModelError(f"{out}: cannot write {gguf.part}: {e.strerror or e}") from None
            st = os.fstatvfs(gguf.fd)
            free_bytes = st.f_bavail * st.f_frsize
            spare = 16 << 20
            if free_bytes < gguf.size + spare:
                raise ModelError(f"{out}: needs {_human(gguf.size)} and {_human(spare)} to spare but {parent} has "
                                 f"only {_human(free_bytes)} free (use --scale or --layers for a smaller model)")
            gguf.write_header()
            gguf.write_data(tensor_data(specs, seed=seed, pool_bytes=pool_bytes, style=style, locality=lp,
                                        shape=shape), progress=progress)
            gguf.commit(fsync=fsync)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ModelError(f"{out}: disk full while writing ({_human(gguf.data_bytes)} needed)") from None
        raise ModelError(f"{out}: write failed: {e.strerror or e}") from None
    seconds = time.monotonic() - t0
    return SynthResult(out, shape, quant, len(specs), out.stat().st_size, seconds, locality)
