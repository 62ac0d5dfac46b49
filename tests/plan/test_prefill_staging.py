"""Prompts staged by the expert cache (``--moe-cache-prefill-ahead``): the buffers' bytes as our patch allocates them,
the slots they leave, which micro-batches are staged, the prompt prediction, and when the plan turns it on (pure
planning on the recorded H200)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from planfixtures import backend, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.model.memory import expert_cache_size, expert_cache_stage_bytes
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan import rates as R
from orchestrator.plan.costs import model_costs
from orchestrator.plan.placement import layer_split_placement
from orchestrator.plan.predict import (
    STAGE_NEVER, PromptCache, SpeedInputs, experts_used, offload_copy_seconds, predict_pp, prefill_stageable,
    staging_min_batch,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures"
GiB, MiB = 1 << 30, 1 << 20
STAGING = {"expert_cache", "expert_cache_slot_reads", "expert_cache_slots", "expert_cache_staging"}
# W1 (Qwen3-30B-A3B q4_0): each routed-expert tensor is 128 experts of 2048 x 768 q4_0 weights (18 bytes per 32)
EXPERT_TENSOR = 2048 * 768 * 128 // 32 * 18
EXPERT = EXPERT_TENSOR // 128


@pytest.fixture(scope="module")
def h200():
    return load_machine(FIX / "machines" / "h200.inspect.json")


def _backend(features=STAGING, cuda: bool = True):
    b = backend("mainline", cuda=cuda)
    return dataclasses.replace(b, features=b.features | set(features))


def _worker(models, h200, back=None, budget: int = 12 * GiB, routing=None, **kw):
    fixed = dict(expert_layers_on_cpu=tuple(range(30)), expert_cache_bytes=3362 * MiB, ubatch=2048)
    fixed.update(kw)
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=budget, vram_reserve=256 * MiB),), **fixed)
    return make_plan(machines={"h200": with_gpu_free(h200, budget)}, model=models("qwen3-30b-a3b"), request=req,
                     backend=back or _backend(), routing=routing).workers[0]


def _cache_decision(w) -> str:
    return next(d for d in w.decisions if d.what == "expert cache").why


def test_the_buffers_are_the_largest_expert_tensor_as_cuda_allocates_it(models):
    model = models("qwen3-30b-a3b")
    # the down tensor's rows (768) are padded to 512 elements on CUDA: 256 more q4_0 elements, once; then aligned
    down = -(-(EXPERT_TENSOR + 256 // 32 * 18) // 128) * 128
    assert expert_cache_stage_bytes(model, range(30), 2) == 2 * down
    assert expert_cache_stage_bytes(model, range(30), 3) == 3 * down
    assert expert_cache_stage_bytes(model, (), 2) == 0
    assert expert_cache_stage_bytes(model, range(30), 0) == 0


def test_the_buffers_come_out_of_the_cache_and_leave_fewer_slots(models):
    model = models("qwen3-30b-a3b")
    stage = expert_cache_stage_bytes(model, range(30), 2)
    per_slot = 30 * 3 * EXPERT
    plain = expert_cache_size(model, range(30), 3362)
    staged = expert_cache_size(model, range(30), 3362, stage_bytes=stage)
    assert plain.slots == 3362 * MiB // per_slot == 44 and plain.stage_bytes == 0
    assert staged.slots == (3362 * MiB - stage) // per_slot == 41 and staged.stage_bytes == stage
    # the patch drops the buffers where the rest would not hold one token's experts (8 slots) per tensor
    small = (stage + 8 * per_slot) // MiB
    dropped = expert_cache_size(model, range(30), small, stage_bytes=stage)
    assert dropped.stage_bytes == 0 and dropped.slots == small * MiB // per_slot
    kept = expert_cache_size(model, range(30), small + 1, stage_bytes=stage)
    assert kept.stage_bytes == stage and kept.slots == 8


def test_only_micro_batches_that_use_nearly_every_expert_are_staged():
    # 128 experts, 8 a token: 43 tokens are expected to leave at most 8 (a sixteenth) unused, 42 more
    assert 128 - experts_used(128, 8, 43) <= 8 < 128 - experts_used(128, 8, 42)
    assert prefill_stageable(128, 8, 43) and not prefill_stageable(128, 8, 42)
    assert prefill_stageable(128, 8, 4096) and not prefill_stageable(0, 8, 4096)


def test_staged_prompts_hide_part_of_their_copies_and_no_more(models, h200):
    costs = model_costs(models("qwen3-30b-a3b"))
    p = layer_split_placement(costs, [0] * costs.n_layers, [costs.n_layers], range(30))
    sp = SpeedInputs(gpu_mem_bw=(4.8e12,), gpu_flops=(700e12,), h2d=55e9, host_bw=87e9, cpu_flops=0.4e12,
                     h2d_pinned=55e9)
    host = [i for i in p.cpu_expert_layers if costs.layer_experts[i]]
    assert len(host) == 30
    lengths = (8, 32, 64, 512, 4096)
    plain = predict_pp(costs, p, sp, 2048, 32, lengths=lengths, cache=PromptCache(0.32))
    staged = predict_pp(costs, p, sp, 2048, 32, lengths=lengths, cache=PromptCache(0.32, staged=True))
    assert staged[8] == plain[8]          # on the CPU: nothing offloaded
    assert staged[32] == plain[32]        # offloaded, but 32 tokens leave too many experts unused to copy ahead
    for n in (64, 512, 4096):
        assert staged[n] > plain[n]
        # never more hidden than the share of the copies the overlap allows
        batches = [min(2048, n - s) for s in range(0, n, 2048)]
        copies = sum(offload_copy_seconds(costs, host, b, sp, cached_fraction=0.32) for b in batches)
        assert n / plain[n] - n / staged[n] <= R.PREFILL_STAGED_OVERLAP * copies * (1 + 1e-9)


def test_staged_plans_keep_the_cache_s_vram_and_give_slots_to_prompts(models, h200):
    staged = _worker(models, h200, objective="prompt")
    off = _worker(models, h200, objective="prompt", expert_cache_staging="off")
    assert staged.settings.expert_cache_stage_buffers == R.PREFILL_STAGE_BUFFERS == 2
    assert off.settings.expert_cache_stage_buffers == 0
    assert staged.settings.expert_cache_mib == off.settings.expert_cache_mib == 3362
    assert staged.predicted.pp[512] > 1.15 * off.predicted.pp[512]
    assert 0.94 <= staged.predicted.tg / off.predicted.tg < 1.0              # fewer slots
    assert staged.expert_cache.chosen.stage_buffers == 2 and staged.expert_cache.chosen.slots_per_layer < \
        off.expert_cache.chosen.slots_per_layer
    assert staged.expert_cache.to_json()["chosen"]["stage_buffers"] == 2
    # the same VRAM: the buffers are inside the cache's MiB, and the memory model counts them there
    cuda = lambda w: next(m for m in w.memory if m.device.startswith("CUDA"))   # noqa: E731
    assert abs(cuda(staged).cache - cuda(off).cache) < 64 * MiB
    assert "prompts staged: 2 buffers" in _cache_decision(staged)
    assert "prompts staged" not in _cache_decision(off)


@pytest.mark.parametrize("change, why", [
    (dict(load_mode="mmap"), "memory-mapped"),
    (dict(ubatch=32), "too few of the 128 experts"),
    (dict(op_offload_min_batch=4096), "is not offloaded"),
])
def test_asked_for_where_it_cannot_work_the_plan_says_why(models, h200, change, why):
    asked = _worker(models, h200, expert_cache_staging="on", **change)
    assert asked.settings.expert_cache_stage_buffers == 0
    assert f"prompts not staged: " in _cache_decision(asked) and why in _cache_decision(asked)
    auto = _worker(models, h200, **change)
    assert auto.settings.expert_cache_stage_buffers == 0 and "staged" not in _cache_decision(auto)


def test_no_staging_without_the_option_or_without_cuda(models, h200):
    assert _worker(models, h200, back=_backend(STAGING - {"expert_cache_staging"})).settings \
        .expert_cache_stage_buffers == 0
    assert _worker(models, h200, back=_backend(cuda=False), expert_cache_staging="on").settings \
        .expert_cache_stage_buffers == 0


@pytest.mark.parametrize("objective", ["generation", "balanced", "prompt"])
@pytest.mark.parametrize("budget, mib", [(12 * GiB, 3362), (16 * GiB, 6000)])
def test_objectives_weigh_the_slots_against_the_prompts(models, h200, objective, budget, mib):
    """generation: staged where its generation stays within 3% of the same cache unstaged and prompts gain;
    balanced: where the geometric mean of both ratios gains; prompt: where prompts gain."""
    kw = dict(budget=budget, expert_cache_bytes=mib * MiB, objective=objective)
    on = _worker(models, h200, expert_cache_staging="on", **kw)
    off = _worker(models, h200, expert_cache_staging="off", **kw)
    auto = _worker(models, h200, **kw)
    assert on.settings.expert_cache_stage_buffers == 2 and off.settings.expert_cache_stage_buffers == 0
    tg, pp = on.predicted.tg / off.predicted.tg, on.predicted.pp[512] / off.predicted.pp[512]
    want = {"generation": tg >= 0.97 and pp > 1.01, "balanced": (tg * pp) ** 0.5 > 1.01, "prompt": pp > 1.01}
    assert (auto.settings.expert_cache_stage_buffers == 2) == want[objective], (tg, pp)
    assert auto.predicted.pp[512] == pytest.approx((on if want[objective] else off).predicted.pp[512])
    if mib == 6000:
        # a larger cache loses a smaller share of its slots to the buffers: every objective stages
        assert auto.settings.expert_cache_stage_buffers == 2



# --- micro-batches too small to use nearly every expert under the measured routing -------------------------------

RUN = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "h200-2026-12-04-staged"


def _profile(name: str):
    import json
    import lzma

    from orchestrator.model.routing_profile import RoutingProfile
    return RoutingProfile.from_json(json.loads(lzma.decompress((RUN / f"{name}.profile.json.xz").read_bytes()))
                                    ["profile"])


def _uniform(n_expert: int, k: int, windows=(8, 32, 128, 512)):
    return tuple((w, experts_used(n_expert, k, w)) for w in windows)


def test_the_measured_routing_sets_the_smallest_micro_batch_staged():
    w1, w2 = (_profile(f"routing-{m}-default").curve().distinct for m in ("w1", "w2"))
    # the H200 runs' traces: 128-token windows use 91 (W1) and 84 (W2) of 128 experts, 512-token ones 126 and 124
    assert [w for w, _ in w1] == [8, 32, 128, 512] and round(dict(w1)[128]) == 91 and round(dict(w2)[128]) == 84
    n1, n2 = staging_min_batch(128, 8, w1), staging_min_batch(128, 8, w2)
    assert 300 < n1 < n2 < 450, (n1, n2)        # between the windows, where the unused share crosses 1/16
    assert not prefill_stageable(128, 8, 128, n2) and prefill_stageable(128, 8, 512, n2)
    assert prefill_stageable(128, 8, n1, n1) and not prefill_stageable(128, 8, n1 - 1, n1)


def test_routing_as_uniform_as_the_rule_assumes_needs_no_minimum():
    assert staging_min_batch(128, 8, _uniform(128, 8)) == 0
    assert staging_min_batch(128, 8, ()) == 0 and staging_min_batch(0, 8, _uniform(128, 8)) == 0
    # the smallest window already uses all but a sixteenth: nothing beyond the uniform rule
    assert staging_min_batch(128, 8, ((8, 121.0), (32, 127.0))) == 0


def test_the_crossing_is_interpolated_and_extrapolated_on_the_unused_share():
    import math
    # unused share 1/2 at 100 tokens, 1/32 at 500: it crosses 1/16 three quarters of the way (halving per 100)
    assert staging_min_batch(128, 8, ((100, 64.0), (500, 124.0))) == 400
    # past the largest window at the last two windows' rate: 1/4 at 100, 1/8 at 200 -> 1/16 at 300
    assert staging_min_batch(128, 8, ((100, 96.0), (200, 112.0))) == 300
    # a share that does not fall: never staged
    assert staging_min_batch(128, 8, ((128, 60.0), (512, 60.0))) == STAGE_NEVER
    assert math.isfinite(staging_min_batch(128, 8, ((128, 60.0), (512, 100.0))))


def test_a_prompt_below_the_minimum_is_predicted_as_unstaged(models):
    costs = model_costs(models("qwen3-30b-a3b"))
    p = layer_split_placement(costs, [0] * costs.n_layers, [costs.n_layers], range(30))
    sp = SpeedInputs(gpu_mem_bw=(4.8e12,), gpu_flops=(700e12,), h2d=55e9, host_bw=87e9, cpu_flops=0.4e12,
                     h2d_pinned=55e9)
    lengths = (128, 400, 401, 4096)
    plain = predict_pp(costs, p, sp, 2048, 32, lengths=lengths, cache=PromptCache(0.32))
    any_batch = predict_pp(costs, p, sp, 2048, 32, lengths=lengths, cache=PromptCache(0.32, staged=True))
    from_401 = predict_pp(costs, p, sp, 2048, 32, lengths=lengths, cache=PromptCache(0.32, staged=True,
                                                                                  stage_min_batch=401))
    assert any_batch[128] > plain[128] and from_401[128] == plain[128] and from_401[400] == plain[400]
    assert from_401[401] == any_batch[401] and from_401[4096] == any_batch[4096]


def test_the_plan_passes_the_minimum_where_the_server_has_the_option(models, h200):
    w2 = _profile("routing-w2-default").curve()
    need = staging_min_batch(128, 8, w2.distinct)
    with_option = _backend(STAGING | {"expert_cache_stage_min_batch"})
    w = _worker(models, h200, back=with_option, routing=w2, objective="prompt")
    assert w.settings.expert_cache_stage_buffers == 2 and w.settings.expert_cache_stage_min_batch == need
    argv = list(w.args)
    assert argv[argv.index("--moe-cache-prefill-ahead-min-batch") + 1] == str(need)
    assert f"micro-batches from {need} tokens" in _cache_decision(w)
    assert w.expert_cache.to_json()["chosen"]["stage_min_batch"] == need
    # the prediction follows: a 128-token prompt as unstaged, 512 staged
    off = _worker(models, h200, back=with_option, routing=w2, objective="prompt", expert_cache_staging="off")
    assert w.predicted.pp[512] > 1.05 * off.predicted.pp[512]
    # a server without the option stages every micro-batch by the uniform rule: no flag, no minimum
    old = _worker(models, h200, routing=w2, objective="prompt")
    assert old.settings.expert_cache_stage_buffers == 2 and old.settings.expert_cache_stage_min_batch == 0
    assert "--moe-cache-prefill-ahead-min-batch" not in old.args
    # nothing measured (the default curve): no minimum either
    assert _worker(models, h200, back=with_option, objective="prompt").settings \
        .expert_cache_stage_min_batch == 0


def test_a_micro_batch_below_the_measured_minimum_is_not_staged_and_the_plan_says_so(models, h200):
    w2 = _profile("routing-w2-default").curve()
    with_option = _backend(STAGING | {"expert_cache_stage_min_batch"})
    w = _worker(models, h200, back=with_option, routing=w2, ubatch=256, expert_cache_staging="on")
    assert w.settings.expert_cache_stage_buffers == 0
    assert "the measured routing needs" in _cache_decision(w)
