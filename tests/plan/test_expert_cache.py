"""Whole expert layers versus the expert cache: the pure split decision, on recorded and stated inputs."""

from __future__ import annotations

import dataclasses

import pytest

from orchestrator.model.routing_profile import DEFAULT_CURVE, HitCurve
from orchestrator.plan import expert_cache as X

GiB = 1 << 30
# Qwen3-30B-A3B q4_0: 48 MoE layers of 128 experts, 3 x 2048 x 768 weights each at 4.5 bits
LAYER = 128 * 3 * 2048 * 768 * 18 // 32
# routing with no locality at all: a cache of f of the host experts hits f
UNIFORM = HitCurve((0.0, 1.0), (0.0, 1.0), "independent routing")


def _inputs(**kw):
    base = dict(curve=DEFAULT_CURVE, layer_expert_bytes=LAYER, n_expert=128, n_expert_used=8, n_moe_layers=48,
                vram_free=4 * GiB, pcie_bw=50e9, host_bw=100e9, gpu_bw=4e12, base_seconds=0.002)
    base.update(kw)
    return X.CacheInputs(**base)


def test_candidates_cover_every_whole_layer_count_and_the_arithmetic_adds_up():
    inp = _inputs()
    cands = X.candidates(inp)
    k_max = 4 * GiB // LAYER
    expert = LAYER / 128
    # every whole-layer count whose leftover still gives each host layer a bank of one token's 8 picks
    fits = [k for k in range(k_max + 1) if (4 * GiB - k * LAYER) // (1 << 20) * (1 << 20) >= (48 - k) * 8 * expert]
    assert fits == list(range(len(fits))) and 0 < len(fits) < k_max + 1
    assert [c.gpu_layers for c in cands] == fits + [k_max]
    assert cands[-1].cache_bytes == 0
    for c in cands:
        assert c.gpu_layers + c.host_layers == 48
        assert c.gpu_resident_bytes == pytest.approx(c.gpu_layers * 8 * expert)
        host = c.host_layers * 8 * expert
        if c.cache_bytes:
            assert c.gpu_layers * LAYER + c.cache_bytes <= 4 * GiB
            assert c.slots_per_layer == int(c.cache_bytes // (c.host_layers * expert))
            assert c.slots == c.slots_per_layer * c.host_layers and c.slots_per_layer >= 8
            assert c.fraction == c.slots_per_layer / 128
            assert c.cache_hit_bytes == pytest.approx(c.hit_rate * host)
            assert c.host_read_bytes + c.pcie_bytes == pytest.approx((1 - c.hit_rate) * host)
        else:
            assert c.host_read_bytes == pytest.approx(host)
        assert c.tokens_per_s == pytest.approx(1 / (0.002 + c.expert_seconds))


def test_fast_link_and_local_routing_choose_a_cache():
    plan = X.plan_expert_cache(_inputs())
    c = plan.chosen
    assert plan.use_cache and c.cache_bytes > 0
    # 0 whole layers and 4 GiB of cache: ~25% of the host experts -> ~86% hits by the default curve
    assert c.tokens_per_s > 1.5 * plan.no_cache.tokens_per_s
    assert 0.8 < c.hit_rate < 0.95
    text = "\n".join(plan.arithmetic())
    assert "predicted hit rate" in text and "over PCIe" in text and "without a cache" in text
    js = plan.to_json()
    assert js["use_cache"] and js["chosen"]["cache_mib"] == c.cache_mib
    assert js["chosen"]["bytes_per_token"]["host_memory"] + js["chosen"]["bytes_per_token"]["pcie"] > 0


def _measured_curve(name: str = "default") -> HitCurve:
    """The per-layer curve of a recorded trace, with its CPU-miss shares (the patch's rule replayed)."""
    from pathlib import Path

    from orchestrator.model.routing_profile import parse_trace, profile

    trace = Path(__file__).resolve().parents[1] / "fixtures" / "routing" / f"demo-locality-{name}.trace"
    return profile(parse_trace(trace.read_bytes()), f"recorded {name}").curve("lru-layer")


def test_cpu_misses_are_weighed_with_their_replayed_shares():
    curve = _measured_curve()
    fast_host = X.plan_expert_cache(_inputs(curve=curve, host_bw=100e9, pcie_bw=10e9)).chosen
    assert fast_host.miss_mode == "cpu"
    hit, up = curve.cpu_misses.at(fast_host.fraction)
    host = fast_host.host_layers * 8 * LAYER / 128
    assert fast_host.hit_rate == pytest.approx(hit)
    assert fast_host.pcie_bytes == pytest.approx(up * host) and fast_host.pcie_bytes > 0    # reused misses
    assert fast_host.host_read_bytes == pytest.approx((1 - hit - up) * host)
    no_cpu = X.plan_expert_cache(_inputs(curve=curve, host_bw=100e9, pcie_bw=10e9, cpu_misses=False)).chosen
    assert no_cpu.miss_mode in ("upload", "none")                 # on this link uploads may not pay at all
    assert no_cpu.tokens_per_s < fast_host.tokens_per_s
    # a fast link: uploading every miss wins
    assert X.plan_expert_cache(_inputs(curve=curve, host_bw=50e9, pcie_bw=50e9)).chosen.miss_mode == "upload"


def test_the_cpu_paths_own_costs_count_per_token_and_per_hop():
    """CPU misses cost, beyond their bytes, a hop for each host layer whose token has one and a cost per token
    (fitted on the H200); high enough, they hand the choice back to uploading."""
    curve = _measured_curve()
    cheap = _inputs(curve=curve, host_bw=100e9, pcie_bw=10e9, upload_misses=False)
    a = X.plan_expert_cache(cheap).chosen
    hop = X._candidate(dataclasses.replace(cheap, cpu_miss_hop_s=1e-4), a.gpu_layers, a.cache_bytes, "cpu")
    fixed = X._candidate(dataclasses.replace(cheap, cpu_miss_fixed_s=4e-3), a.gpu_layers, a.cache_bytes, "cpu")
    picks = a.cache_hit_bytes + a.host_read_bytes + a.pcie_bytes
    p_cpu = 1 - (1 - a.host_read_bytes / picks) ** 8
    assert hop.expert_seconds - a.expert_seconds == pytest.approx(a.host_layers * p_cpu * 1e-4)
    assert fixed.expert_seconds - a.expert_seconds == pytest.approx(4e-3)
    assert X.plan_expert_cache(dataclasses.replace(cheap, upload_misses=True)).chosen.miss_mode == "cpu"
    costly = dataclasses.replace(cheap, upload_misses=True, cpu_miss_fixed_s=4.5e-3, cpu_miss_hop_s=107e-6)
    assert X.plan_expert_cache(costly).chosen.miss_mode in ("upload", "none")


def test_without_replayed_shares_the_cpu_mode_is_only_taken_when_asked_for():
    assert DEFAULT_CURVE.cpu_misses is None
    auto = X.plan_expert_cache(_inputs(host_bw=100e9, pcie_bw=10e9)).chosen
    assert auto.miss_mode in ("upload", "none")
    asked = X.plan_expert_cache(_inputs(host_bw=100e9, pcie_bw=10e9, upload_misses=False)).chosen
    assert asked.miss_mode == "cpu" and asked.pcie_bytes == 0      # taken as: every miss on the CPU


def test_no_cache_where_it_is_predicted_to_lose():
    # independent routing: hits only in proportion to the size, and a PCIe 3.0 x4 link
    plan = X.plan_expert_cache(_inputs(curve=UNIFORM, pcie_bw=3e9, cpu_misses=False))
    assert not plan.use_cache
    assert plan.chosen is plan.no_cache and plan.chosen.gpu_layers == 4 * GiB // LAYER
    assert plan.reason.startswith("no cache")


def test_generation_objective_takes_the_most_layers_within_3_percent():
    inp = _inputs(vram_free=12 * GiB)
    plan = X.plan_expert_cache(inp)
    best = max(c.tokens_per_s for c in plan.candidates)
    assert plan.chosen.tokens_per_s >= 0.97 * best
    more_layers = [c for c in plan.candidates if c.gpu_layers > plan.chosen.gpu_layers]
    assert all(c.tokens_per_s < 0.97 * best for c in more_layers)


def test_prompt_objective_keeps_the_most_whole_layers():
    plan = X.plan_expert_cache(_inputs(vram_free=12 * GiB), "prompt")
    assert plan.chosen.gpu_layers == 12 * GiB // LAYER
    gen = X.plan_expert_cache(_inputs(vram_free=12 * GiB), "generation")
    assert plan.chosen.prompt_seconds <= gen.chosen.prompt_seconds
    bal = X.plan_expert_cache(_inputs(vram_free=12 * GiB), "balanced")
    assert gen.chosen.gpu_layers <= bal.chosen.gpu_layers <= plan.chosen.gpu_layers


def test_everything_fits_needs_no_cache():
    plan = X.plan_expert_cache(_inputs(vram_free=49 * LAYER))
    assert not plan.use_cache and plan.chosen.host_layers == 0 and "no cache needed" in plan.reason


def test_a_bank_smaller_than_one_tokens_picks_is_no_candidate():
    # 48 host layers x 8 picks x one expert = 1.0 GiB is the least a cache can be; 0.9 GiB gives no candidate
    expert = LAYER / 128
    inp = _inputs(vram_free=int(48 * 8 * expert * 0.9))
    cands = X.candidates(inp)
    assert [c.cache_bytes for c in cands] == [0]
    assert not X.plan_expert_cache(inp).use_cache
    assert any(c.cache_bytes for c in X.candidates(_inputs(vram_free=int(48 * 9 * expert) + (1 << 20))))


def test_bad_inputs():
    with pytest.raises(ValueError, match="objective"):
        X.plan_expert_cache(_inputs(), "fastest")
    with pytest.raises(ValueError, match="pcie_bw"):
        X.plan_expert_cache(dataclasses.replace(_inputs(), pcie_bw=0))


def test_several_gpus_each_hold_the_banks_of_their_own_layers(models):
    """-sm layer over four GPUs: one slot count for every bank, each GPU's banks and whole layers within its
    own budget, and the layers moved to the cache the first ones of each GPU's range."""
    from planfixtures import machine

    from orchestrator.plan import NodeRequest, PlanRequest, make_plan
    from orchestrator.resolve import nominal_backend

    m = machine("2socket-8gpu")
    # one micro-batch for both, so the cache alone moves layers to host memory
    req = PlanRequest(context=32768, nodes=(NodeRequest(name="server", gpus=(0, 1, 2, 3)),), ubatch=2048)
    model = models("qwen3-235b-a22b")
    w = make_plan(machines={"server": m}, model=model, request=req,
                  backend=nominal_backend("mainline", cuda=True)).workers[0]
    off = make_plan(machines={"server": m}, model=model, request=req.copy(expert_cache_bytes=0),
                    backend=nominal_backend("mainline", cuda=True)).workers[0]
    assert w.expert_cache.use_cache and w.settings.split_mode == "layer"
    assert set(off.cpu_expert_layers) < set(w.cpu_expert_layers)
    gpu_mem = [mm for mm in w.memory if mm.device.startswith("CUDA")]
    assert all(mm.total <= mm.budget for mm in gpu_mem) and sum(1 for mm in gpu_mem if mm.cache) >= 2
    from orchestrator.model.memory import expert_cache_size

    size = expert_cache_size(model, w.cpu_expert_layers, w.settings.expert_cache_mib)
    assert size.slots == w.expert_cache.chosen.slots_per_layer
    assert sum(mm.cache for mm in gpu_mem) == size.bytes
    assert w.predicted.tg > off.predicted.tg


def test_the_cache_size_follows_the_patch_rules(models):
    """slots = MiB / (one expert of every host-resident expert tensor), capped at n_expert; the batch served is
    min(max batch, slots / experts per token); below one token the cache is off and takes nothing."""
    from orchestrator.model.memory import expert_cache_bank_bytes, expert_cache_size

    model = models("qwen3-30b-a3b")
    expert = 3 * 2048 * 768 * 18 // 32                    # q4_0: one expert of up, gate and down
    s = expert_cache_size(model, range(23), 1232)
    assert s.slots == 1232 * (1 << 20) // (23 * expert) == 21 and s.batch_cap == 2 and s.active
    assert s.bytes >= 21 * 23 * expert and s.bytes - 21 * 23 * expert < 23 * 3 * 1024
    assert expert_cache_size(model, range(23), 1232, max_batch=1).batch_cap == 1
    assert expert_cache_size(model, range(4), 1 << 20).slots == 128                    # never more than the experts
    off = expert_cache_size(model, range(48), 200)                                    # 1 slot per tensor < 8 picks
    assert not off.active and off.bytes == 0
    assert expert_cache_size(model, (), 1000).slots == 0
    assert expert_cache_bank_bytes(model, range(10), 21, 2) + expert_cache_bank_bytes(model, range(10, 23), 21, 2) \
        == s.bytes


def test_prompts_that_read_the_slots_copy_only_the_uncached_share():
    """With --moe-cache-prefill a prompt batch reads cached experts from the slots: its copy over PCIe shrinks by
    the cached fraction, so moving VRAM from whole layers to cache costs prompts (almost) nothing."""
    plain = {c.gpu_layers: c for c in X.candidates(_inputs())}
    reads = {c.gpu_layers: c for c in X.candidates(_inputs(prefill_reads_cache=True))}
    assert plain.keys() == reads.keys()
    for k, c in reads.items():
        p = plain[k]
        assert c.tokens_per_s == p.tokens_per_s                 # generation does not change
        if c.cache_bytes:
            host = c.host_layers * LAYER
            assert c.prompt_seconds == pytest.approx(host * (1 - c.fraction) / 50e9 + k * LAYER / 4e12)
            assert c.prompt_seconds < p.prompt_seconds
        else:
            assert c.prompt_seconds == p.prompt_seconds
    cached = [c for c in reads.values() if c.cache_bytes]
    spread = max(c.prompt_seconds for c in cached) / min(c.prompt_seconds for c in cached)
    before = [plain[c.gpu_layers].prompt_seconds for c in cached]
    assert spread < 1.02 and max(before) / min(before) > 1.2


def test_several_streams_share_the_slots_and_read_the_union_of_their_picks():
    one = {c.gpu_layers: c for c in X.candidates(_inputs())}
    four = {c.gpu_layers: c for c in X.candidates(_inputs(streams=4, stream_share_exponent=0.54))}
    u4 = X.union_experts(128, 8, 4)
    assert u4 == pytest.approx(128 * (1 - (120 / 128) ** 4)) and 8 * 3 < u4 < 32
    for k, c in four.items():
        o = one[k]
        assert o.streams == 1 and o.stream_tokens_per_s == pytest.approx(o.tokens_per_s)   # one stream: itself
        assert c.generation == c.stream_tokens_per_s and o.generation == o.tokens_per_s
        assert c.stream_tokens_per_s < 4 * o.tokens_per_s
        if not c.cache_bytes:
            assert c.stream_tokens_per_s > o.tokens_per_s             # the weights are read once per step
        if c.cache_bytes and c.slots_per_layer >= 32:
            assert c.stream_hit_rate < c.hit_rate                 # the streams' picks share the banks
            share = c.fraction * (8 / u4) ** 0.54
            assert c.stream_hit_rate == pytest.approx(X.hit_rate(DEFAULT_CURVE, share))
        elif c.cache_bytes:
            # a bank smaller than four tokens' picks: the patch sends such a batch down the CPU path
            assert c.stream_hit_rate == 0.0
            expert = LAYER / 128
            step = k * u4 * expert / 4e12 + c.host_layers * u4 * expert / 100e9
            assert c.stream_tokens_per_s == pytest.approx(4 / (0.002 + step))
    plan = X.plan_expert_cache(_inputs(streams=4, stream_share_exponent=0.54))
    assert "4 streams' aggregate generation" in plan.reason
    assert any("4 streams decoding together" in line for line in plan.arithmetic())
    assert plan.to_json()["chosen"]["streams"] == 4


PREFETCH = dict(prefetch_miss_cut=((1, 0.66), (4, 0.57)), prefetch_uploads=((1, 0.86), (4, 1.05)))


def test_uploads_ahead_are_weighed_by_the_link_time_they_save_and_add():
    """The misses' link time with uploads ahead: the misses left, plus the uploads ahead not hidden. With none
    hidden (as measured at one stream) the uploads outweigh the misses they save: auto keeps them off; with most
    hidden they win and auto turns them on; on forces them; each candidate's time follows."""
    off = X.plan_expert_cache(_inputs())
    none_hidden = X.plan_expert_cache(_inputs(prefetch="auto", prefetch_overlap=((1, 0.0),), **PREFETCH))
    c = none_hidden.chosen
    assert not c.prefetch and c.prefetch_gain < 1.0
    assert c.tokens_per_s == pytest.approx(off.chosen.tokens_per_s)
    assert X.prefetch_link_factor(_inputs(prefetch_overlap=((1, 0.0),), **PREFETCH), 1) == pytest.approx(
        1 - 0.66 + 0.86)
    hidden = X.plan_expert_cache(_inputs(prefetch="auto", prefetch_overlap=((1, 0.9),), **PREFETCH))
    h = hidden.chosen
    assert h.prefetch and h.prefetch_gain > 1.0 and h.tokens_per_s > off.chosen.tokens_per_s
    # the link bytes of the chosen point: the misses left and every upload ahead
    same = next(x for x in off.candidates if x.gpu_layers == h.gpu_layers and x.cache_bytes == h.cache_bytes)
    assert h.pcie_bytes == pytest.approx(same.pcie_bytes * (1 - 0.66 + 0.86))
    forced = X.plan_expert_cache(_inputs(prefetch="on", prefetch_overlap=((1, 0.0),), **PREFETCH))
    assert forced.chosen.prefetch and forced.chosen.tokens_per_s < off.chosen.tokens_per_s * 1.0001
    assert "uploads ahead of need on" in "\n".join(forced.arithmetic())


def test_uploads_ahead_at_several_streams_use_the_nearest_measured_stream_count():
    inp = _inputs(streams=4, prefetch="auto", prefetch_overlap=((1, 0.0), (4, 0.3)), **PREFETCH)
    assert X.prefetch_link_factor(inp, 4) == pytest.approx(1 - 0.57 + 1.05 * 0.7)
    assert X.prefetch_link_factor(inp, 8) == pytest.approx(X.prefetch_link_factor(inp, 4))
    assert X.prefetch_link_factor(inp, 2) == pytest.approx(X.prefetch_link_factor(inp, 1))
    cached = [c for c in X.candidates(inp) if c.cache_bytes and c.stream_hit_rate]
    assert cached
    for c in cached:                                   # weighed on the aggregate, which they slow here
        assert c.streams == 4 and not c.prefetch and c.prefetch_gain < 1.0
