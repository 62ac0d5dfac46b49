"""The expert-cache prediction against what the H200 measured (docs/benchmarks/h200-2026-12-01-w1-cache and
h200-2026-12-01-cache-rev).

W1 = the Qwen3-30B-A3B shape (q4_0) written by `synth-model --locality` (0, default, high), its routing profile
measured, then planned under a VRAM budget of 8, 12 or 16 GiB and run by `lab/device/run.sh w1-cache`: the plan, its
placement without the cache (`ncmoeN`), the same with 4/8/12 more layers of experts in host memory and their VRAM
as cache (`ncmoeN+cacheM`), the plan with `--moe-cache-cpu-misses`, the plan again. W2 = the Qwen3-235B-A22B shape
cut to 24 layers (q4_0, default locality) under 24 GiB, run twice the same way by `run.sh w2-cache`. Each bench record
holds the exact llama-server argv, generation speed (sampled with llama-server's own top_k), the cache's counters and
the VRAM peak; beside it the plan that ran, and the cache each server made (its log line). The hit-rate curves are the
routing profiles of the same models (tests/fixtures/routing/w*-loc-*.profile.json.xz).

The first set ran the patch before a split with CPU-computed misses kept its CUDA graphs; its CPU-miss rows measured
a path the patch no longer has (0.49-0.56x of uploading, against 0.67-0.80x since), so only the second set's are
checked. The upload path is the same in both; its constants were fitted on the first set (the second, W2 included,
checks them out of sample).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import lzma
import re
import statistics
from pathlib import Path

import pytest
from planfixtures import backend, with_gpu_free

from orchestrator.bench.logparse import parse_load_log
from orchestrator.hardware.dump import load_machine
from orchestrator.hardware.topology import Bandwidth
from orchestrator.launch.settings import WorkerSettings
from orchestrator.model.routing_profile import RoutingProfile, hit_rate
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan import expert_cache as X

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
FIRST, REVISED = "h200-2026-12-01-w1-cache", "h200-2026-12-01-cache-rev"
BENCH = ROOT / "docs" / "benchmarks"
GiB, MiB = 1 << 30, 1 << 20
LOCALITIES = ("loc0", "default", "high")
# W2 at 24 GiB, 17 host layers and an 11 GiB cache: 121 t/s in the first run, 158 in the second of the same argv,
# far outside the A/A between starts (0.95-1.04); the prediction (147) is checked against the second.
NOT_REPEATED = {(f"{REVISED}/w2-default-24g-r1", "ncmoe21+cache16525")}
# W1 at 12 GiB planned on the H200 with the profile traced there: -ub 2048, 28 host layers and 2714 MiB (138.4 t/s
# predicted). The profile traced here on the CPU (within 0.3 points of it) puts the 27-layer candidate at -ub 2048
# just inside the objective's 3% of the best generation, so -ub 2048 loses to -ub 1024 there: 26 layers, 2277 MiB.
BOUNDARY_TIES = {f"{REVISED}/default-12g"}
SHAPES = {"w1": ("qwen3-30b-a3b", None), "w2": ("qwen3-235b-a22b", 24)}


def _cached_backend():
    b = backend("mainline")
    return b.__class__(**{**b.__dict__, "features": b.features | {"expert_cache"}})


@functools.lru_cache(maxsize=None)
def _profile(locality: str, model: str = "w1") -> RoutingProfile:
    name = {"loc0": "0"}.get(locality, locality)
    doc = json.loads(lzma.decompress((FIX / "routing" / f"{model}-loc-{name}.profile.json.xz").read_bytes()))
    return RoutingProfile.from_json(doc["profile"])


def _curve(locality: str, model: str = "w1"):
    return _profile(locality, model).curve("lru-layer")


def _shape(models, model: str):
    like, layers = SHAPES[model]
    return models(like, layers=layers) if layers else models(like)


def _model_and_locality(plan) -> tuple[str, str]:
    """('w1', 'loc0') for the plan of w1-loc-0.gguf."""
    model, _, loc = Path(plan["model"]["path"]).stem.split("-", 2)
    return model, {"0": "loc0"}.get(loc, loc)


def _xz_json(path: Path):
    return json.loads(lzma.decompress(path.read_bytes()))


@functools.lru_cache(maxsize=1)
def _runs():
    """{set/run: (bench, plan)} (read once; not to be modified): h200-2026-12-01-w1-cache/default-12g-r1, ..."""
    return {f"{d}/{f.name.removesuffix('.json.xz')}": (_xz_json(f), _xz_json(f.with_name("plan-" + f.name)))
            for d in (FIRST, REVISED) for f in sorted((BENCH / d).glob("*.json.xz")) if not f.name.startswith("plan-")}


def _cache_lines():
    """{(set/run, config): what the server said about its cache}."""
    out = {}
    for d in (FIRST, REVISED):
        for line in lzma.decompress((BENCH / d / "cache-init.txt.xz").read_bytes()).decode().splitlines():
            run, rest = line.split(" ", 1)
            config, text = rest.split(": ", 1)
            out[(f"{d}/{run}", config)] = parse_load_log(text).expert_cache
    return out


def _records():
    """One record per (run, configuration) that ran with the plan's placement or a grid point."""
    out = []
    for run, (bench, plan) in _runs().items():
        model, locality = _model_and_locality(plan)
        for cfg in bench["configs"]:
            if "-ot" not in cfg["args"]:       # fit-pinned: llama.cpp places the experts itself
                continue
            if run.startswith(FIRST) and "--moe-cache-cpu-misses" in cfg["args"]:
                continue
            runs = [r for r in bench["runs"] if r["config"] == cfg["name"] and r["status"] == "ok"]
            cache = [r["samples"]["moe_cache"] for r in runs if r["samples"].get("moe_cache")]
            out.append({"run": run, "config": cfg["name"], "args": cfg["args"], "budget": bench["vram_budget"],
                        "model": model, "locality": locality, "bandwidth": bench["plan_context"]["bandwidth"],
                        "tg": statistics.median(s["tps"] for r in runs for s in r["samples"]["tg"]),
                        "hit_rate": (sum(c["hits"] for c in cache) / sum(c["lookups"] for c in cache)
                                     if cache else None),
                        "vram_peak": statistics.median(r["resources"]["gpus"]["0"]["peak_process"] for r in runs),
                        "cpu_misses": "--moe-cache-cpu-misses" in cfg["args"]})
    return out


def _layers_and_cache(args):
    a = list(args)
    ot = a[a.index("-ot") + 1]
    layers = tuple(int(x) for x in re.match(r"blk\\\.\(([0-9|]+)\)", ot).group(1).split("|"))
    mib = int(a[a.index("--moe-cache-mib") + 1]) if "--moe-cache-mib" in a else 0
    return layers, mib


@pytest.fixture(scope="module")
def h200():
    return load_machine(FIX / "machines" / "h200.inspect.json")


def _machine(h200, rec):
    """The recorded H200 as the run saw it: its budget as free VRAM, the bandwidth its probe measured that day."""
    return dataclasses.replace(with_gpu_free(h200, rec["budget"]), bandwidth=Bandwidth.from_json(rec["bandwidth"]))


def _worker(models, h200, rec, **kw):
    layers, mib = _layers_and_cache(rec["args"])
    a = rec["args"]
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=rec["budget"], vram_reserve=256 * MiB),),
                      expert_layers_on_cpu=layers, expert_cache_bytes=mib * MiB if mib else 0,
                      ubatch=int(a[a.index("-ub") + 1]), **kw)
    b = _cached_backend()
    if rec["cpu_misses"]:
        b = b.__class__(**{**b.__dict__, "features": b.features | {"expert_cache_cpu_misses"}})
        req = dataclasses.replace(req, expert_cache_misses="cpu")
    return make_plan(machines={"h200": _machine(h200, rec)}, model=_shape(models, rec["model"]), request=req,
                     backend=b, routing=_curve(rec["locality"], rec["model"])).workers[0]


def test_the_records_are_the_runs():
    recs = _records()
    assert {r["run"] for r in recs} == {f"{FIRST}/{r}" for r in ("default-12g-r1", "default-12g-r2", "default-8g",
                                                                 "default-16g", "loc0-12g", "high-12g")} | \
        {f"{REVISED}/{r}" for r in ("default-8g", "default-12g", "default-16g", "w2-default-24g-r1",
                                    "w2-default-24g-r2")}
    assert sum("+cache" in r["config"] for r in recs) == 16 + 11
    assert sum(r["cpu_misses"] for r in recs) == 5 and all(r["run"].startswith(REVISED) for r in recs
                                                           if r["cpu_misses"])
    assert {(r["model"], r["locality"]) for r in recs} == {("w1", "loc0"), ("w1", "default"), ("w1", "high"),
                                                           ("w2", "default")}
    assert all(r["hit_rate"] is not None for r in recs if "--moe-cache-mib" in r["args"])


def test_predicted_generation_within_15_percent_of_measured(models, h200):
    """Every configuration, with the hit rate (and with CPU misses, the shares) its locality's profile predicts:
    the plan, the grid around it, the plan with --moe-cache-cpu-misses, and the plan's placement without the cache.

    Without a cache the host layers' picks are read at the probe's host bandwidth, and the second set's probe read
    98.7 GB/s against the first's 87.2 while those placements ran as fast as before (16 GiB: 108.0 against 107.4
    t/s): their prediction is held to 20% (1.17 at 16 GiB, 1.14 at 8 GiB), the cache's to 15%."""
    checked = 0
    for rec in _records():
        if (rec["run"], rec["config"]) in NOT_REPEATED:
            continue
        w = _worker(models, h200, rec)
        ratio = w.predicted.tg / rec["tg"]
        high = 1.15 if "--moe-cache-mib" in rec["args"] else 1.20
        assert 0.85 <= ratio <= high, (rec["run"], rec["config"], round(w.predicted.tg, 1), round(rec["tg"], 1))
        if "--moe-cache-mib" in rec["args"]:
            assert w.settings.expert_cache_mib == _layers_and_cache(rec["args"])[1]
            assert w.expert_cache is not None and w.expert_cache.use_cache
            assert w.expert_cache.chosen.miss_mode == ("cpu" if rec["cpu_misses"] else "upload")
        checked += 1
    assert checked == 31 + 31 - 1


def test_predicted_slots_and_hit_rate_match_the_server_and_its_counters(models, h200):
    """Slots and the banks' device memory exactly as the server made them; hit rate within 5 points of the
    counters at every locality."""
    lines = _cache_lines()
    checked = 0
    for rec in _records():
        if "--moe-cache-mib" not in rec["args"] or rec["cpu_misses"]:
            continue
        w = _worker(models, h200, rec)
        c = w.expert_cache.chosen
        made = lines[(rec["run"], rec["config"])]
        assert made["slots"] == c.slots_per_layer and made["tensors"] == 3 * c.host_layers, (rec, made)
        cuda0 = next(m for m in w.memory if m.device == "CUDA0")
        assert cuda0.cache == pytest.approx(made["bytes"], abs=0.06 * MiB)   # printed to 0.1 MiB
        predicted = hit_rate(_curve(rec["locality"], rec["model"]), c.fraction)
        assert abs(predicted - rec["hit_rate"]) <= 0.05, (rec["run"], rec["config"], predicted, rec["hit_rate"])
        checked += 1
    assert checked == 24 + 21


def test_predicted_vram_within_3_percent_or_256_mib_of_the_peak(models, h200):
    checked = 0
    for rec in _records():
        w = _worker(models, h200, rec)
        cuda0 = next(m for m in w.memory if m.device == "CUDA0")
        if "--moe-cache-mib" in rec["args"]:
            assert cuda0.cache > 0 and cuda0.total == cuda0.weights + cuda0.kv + cuda0.compute + cuda0.overhead \
                + cuda0.cache
        assert abs(cuda0.total - rec["vram_peak"]) <= max(0.03 * rec["vram_peak"], 256 * MiB), \
            (rec["run"], rec["config"], cuda0.total / MiB, rec["vram_peak"] / MiB)
        checked += 1
    assert checked == 31 + 31


def test_the_planner_still_makes_the_plans_that_ran(models, h200):
    """Planned again here with the run's bandwidth and its model's profile, each budget and locality gives the
    split between whole expert layers and cache that the H200 ran (the rows of docs/benchmarks.md describe it).
    The micro-batch is the run's: these runs predate the rule that weighs a long prompt's time against generation
    (candidates.choose), and the split is what is checked here."""
    for run, (bench, plan) in _runs().items():
        ran = plan["workers"][0]
        model, locality = _model_and_locality(plan)
        rec = {"budget": bench["vram_budget"], "bandwidth": bench["plan_context"]["bandwidth"]}
        argv = ran["argv"]
        req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=rec["budget"], vram_reserve=256 * MiB),),
                          ubatch=int(argv[argv.index("-ub") + 1]))
        w = make_plan(machines={"h200": _machine(h200, rec)}, model=_shape(models, model), request=req,
                      backend=_cached_backend(), routing=_curve(locality, model)).workers[0]
        if run in BOUNDARY_TIES:
            # the choice here and the one that ran: both at the objective's edge, within its tolerance of each other
            ran_here = _worker(models, h200, {**rec, "args": ran["argv"], "model": model, "locality": locality,
                                              "cpu_misses": False})
            assert ran_here.predicted.tg == pytest.approx(w.predicted.tg, rel=X.GENERATION_TOLERANCE), run
            assert abs(len(w.cpu_expert_layers) - len(ran["cpu_expert_layers"])) <= 2, run
            continue
        assert list(w.cpu_expert_layers) == ran["cpu_expert_layers"], run
        ran_mib = WorkerSettings.from_dict(ran["settings"]).expert_cache_mib    # recorded under the older names
        assert w.settings.expert_cache_mib == pytest.approx(ran_mib, rel=0.05), run


def _plan(models, h200, budget_gib, curve, **kw):
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=budget_gib * GiB, vram_reserve=256 * MiB),), **kw)
    return make_plan(machines={"h200": with_gpu_free(h200, budget_gib * GiB)}, model=models("qwen3-30b-a3b"),
                     request=req, backend=_cached_backend(), routing=curve).workers[0]


@pytest.mark.parametrize("budget", [8, 12, 16])
def test_the_plan_chooses_a_cache_with_locality_and_none_without(models, h200, budget):
    local = _plan(models, h200, budget, _curve("default"))
    flat = _plan(models, h200, budget, _curve("loc0"))
    assert local.expert_cache.use_cache and local.settings.expert_cache_mib > 0
    assert "--moe-cache-mib" in local.args
    # the no-cache candidate predicts exactly what the plan without a cache predicts
    assert not flat.expert_cache.use_cache and flat.settings.expert_cache_mib == 0
    assert "--moe-cache-mib" not in flat.args
    same_ub = _plan(models, h200, budget, _curve("default"), expert_cache_bytes=0, ubatch=local.n_ubatch)
    assert local.expert_cache.no_cache.tokens_per_s == pytest.approx(same_ub.predicted.tg, rel=1e-9)
    # measured at 12 GiB: 1.92x (143.5 t/s with the cache against 74.7 for the locality-0 plan without one)
    assert local.predicted.tg > 1.3 * flat.predicted.tg
    assert any(d.what == "expert cache" and d.value == "off" for d in flat.decisions)
    # the cache and the whole layers fit the same budget as the plan without a cache
    mem = next(m for m in local.memory if m.device == "CUDA0")
    assert mem.total <= mem.budget
    assert mem.cache > 0


def test_objective_prompt_and_off_keep_whole_layers(models, h200):
    gen = _plan(models, h200, 12, _curve("default"))
    prompt = _plan(models, h200, 12, _curve("default"), objective="prompt")
    off = _plan(models, h200, 12, _curve("default"), expert_cache_bytes=0)
    assert not prompt.expert_cache.use_cache and off.expert_cache is None
    off_same_ub = _plan(models, h200, 12, _curve("default"), expert_cache_bytes=0, ubatch=prompt.n_ubatch)
    assert prompt.cpu_expert_layers == off_same_ub.cpu_expert_layers
    assert len(off.cpu_expert_layers) < len(gen.cpu_expert_layers)
    assert prompt.predicted.pp[4096] >= gen.predicted.pp[4096]
    assert prompt.n_ubatch >= gen.n_ubatch
    sized = _plan(models, h200, 12, _curve("default"), expert_cache_bytes=2048 * MiB)
    assert sized.settings.expert_cache_mib == 2048


def test_many_slots_widen_the_batch_the_cache_serves(models, h200):
    """Every busy slot adds a token to a generation batch: with 16 slots the cache serves batches of 16 (a cache
    the topology sets: for sixteen streams' aggregate the plan itself would take none at 12 GiB, since a batch of
    16 tokens needs banks of 128 slots)."""
    one = _plan(models, h200, 12, _curve("default"))
    auto = _plan(models, h200, 12, _curve("default"), parallel=16)
    assert not auto.expert_cache.use_cache and "16 streams" in auto.expert_cache.reason
    many = _plan(models, h200, 12, _curve("default"), parallel=16, expert_cache_bytes=2048 * MiB)
    assert one.settings.expert_cache_max_batch is None and "--moe-cache-max-batch" not in one.args
    assert many.settings.expert_cache_max_batch == 16
    assert many.args[many.args.index("--moe-cache-max-batch") + 1] == "16"


def test_the_default_curve_is_said(models, h200):
    w = _plan(models, h200, 12, None)
    d = next(d for d in w.decisions if d.what == "expert cache")
    assert "default" in d.why and w.expert_cache.curve_source.startswith("default")


def _resolve(model, **over):
    from orchestrator.resolve import nominal_backend, resolve

    return resolve(ROOT / "topologies" / "h200.yaml",
                   overrides={"model.path": model.paths[0], "nodes.0.machine": str(FIX / "machines" /
                                                                                    "h200.inspect.json"), **over},
                   backend=nominal_backend("mainline", cuda=True))


def test_plan_reads_the_cached_routing_profile_and_prints_the_arithmetic(models, tmp_path, monkeypatch):
    """`orchestrator plan` end to end on the recorded H200 at 12 GiB: the routing profile cached beside the
    model (as `orchestrator model M --routing` leaves it) decides; none cached: the default curve, said."""
    from orchestrator.commands.plan import plan_document, render_text
    from orchestrator.model.routing import profile_path

    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path))
    model = models("qwen3-30b-a3b")
    res = _resolve(model)
    text = render_text(res)
    assert "hit-rate curve: default" in text and "predicted hit rate" in text and "expert cache" in text
    doc = plan_document(res)["workers"][0]
    assert doc["expert_cache"]["use_cache"] and "--moe-cache-mib" in doc["argv"]
    # the memory line shows the cache in MiB, as the flag, the decision and the document do
    assert f", expert cache {doc['memory'][0]['cache'] / MiB:.1f} MiB)" in text
    assert doc["memory"][0]["cache"] > 0 and doc["settings"]["expert_cache_mib"] == doc["expert_cache"]["chosen"][
        "cache_mib"]

    def cache_profile(locality):
        doc = _profile(locality).to_json()
        p = profile_path(model.paths[0])
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"model": model.paths[0], "settings": {},
                                 "profile": {**doc, "source": f"measured {locality}"}}))

    cache_profile("loc0")
    flat = plan_document(_resolve(model))["workers"][0]
    assert not flat["expert_cache"]["use_cache"] and "--moe-cache-mib" not in flat["argv"]
    assert flat["expert_cache"]["curve_source"] == "measured loc0"
    cache_profile("default")
    local = plan_document(_resolve(model))["workers"][0]
    assert local["expert_cache"]["use_cache"] and local["expert_cache"]["curve_source"] == "measured default"
    off = plan_document(_resolve(model, **{"workers.expert_cache": "off"}))["workers"][0]
    assert "--moe-cache-mib" not in off["argv"] and "expert_cache" not in off
    sized = plan_document(_resolve(model, **{"workers.expert_cache": "1GiB"}))["workers"][0]
    assert sized["settings"]["expert_cache_mib"] == 1024


def _plan_with(models, h200, budget_gib, curve, backend, **kw):
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=budget_gib * GiB, vram_reserve=256 * MiB),), **kw)
    return make_plan(machines={"h200": with_gpu_free(h200, budget_gib * GiB)}, model=models("qwen3-30b-a3b"),
                     request=req, backend=backend, routing=curve).workers[0]


def test_misses_on_the_cpu_when_asked_for_and_when_predicted_faster(models, h200):
    cached = _cached_backend()
    both = cached.__class__(**{**cached.__dict__, "features": cached.features | {"expert_cache_cpu_misses"}})
    curve = _curve("default")
    upload = _plan_with(models, h200, 8, curve, both)                        # the default: upload
    assert upload.expert_cache.chosen.miss_mode == "upload" and "--moe-cache-cpu-misses" not in upload.args
    # at 8 GiB a cache with CPU misses still beats none (measured 74.0 against 35.5 t/s), so asked for, it is taken
    cpu = _plan_with(models, h200, 8, curve, both, expert_cache_misses="cpu")
    assert cpu.expert_cache.use_cache and cpu.expert_cache.chosen.miss_mode == "cpu"
    assert cpu.settings.expert_cache_cpu_misses and "--moe-cache-cpu-misses" in cpu.args
    chosen = cpu.expert_cache.chosen                         # the shares replayed on the recorded trace
    hit, up = curve.cpu_misses.at(chosen.fraction)
    assert chosen.hit_rate == pytest.approx(hit) and chosen.host_read_bytes > 0
    assert chosen.pcie_bytes == pytest.approx(up / hit * chosen.cache_hit_bytes)     # the re-used misses
    assert cpu.predicted.tg < 0.8 * upload.predicted.tg                  # measured 0.67x
    # a binary without the option: uploads, and the plan says why
    older = _plan_with(models, h200, 8, curve, cached, expert_cache_misses="cpu")
    assert older.expert_cache.chosen.miss_mode == "upload" and "--moe-cache-cpu-misses" not in older.args
    assert any("no --moe-cache-cpu-misses" in d.why for d in older.decisions if d.what == "expert cache")
    # auto: whichever mode predicts the faster generation (within the objective's 3%); on the H200's PCIe Gen5
    # link that is uploading, at every budget and locality measured (CPU misses ran at 0.67-0.80x)
    for budget in (8, 12, 16):
        for loc in LOCALITIES:
            c = _curve(loc)
            auto = _plan_with(models, h200, budget, c, both, expert_cache_misses="auto")
            best = max(_plan_with(models, h200, budget, c, both, expert_cache_misses=m).predicted.tg
                       for m in ("upload", "cpu"))
            assert auto.predicted.tg >= 0.97 * best
            assert "--moe-cache-cpu-misses" not in auto.args and auto.expert_cache.chosen.miss_mode != "cpu"
