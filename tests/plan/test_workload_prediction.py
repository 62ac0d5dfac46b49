"""What a plan predicts for the whole workload: prompts that read the expert cache's slots, several streams
decoding together, and time to first token (pure planning on the recorded H200)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from planfixtures import backend, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan.types import TTFT_LENGTHS, Prediction

FIX = Path(__file__).resolve().parents[1] / "fixtures"
GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def h200():
    return load_machine(FIX / "machines" / "h200.inspect.json")


def _backend(*extra: str):
    b = backend("mainline")
    return dataclasses.replace(b, features=(b.features - {"expert_cache_slot_reads"}) | {"expert_cache", *extra})


def _worker(models, h200, budget: int, back, **kw):
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=budget, vram_reserve=256 * MiB),), **kw)
    plan = make_plan(machines={"h200": with_gpu_free(h200, budget)}, model=models("qwen3-30b-a3b"), request=req,
                     backend=back)
    return plan.workers[0]


@pytest.mark.parametrize("shape, host, mib, low, high", [
    # as the H200 measured: W1 1.15x with a prefill's moves in one kernel against one copy per expert (12 GiB, 30
    # host layers, 34% cached); W2, four times larger experts, 1.24x already with one copy per expert
    (("qwen3-30b-a3b", None), tuple(range(26)), 2277, 1.08, 1.25),
    (("qwen3-235b-a22b", 24), tuple(range(13)), 6221, 1.20, 1.50),
])
def test_prompts_that_read_the_slots_are_predicted_faster_with_the_same_placement(models, h200, shape, host, mib,
                                                                                  low, high):
    like, layers = shape
    fixed = dict(expert_layers_on_cpu=host, expert_cache_bytes=mib * MiB, ubatch=1024)
    budget = 12 * GiB if layers is None else 24 * GiB
    model = models(like, layers=layers) if layers else models(like)

    def worker(back):
        req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=budget, vram_reserve=256 * MiB),), **fixed)
        return make_plan(machines={"h200": with_gpu_free(h200, budget)}, model=model, request=req,
                         backend=back).workers[0]

    without, reads = worker(_backend()), worker(_backend("expert_cache_slot_reads"))
    assert without.settings.expert_cache_mib == reads.settings.expert_cache_mib == mib
    assert reads.predicted.tg == pytest.approx(without.predicted.tg)
    gain = reads.predicted.pp[512] / without.predicted.pp[512]
    assert low < gain < high, gain
    assert reads.predicted.pp[4096] > without.predicted.pp[4096]
    assert reads.predicted.pp[8] == pytest.approx(without.predicted.pp[8])   # small batches stay on the CPU


def test_the_plan_states_aggregate_generation_and_time_to_first_token(models, h200):
    one = _worker(models, h200, 12 * GiB, _backend("expert_cache_slot_reads"))
    four = _worker(models, h200, 12 * GiB, _backend("expert_cache_slot_reads"), parallel=4)
    assert one.predicted.streams == 1 and one.predicted.tg_streams == pytest.approx(one.predicted.tg)
    p = four.predicted
    assert p.streams == 4 and p.tg_streams > p.tg
    doc = p.to_dict()
    assert doc["streams"] == 4 and doc["tg_streams"] == pytest.approx(p.tg_streams, abs=0.01)
    for n in TTFT_LENGTHS:
        assert doc["ttft_s"][str(n)] == pytest.approx(n / p.pp[n] + 1 / p.tg, rel=1e-3)
    line = p.summary()
    assert "4 streams" in line and "time to first token: 512 tokens" in line
    # the cache plan says what it weighed: the four streams' aggregate
    assert four.expert_cache is not None and "4 streams" in four.expert_cache.reason


def test_time_to_first_token_needs_both_speeds():
    assert Prediction(pp={512: 1000.0}, tg=0.0).ttft(512) is None
    assert Prediction(pp={}, tg=50.0).ttft(512) is None
    assert Prediction(pp={512: 1024.0}, tg=50.0).ttft(512) == pytest.approx(0.5 + 0.02)
