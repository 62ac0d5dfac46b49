"""The expert cache split across GPUs, planned on the recorded two-H200 machine (tests/fixtures/machines/h200x2.*)
and on the described 2-socket x 8-GPU server.

W2 = the Qwen3-235B-A22B shape cut to 24 layers (q4_0) at 2 x 12 GiB, W1 = Qwen3-30B-A3B (q4_0) at 2 x 6 GiB, with
the stated default hit-rate curve and with the curve of the recorded default-locality trace (tests/fixtures/routing).
The checks read the plan's argv the way llama.cpp and our patch (native/llama.cpp-patches/0001-expert-cache.patch)
do, independently of the planner's code: ``-ts`` counts -> the GPU of each layer (llama-model.cpp's upper_bound
rule), ``-ot`` -> the host-resident expert tensors (first matching pattern wins), ``--moe-cache-mib`` -> one slot
count for every bank (MiB / one expert of every host-resident expert tensor, at most the experts a tensor has),
each bank on the GPU of its layer; and llama-context.cpp's condition for pipeline parallelism (several graph
copies), under which the patch turns the cache off.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from planfixtures import backend, machine, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.model.info import TensorClass
from orchestrator.model.routing_profile import parse_trace, profile
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan.costs import model_costs
from orchestrator.units import fmt_bytes

FIX = Path(__file__).resolve().parents[1] / "fixtures"
GiB, MiB = 1 << 30, 1 << 20
CASES = [("w2", "qwen3-235b-a22b", 24, 12), ("w1", "qwen3-30b-a3b", None, 6)]


@pytest.fixture(scope="module")
def x2():
    return load_machine(FIX / "machines" / "h200x2.tar.gz")


def _trace_curve():
    trace = parse_trace((FIX / "routing" / "demo-locality-default.trace").read_bytes())
    return profile(trace, "synth-model --locality default").curve("lru-layer")


def _arg(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def layer_devices(ts: str, n_layers: int) -> list[int]:
    """llama-model.cpp: with every layer offloaded, layer il (the output layer is il = n_layers) goes to the first
    device whose cumulative -ts share (float) exceeds il / (n_layers + 1)."""
    parts = np.asarray([float(x) for x in ts.split(",")], dtype=np.float32)
    splits = np.cumsum(parts, dtype=np.float32) / np.float32(parts.sum())
    act = n_layers + 1
    return [int(np.searchsorted(splits, np.float32(il) / np.float32(act), side="right")) for il in range(act)]


def host_expert_tensors(model, ot: str | None):
    """The routed-expert tensors an -ot value sends to host memory (llama.cpp: the first matching pattern wins)."""
    pairs = [p.rsplit("=", 1) for p in ot.split(",")] if ot else []
    out = []
    for t in model.tensors:
        if t.cls is not TensorClass.ROUTED_EXPERT:
            continue
        buft = next((b for rx, b in pairs if re.search(rx, t.name)), None)
        if buft == "CPU":
            out.append(t)
    return out


def pipeline_parallel(args, n_gpus: int, n_layers: int) -> bool:
    """llama-context.cpp: several devices, more GPU layers than the model has (the output layer too), -sm layer,
    the KV cache offloaded and no tensor override."""
    ngl = _arg(args, "-ngl")
    offloaded = ngl in ("all", "auto") or (ngl is not None and ngl.isdigit() and int(ngl) > n_layers)
    overrides = any(f in args for f in ("-ot", "--override-tensor", "--cpu-moe", "-cmoe", "--n-cpu-moe", "-ncmoe"))
    return (n_gpus > 1 and offloaded and _arg(args, "-sm") in (None, "layer")
            and not any(f in args for f in ("-nkvo", "--no-kv-offload")) and not overrides)


def patch_banks(model, args, n_gpus: int):
    """What the patch allocates per GPU for this argv: (slots per bank, raw slot bytes per GPU, tensors per GPU)."""
    mib = int(_arg(args, "--moe-cache-mib") or 0)
    dev = layer_devices(_arg(args, "-ts"), model.n_layers)
    host = host_expert_tensors(model, _arg(args, "-ot"))
    per_slot = sum(t.bytes // t.shape[2] for t in host)
    slots = min(mib * MiB // per_slot, min(t.shape[2] for t in host))
    raw, count = [0] * n_gpus, [0] * n_gpus
    for t in host:
        raw[dev[t.layer]] += slots * (t.bytes // t.shape[2])
        count[dev[t.layer]] += 1
    return slots, raw, count


def check_cache_plan(w, model, n_gpus: int):
    """The plan's per-GPU cache equals what the patch allocates for its argv; every GPU within its budget; no
    pipeline parallelism to turn the cache off; the per-GPU arithmetic adds up to the chosen candidate's."""
    args = list(w.args)
    assert _arg(args, "-sm") == "layer" and _arg(args, "--moe-cache-mib")
    assert not pipeline_parallel(args, n_gpus, model.n_layers)
    slots, raw, count = patch_banks(model, args, n_gpus)
    cp = w.expert_cache
    assert slots == cp.chosen.slots_per_layer >= model.n_expert_used
    gpu_mem = [m for m in w.memory if m.device.startswith("CUDA")]
    assert len(gpu_mem) == n_gpus
    for g, m in enumerate(gpu_mem):
        # the bank tensors plus their id buffers and alignment: a few KiB per tensor beyond the slots
        assert 0 <= m.cache - raw[g] <= count[g] * 4096, (m.device, m.cache, raw[g])
        assert m.total <= m.budget, (m.device, m.total / GiB, m.budget / GiB)
    assert sum(raw) <= int(_arg(args, "--moe-cache-mib")) * MiB
    shares = cp.per_gpu
    assert [s.device for s in shares] == [m.device for m in gpu_mem]
    for s, m, n in zip(shares, gpu_mem, count):
        assert s.cache_bytes == m.cache and s.host_layers * 3 == n
        assert s.slots_per_layer == (slots if n else 0) and s.slots == s.slots_per_layer * s.host_layers
    assert sum(s.hit_bytes for s in shares) == pytest.approx(cp.chosen.cache_hit_bytes)
    assert sum(s.pcie_bytes for s in shares) == pytest.approx(cp.chosen.pcie_bytes)
    assert sum(s.whole_layers for s in shares) == cp.chosen.gpu_layers
    text = "\n".join(cp.arithmetic())
    for s in shares:
        assert f"{s.device}: {s.whole_layers} whole expert layers, {s.host_layers} host-resident x " \
               f"{s.slots_per_layer} slots = {s.slots} experts = {s.cache_bytes / MiB:.1f} MiB" in text
    doc = json.loads(json.dumps(w.to_dict()))
    assert [g["cache_mib"] for g in doc["expert_cache"]["per_gpu"]] == [round(m.cache / MiB, 1) for m in gpu_mem]
    assert [g["slots"] for g in doc["expert_cache"]["per_gpu"]] == [s.slots for s in shares]


@pytest.mark.parametrize("curve", ["default", "trace"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_h200s_split_the_cache_by_the_layers_they_run(models, x2, case, curve):
    _name, like, layers, gib = case
    model = models(like, layers=layers)
    budget = gib * GiB
    req = PlanRequest(nodes=(NodeRequest(name="x2", vram_limit=budget, vram_reserve=256 * MiB),))
    routing = _trace_curve() if curve == "trace" else None
    plan = make_plan(machines={"x2": with_gpu_free(x2, budget)}, model=model, request=req,
                     backend=_cached_backend(), routing=routing)
    w = plan.workers[0]
    assert w.expert_cache.use_cache
    check_cache_plan(w, model, 2)
    off = make_plan(machines={"x2": with_gpu_free(x2, budget)}, model=model, request=req.copy(expert_cache_bytes=0),
                    backend=_cached_backend(), routing=routing).workers[0]
    assert w.predicted.tg > off.predicted.tg
    # bytes per token by device: each GPU reads its own banks, and the layers moved to the cache no longer as
    # whole layers (the same -ts as without a cache)
    assert _arg(w.args, "-ts") == _arg(off.args, "-ts")
    costs = model_costs(model)
    pick = costs.n_expert_used * max(costs.layer_experts) / costs.n_expert
    with_cache, without = w.predicted.tg_bytes_per_token, off.predicted.tg_bytes_per_token
    dev0 = layer_devices(_arg(w.args, "-ts"), model.n_layers)
    for g, share in enumerate(w.expert_cache.per_gpu):
        moved = sum(1 for i in set(w.cpu_expert_layers) - set(off.cpu_expert_layers) if dev0[i] == g)
        assert with_cache[share.device] - share.hit_bytes - share.pcie_bytes == \
            pytest.approx(without[share.device] - moved * pick, rel=1e-6, abs=2), share.device
    # the load mode's reason counts what the cache left in host memory
    host_weights = next(m.weights for m in w.memory if m.device == "CPU")
    assert f"CPU-resident weights ({fmt_bytes(host_weights)})" in next(d.why for d in w.decisions
                                                                        if d.what == "load mode")
    # each GPU's host-resident layers are the first of its range, as the placement without a cache has them
    dev = layer_devices(_arg(w.args, "-ts"), model.n_layers)
    for g in (0, 1):
        mine = [i for i in range(model.n_layers) if dev[i] == g]
        host = [i for i in mine if i in w.cpu_expert_layers]
        assert host == mine[:len(host)]


@pytest.mark.parametrize("gib,with_banks,ub", [(12, 7, 1024), (16, 1, 512)])
def test_the_eight_gpu_server_splits_the_cache_by_layers(models, gib, with_banks, ub):
    """The described 2-socket x 8-GPU server, Qwen3-235B-A22B q4_0 (q8_0 KV, 32k context): one -sm layer worker
    over eight GPUs. At 12 GiB per GPU most GPUs run host-resident layers and hold their banks; at 16 GiB only the
    last GPU's layers overflow to host memory, so it alone holds the cache (at micro-batches fixed here: a bigger
    one's compute buffer moves more layers to host memory)."""
    m = machine("2socket-8gpu")
    model = models("qwen3-235b-a22b")
    req = PlanRequest(context=32768, nodes=(NodeRequest(name="server", vram_limit=gib * GiB),),
                      type_k="q8_0", type_v="q8_0", ubatch=ub)
    w = make_plan(machines={"server": with_gpu_free(m, gib * GiB)}, model=model, request=req,
                  backend=_cached_backend()).workers[0]
    assert len(w.gpus) == 8 and w.expert_cache.use_cache
    check_cache_plan(w, model, 8)
    assert sum(1 for s in w.expert_cache.per_gpu if s.cache_bytes) == with_banks


def test_pipeline_parallelism_is_what_llama_cpp_turns_on_without_overrides():
    """The rule the checks use: on for a plain -sm layer argv over several GPUs, off with -ot, -ncmoe, -nkvo,
    partial offload or one GPU."""
    plain = ["-ngl", "999", "-sm", "layer", "-ts", "12,13"]
    assert pipeline_parallel(plain, 2, 24)
    assert not pipeline_parallel(plain + ["-ot", "blk\\.(0)\\.ffn_up_exps=CPU"], 2, 24)
    assert not pipeline_parallel(plain + ["-ncmoe", "3"], 2, 24)
    assert not pipeline_parallel(plain + ["-nkvo"], 2, 24)
    assert not pipeline_parallel(["-ngl", "24", "-sm", "layer"], 2, 24)
    assert not pipeline_parallel(plain, 1, 24)
    assert layer_devices("12,13", 24) == [0] * 12 + [1] * 13
    assert layer_devices("1,1", 3) == [0, 0, 1, 1]


def _cached_backend():
    b = backend("mainline")
    return b.__class__(**{**b.__dict__, "features": b.features | {"expert_cache"}})


def test_plan_prints_each_gpus_share_with_a_cached_profile(models, tmp_path, monkeypatch):
    """`orchestrator plan` on a topology naming the recorded machine, W1 under 6 GiB per GPU, with the model's
    routing profile cached (the default-locality trace, as `orchestrator model MODEL --routing` stores it): the
    text shows each GPU's banks and hit arithmetic under the measured curve, and --json carries the same numbers."""
    from orchestrator.commands.plan import plan_document, render_text
    from orchestrator.model.routing import profile_path
    from orchestrator.resolve import resolve

    model = models("qwen3-30b-a3b")
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    trace = parse_trace((FIX / "routing" / "demo-locality-default.trace").read_bytes())
    prof = profile(trace, "synth-model --locality default")
    path = profile_path(model.paths[0])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"model": model.paths[0], "settings": {}, "profile": prof.to_json()}))
    topo = tmp_path / "x2.yaml"
    topo.write_text(f"model: {{path: {model.paths[0]}, context: 8192}}\n"
                    f"nodes:\n  - {{name: x2, machine: {FIX / 'machines' / 'h200x2.tar.gz'}, vram_limit: 6GiB, "
                    f"vram_reserve: 256MiB}}\n")
    res = resolve(topo, backend=_cached_backend())
    w = res.plan.workers[0]
    assert w.expert_cache.curve_source == "synth-model --locality default"
    check_cache_plan(w, model, 2)
    text = render_text(res)
    assert "hit-rate curve: synth-model --locality default" in text
    for s in w.expert_cache.per_gpu:
        assert f"  {s.device}: {s.whole_layers} whole expert layers, {s.host_layers} host-resident x " \
               f"{s.slots_per_layer} slots" in text
    doc = json.loads(json.dumps(plan_document(res)))
    per_gpu = doc["workers"][0]["expert_cache"]["per_gpu"]
    assert [g["device"] for g in per_gpu] == ["CUDA0", "CUDA1"]
    assert [g["cache_mib"] for g in per_gpu] == [round(s.cache_bytes / MiB, 1) for s in w.expert_cache.per_gpu]
    assert {g["slots_per_layer"] for g in per_gpu if g["host_layers"]} == {w.expert_cache.chosen.slots_per_layer}


def test_small_experts_get_no_more_slots_than_the_room_holds():
    """--moe-cache-mib is whole MiB: where all host layers' experts of one slot take less than a MiB, rounding the
    cache up to a MiB would give every bank more slots than the split counted, past the GPU's room. Each split's
    MiB, read as our patch reads it, must fit every GPU."""
    from types import SimpleNamespace

    from orchestrator.plan.cache_choice import layer_split_cache_splits as _layer_split_cache_splits

    e, n_expert, n_layers = 4096, 128, 8                     # 4 KiB experts: 8 layers x one slot = 32 KiB
    L = e * n_expert
    costs = SimpleNamespace(n_expert=n_expert, n_expert_used=8, layer_experts=[L] * n_layers,
                            moe_layers=tuple(range(n_layers)), layer_expert_side_bytes=())
    room = [3 * L + 100 * 1024, 2 * L + 300 * 1024]          # per GPU: bytes for experts (whole layers + banks)
    placement = SimpleNamespace(layer_gpu=(0,) * 4 + (1,) * 4, gpu_weights=(3 * L, 2 * L), gpu_kv=(0, 0))
    best = SimpleNamespace(placement=placement, budgets=(SimpleNamespace(budget=room[0]),
                                                         SimpleNamespace(budget=room[1])))
    host = [3, 6, 7]
    splits, hosts = _layer_split_cache_splits(costs, best, list(range(n_layers)), host, L, 0)
    assert splits
    for keep, size in splits:
        new_host = hosts[(keep, size)]
        slots = min(size // (len(new_host) * e), n_expert)      # the patch's slot count for this MiB
        for g in (0, 1):
            mine = [i for i in range(n_layers) if placement.layer_gpu[i] == g]
            h = sum(1 for i in mine if i in new_host)
            assert (len(mine) - h) * L + h * slots * e <= room[g], (keep, size, g, slots)


def test_a_tensor_split_gets_no_cache(models, x2):
    """-sm tensor spreads every layer over both GPUs, so no GPU runs a layer's experts alone: set by the topology
    with experts in host memory, the plan renders no cache and says why."""
    model = models("qwen3-235b-a22b", layers=24)
    req = PlanRequest(nodes=(NodeRequest(name="x2", vram_limit=12 * GiB, vram_reserve=256 * MiB),),
                      split_mode="tensor")
    w = make_plan(machines={"x2": with_gpu_free(x2, 12 * GiB)}, model=model, request=req,
                  backend=_cached_backend()).workers[0]
    assert _arg(w.args, "-sm") == "tensor" and w.cpu_expert_layers
    assert "--moe-cache-mib" not in w.args and w.expert_cache is None
    assert all(m.cache == 0 for m in w.memory)
    why = next(d for d in w.decisions if d.what == "expert cache")
    assert why.value == "off" and "-sm tensor" in why.why
