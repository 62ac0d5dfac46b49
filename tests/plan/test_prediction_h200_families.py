"""The other model families' generation against what the H200 measured (docs/benchmarks/h200-2026-12-04-families):
W4 = the gpt-oss-120b shape cut to 12 layers (MXFP4 experts with biases), W5 = the GLM-4.5-Air shape cut to 16
layers (q4_0), each planned for 10 GiB: every expert layer in host memory (W5: all but the dense first layer), the
rest of the VRAM as cache, slots assigned on the device.

Each run is replanned from what it printed: the plan's llama-server argv (host-resident layers, cache, micro-batch),
the probe's bandwidth from the plan's op-offload line, the routing profile's LRU points (routing-wN.txt: the profile
traced on the GPU before planning, 1024 random ids in decode order), and the measured tg128 of the table.

W4 ran again with the plan keeping a cached layer's expert biases on the GPU (docs/benchmarks/h200-2026-12-04-w4-biases,
the generator's token-independent attention windows): generation 1.51x the same plan with the biases in host memory, as
--cpu-moe puts them, where each bias's ADD_ID ran on the CPU between the layer's GPU splits.
"""

from __future__ import annotations

import dataclasses
import lzma
import re
import shlex
from pathlib import Path

import pytest
from planfixtures import backend, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.hardware.topology import Bandwidth
from orchestrator.model.routing_profile import HitCurve
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.model.memory import cuda_tensor_bytes
from orchestrator.plan.costs import model_costs
from orchestrator.plan.placement import matches

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "benchmarks" / "h200-2026-12-04-families"
BIASES_RUN = ROOT / "docs" / "benchmarks" / "h200-2026-12-04-w4-biases"   # W4 with the biases on the GPU
DEFAULT_CURVE_RUN = ROOT / "docs" / "benchmarks" / "h200-2026-12-05-families"   # W3, W5 on the default curves
FIX = ROOT / "tests" / "fixtures"
GiB, MiB = 1 << 30, 1 << 20


def _text(name: str, run: Path = RUN) -> str:
    return lzma.decompress((run / name).read_bytes()).decode()


def _argv(plan: str) -> list[str]:
    line = next(ln for ln in plan.splitlines() if "llama-server -m " in ln)
    return shlex.split(line)


def _profile_curve(workload: str, model: str, run: Path = RUN) -> HitCurve:
    """The per-layer LRU points the routing trace printed for ``model`` (5, 10, 15, 30, 50% of a layer's experts)."""
    text = _text(f"routing-{workload.split('-')[0]}.txt.xz", run)
    block = text[text.index(f"model   /root/work/models/{model}"):]
    table = block[block.index("per-layer LRU"):]
    rows = re.findall(r"^\s+(\d+)%\s+[\d.]+\s+([\d.]+)%", table, re.M)[:5]
    xs = (0.0,) + tuple(int(f) / 100 for f, _ in rows) + (1.0,)
    ys = (0.0,) + tuple(float(h) / 100 for _, h in rows) + (1.0,)
    return HitCurve(fractions=xs, hits=ys, source=f"{model}: routing-{workload.split('-')[0]}.txt")


def _measured_tg(table: str, config: str = "plan") -> float:
    row = next(ln for ln in table.splitlines() if re.match(rf"\s+{config}\s+one server", ln))
    return float(re.search(r"([\d.]+) ±", row).group(1))


def _replan(models, workload: str, like: str, layers: int, budget_gib: int, quant: str = "q8_0",
            hit_rate: float | None = None, as_ran: bool = True, run: Path = RUN):
    """The run replanned as it ran (its argv, bandwidth and profile); ``hit_rate``: a curve through this hit rate
    at the run's cached share in place of the profile's; ``as_ran`` False: the plan's own choice of host-resident
    layers and cache on the run's machine and profile."""
    plan = _text(f"plan-{workload}.txt.xz", run)
    args = _argv(plan)
    ot = args[args.index("-ot") + 1]
    host = tuple(int(x) for x in re.match(r"blk\\\.\(([0-9|]+)\)", ot).group(1).split("|"))
    assert ot.endswith("exps\\.weight=CPU") == (run == BIASES_RUN), ot
    mib = int(args[args.index("--moe-cache-mib") + 1])
    pinned, host_bw = re.search(r"at ([\d.]+) GB/s \+ GPU = .*\(([\d.]+) GB/s", plan).groups()
    bw = Bandwidth.from_json({"gpu_h2d": [{"gpu": 0, "node": 0, "bytes_per_s": float(pinned) * 1e9}],
                              "gpu_d2h": [{"gpu": 0, "node": 0, "bytes_per_s": float(pinned) * 1e9}],
                              "host": [{"cpu_node": 0, "mem_node": 0, "bytes_per_s": float(host_bw) * 1e9}],
                              "measured_at": "2026-12-04T00:00:00+0000", "key": "families"})
    h200 = load_machine(FIX / "machines" / "h200.inspect.json")
    machine = dataclasses.replace(with_gpu_free(h200, budget_gib * GiB), bandwidth=bw)
    b = backend("mainline")
    b = dataclasses.replace(b, features=b.features | {"expert_cache", "expert_cache_slot_reads", "expert_cache_slots"})
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=budget_gib * GiB, vram_reserve=256 * MiB),),
                      expert_layers_on_cpu=host if as_ran else None, expert_cache_bytes=mib * MiB if as_ran else None,
                      ubatch=int(args[args.index("-ub") + 1]), parallel=int(args[args.index("-np") + 1]))
    model = models(like, quant, layers=layers)
    # a plan that printed the family's default curve ran without a profile: replanned without one as well
    default_curve = "hit-rate curve: default " in plan
    curve = None if default_curve else _profile_curve(workload, Path(args[args.index("-m") + 1]).name, run)
    if hit_rate is not None:
        share = float(re.search(r"= ([\d.]+)% of the host-resident ones", plan).group(1)) / 100
        curve = HitCurve(fractions=(0.0, share, 1.0), hits=(0.0, hit_rate, 1.0), source="the run's counters")
    w = make_plan(machines={"h200": machine}, model=model, request=req, backend=b, routing=curve).workers[0]
    assert w.settings.expert_cache_mib == mib or not as_ran
    return w


def test_gpt_oss_layers_count_the_bytes_of_their_expert_biases(models):
    model = models("gpt-oss-120b", "q8_0", layers=2)
    biases = [sum(cuda_tensor_bytes(t) for t in model.tensors if t.layer == i and t.name.endswith("_exps.bias"))
              for i in range(2)]
    assert biases[0] > 0
    assert model_costs(model).layer_expert_side_bytes == tuple(biases)
    assert model_costs(models("qwen3-30b-a3b", layers=2)).layer_expert_side_bytes == (0, 0)


def test_a_cached_gpt_oss_plan_keeps_the_expert_biases_on_the_gpu(models):
    """W4's run had every routed-expert tensor of its cached layers in host memory (llama.cpp's --cpu-moe pattern),
    so each bias's ADD_ID ran on the CPU between the layer's GPU splits. The plan now moves only the weights the
    cache serves; the biases stay on the GPU, counted there, and the cache's MiB leaves room for them."""
    w = _replan(models, "w4-10g", "gpt-oss-120b", 12, 10, as_ran=False)
    model = models("gpt-oss-120b", "q8_0", layers=12)
    (pattern, buft), = w.settings.tensor_overrides
    assert buft == "CPU"
    host = set(w.cpu_expert_layers)
    assert len(host) == 12
    for t in model.tensors:
        if t.layer in host and "_exps." in t.name:
            assert matches(pattern, t.name) == t.name.endswith(".weight"), (pattern, t.name)
    biases = sum(model_costs(model).layer_expert_side_bytes[i] for i in host)
    gpu, cpu = w.memory[0], w.memory[-1]
    experts = sum(cuda_tensor_bytes(t) for t in model.tensors if t.layer in host and t.cls.name == "ROUTED_EXPERT")
    assert cpu.weights >= experts - biases
    assert gpu.total <= gpu.budget
    # the same plan without a cache: the biases go with the experts to the CPU, where their matrix products run
    b = dataclasses.replace(backend("mainline"), features=backend("mainline").features - {"expert_cache"})
    h200 = with_gpu_free(load_machine(FIX / "machines" / "h200.inspect.json"), 10 * GiB)
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=10 * GiB, vram_reserve=256 * MiB),),
                      expert_layers_on_cpu=tuple(sorted(host)))
    plain = make_plan(machines={"h200": h200}, model=model, request=req, backend=b).workers[0]
    assert plain.settings.expert_cache_mib == 0
    (p2, _), = plain.settings.tensor_overrides
    assert all(matches(p2, t.name) for t in model.tensors if t.layer in host and "_exps." in t.name)
    assert plain.memory[-1].weights - cpu.weights == biases
    print(f"W4 replanned: {w.predicted.tg:.1f} t/s predicted with the biases on the GPU; {biases / MiB:.1f} MiB")


def test_w4_with_its_biases_on_the_gpu_hits_as_predicted_and_misses_in_gpt_oss_layers(models):
    """The W4 run with the biases on the GPU, replanned as it ran: the hit rate the plan predicts from the profile is
    the counters' within a point, and generation is predicted 21% fast. The same model all on the GPU (60 GiB, no
    expert in host memory) was predicted 2.07x fast in the same run, about 1.2 ms per token, against the 0.8 ms
    this plan misses: the miss is in gpt-oss's layers on CUDA, not in the cache. The recorded miss, so that a fix
    shows here."""
    w = _replan(models, "w4-10g", "gpt-oss-120b", 12, 10, run=BIASES_RUN)
    c = w.expert_cache.chosen
    assert (c.gpu_layers, c.host_layers, c.slots_per_layer, c.device_slots) == (1, 11, 36, True)
    table = _text("w4-10g.txt.xz", BIASES_RUN)
    counters = float(re.search(r"^\s+plan\s+one server.*?±\d+%\s+(\d+\.\d)%", table, re.M).group(1)) / 100
    assert abs(c.hit_rate - counters) < 0.03, (c.hit_rate, counters)
    measured = _measured_tg(table)
    assert measured == 210
    assert w.predicted.tg / measured == pytest.approx(1.21, abs=0.04), (w.predicted.tg, measured)
    biases_cpu = _measured_tg(table, "plan-biases-cpu")
    assert measured / biases_cpu == pytest.approx(1.51, abs=0.01)
    allgpu = _text("w4-allgpu.txt.xz", BIASES_RUN)
    assert re.search(r"predicted/measured\s+tg128@0\s+2\.07", allgpu)
    print(f"W4, biases on the GPU: predicted {w.predicted.tg:.1f} t/s, measured {measured:.0f} ({biases_cpu:.0f} with "
          f"the biases in host memory); hits {c.hit_rate:.1%} predicted, {counters:.1%} counted")


def test_w5_generation_with_the_counters_hit_rate(models):
    """W5 was predicted 0.60 of its generation from the profile's 79.4% hits; its counters said 92.6% (the bench
    generates positions 1-128 of a fresh context, where the generated routing is more local than the profile's
    average: docs/model.md, "Locality by position in the context"). With the counters' hit rate the same plan
    predicts the measured generation."""
    measured = _measured_tg(_text("w5-10g.txt.xz"))
    profile = _replan(models, "w5-10g", "glm-4.5-air", 16, 10, quant="q4_0")
    c = profile.expert_cache.chosen
    assert (c.host_layers, c.slots_per_layer) == (15, 41)
    assert c.hit_rate == pytest.approx(0.794, abs=0.005)
    assert profile.predicted.tg / measured == pytest.approx(0.60, abs=0.02)     # the recorded miss
    counted = _replan(models, "w5-10g", "glm-4.5-air", 16, 10, quant="q4_0", hit_rate=0.926)
    assert counted.expert_cache.chosen.hit_rate == pytest.approx(0.926, abs=0.001)
    assert counted.predicted.tg / measured == pytest.approx(1.0, abs=0.10), (counted.predicted.tg, measured)
    print(f"W5: {profile.predicted.tg:.1f} t/s at the profile's hits, {counted.predicted.tg:.1f} at the counters', "
          f"measured {measured:.0f}")


def test_w3_generation_misses_a_cost_beyond_its_hit_rate(models):
    """W3 (DeepSeek-V3 cut to 6 layers, 3 MoE of 256 experts, 12 GiB) replanned with its counters' hit rate still
    predicts its generation 18% fast: about 0.5 ms per token the model does not have (no op of its graph runs on
    the CPU; fit-pinned's prediction is 1.2x fast too). The recorded miss, so that a fix shows here."""
    measured = _measured_tg(_text("w3-12g.txt.xz"))
    counted = _replan(models, "w3-12g", "deepseek-v3", 6, 12, quant="q4_0", hit_rate=0.935)
    assert counted.predicted.tg / measured == pytest.approx(1.18, abs=0.04), (counted.predicted.tg, measured)


def _measured_pp(table: str) -> tuple[float, float]:
    row = next(ln for ln in table.splitlines() if re.match(r"\s+plan\s+one server", ln)).split()
    return float(row[8]), float(row[9])


@pytest.mark.parametrize("workload, like, layers, budget, quant, run, within", [
    ("w3-12g", "deepseek-v3", 6, 12, "q4_0", RUN, 0.10),
    ("w5-10g", "glm-4.5-air", 16, 10, "q4_0", RUN, 0.10),
], ids=["w3", "w5"])
def test_the_other_families_prompts_are_predicted_from_the_qwen3_fit(models, workload, like, layers, budget, quant,
                                                                     run, within):
    """Held out: the GPU prompt constants are fitted on W1 and W2 only. W3's last layer is one of its three MoE
    layers, host-resident, whose experts a prompt neither copies nor multiplies (llama.cpp keeps the output rows
    only before the last feed-forward): counted as every token's, its prompts were predicted 0.69 / 0.84 of measured."""
    w = _replan(models, workload, like, layers, budget, quant=quant, run=run)
    pp512, pp4096 = _measured_pp(_text(f"{workload}.txt.xz", run))
    assert w.predicted.pp[512] / pp512 == pytest.approx(1.0, abs=within), (w.predicted.pp[512], pp512)
    assert w.predicted.pp[4096] / pp4096 == pytest.approx(1.0, abs=within), (w.predicted.pp[4096], pp4096)


def test_gpt_oss_prompts_stay_predicted_fast(models):
    """gpt-oss's graph runs its last layer for every token, so nothing changes for W4: its prompts are predicted
    14% and 54% fast, a miss of gpt-oss's layers on CUDA as its generation's is (recorded so that a fix shows)."""
    w = _replan(models, "w4-10g", "gpt-oss-120b", 12, 10, run=BIASES_RUN)
    assert model_costs(models("gpt-oss-120b", "q8_0", layers=12)).prompt_skip_ffn_layer is None
    pp512, pp4096 = _measured_pp(_text("w4-10g.txt.xz", BIASES_RUN))
    assert w.predicted.pp[512] / pp512 == pytest.approx(1.14, abs=0.04)
    assert w.predicted.pp[4096] / pp4096 == pytest.approx(1.54, abs=0.06)


@pytest.mark.parametrize("workload, like, layers, budget, default_hits, counted, default_ratio", [
    ("w3-12g", "deepseek-v3", 6, 12, 0.762, 0.850, 0.81),
    ("w5-10g", "glm-4.5-air", 16, 10, 0.530, 0.859, 0.41),
], ids=["w3", "w5"])
def test_the_default_curves_runs_are_predicted_with_the_counters_hit_rate(models, workload, like, layers, budget,
                                                                          default_hits, counted, default_ratio):
    """W3 and W5 of today's generator (docs/benchmarks/h200-2026-12-05-families), planned with the family's default
    hit curve (no routing profile ran there): the curve's cautious hit rate is their whole generation miss. The
    same plans with the hit rate their counters gave predict the measured generation within 10%."""
    measured = _measured_tg(_text(f"{workload}.txt.xz", DEFAULT_CURVE_RUN))
    default = _replan(models, workload, like, layers, budget, quant="q4_0", run=DEFAULT_CURVE_RUN)
    assert default.expert_cache.chosen.hit_rate == pytest.approx(default_hits, abs=0.01)
    assert default.predicted.tg / measured == pytest.approx(default_ratio, abs=0.03)     # the recorded miss
    hits = _replan(models, workload, like, layers, budget, quant="q4_0", hit_rate=counted, run=DEFAULT_CURVE_RUN)
    assert hits.predicted.tg / measured == pytest.approx(1.0, abs=0.10), (hits.predicted.tg, measured)
