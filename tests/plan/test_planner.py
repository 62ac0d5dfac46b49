"""Planning decisions on real model shapes (full-size headers) and recorded / described machines."""

from __future__ import annotations

import bisect
import dataclasses
import re

import pytest
from planfixtures import backend, machine, with_gpu_free

from orchestrator.errors import PlanError
from orchestrator.hardware.topology import Bandwidth
from orchestrator.model import TensorClass
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.units import fmt_bytes
from orchestrator.plan.costs import model_costs

GiB = 1 << 30


def plan1(m, model, *, limit=None, gpus=None, b=None, **kw):
    req = PlanRequest(nodes=(NodeRequest(name="n", gpus=gpus, vram_limit=limit),), **kw)
    return make_plan(machines={"n": m}, model=model, request=req, backend=b or backend())


def arg(w, flag):
    a = list(w.args)
    return a[a.index(flag) + 1] if flag in a else None


def test_small_enough_model_fits_one_gpu_whole(models):
    q30 = models("qwen3-30b-a3b")
    w = plan1(machine("1socket-1gpu-24g"), q30).workers[0]
    assert "-ot" not in w.args
    assert w.cpu_expert_layers == ()
    assert arg(w, "-ngl") == "999"
    gpu = next(d for d in w.memory if d.device == "CUDA0")
    assert gpu.total <= gpu.budget
    assert "GGML_OP_OFFLOAD_MIN_BATCH" not in w.env


def test_vram_budget_sends_whole_expert_layers_to_host_memory(models):
    q30 = models("qwen3-30b-a3b")
    w = plan1(machine("1socket-1gpu-24g"), q30, limit=12 * GiB).workers[0]
    cpu_layers = set(w.cpu_expert_layers)
    assert cpu_layers, "12 GiB cannot hold 16 GiB of weights"
    ot = arg(w, "-ot")
    pattern, buft = ot.rsplit("=", 1)
    assert buft == "CPU" and "," not in ot
    # llama.cpp applies the pattern with regex_search: it must take exactly the routed experts of those layers
    for t in q30.tensors:
        hit = re.search(pattern, t.name) is not None
        assert hit == (t.cls is TensorClass.ROUTED_EXPERT and t.layer in cpu_layers), t.name
    gpu = next(d for d in w.memory if d.device == "CUDA0")
    assert gpu.total <= 12 * GiB
    assert w.load_mode == "pinned" and arg(w, "--load-mode") == "none"
    assert int(w.env["GGML_OP_OFFLOAD_MIN_BATCH"]) == w.op_offload_min_batch >= 2
    assert w.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert arg(w, "--fit") == "off"  # llama.cpp must not re-fit what the plan decided


def test_smaller_budget_keeps_more_layers_on_the_cpu(models):
    q30 = models("qwen3-30b-a3b")
    m = machine("1socket-1gpu-24g")
    n = [len(plan1(m, q30, limit=g * GiB).workers[0].cpu_expert_layers) for g in (16, 12, 8)]
    assert n[0] < n[1] < n[2]


def test_every_expert_layer_in_vram_is_charged_to_the_budget(models):
    """Predicted GPU memory = the weights the plan put there + KV + compute + overhead, under the budget."""
    q30 = models("qwen3-30b-a3b")
    costs = model_costs(q30)
    w = plan1(machine("1socket-1gpu-24g"), q30, limit=12 * GiB).workers[0]
    gpu = next(d for d in w.memory if d.device == "CUDA0")
    on_gpu = [i for i in costs.moe_layers if i not in w.cpu_expert_layers]
    expect = sum(costs.layer_always) + costs.output_bytes + sum(costs.layer_experts[i] for i in on_gpu)
    assert gpu.weights == expect
    # one more expert layer would not have fitted
    assert gpu.total + costs.layer_experts[w.cpu_expert_layers[-1]] > gpu.budget - 0


def test_context_is_never_shrunk_silently(models):
    q30 = models("qwen3-30b-a3b")
    w = plan1(machine("1socket-1gpu-24g"), q30, context=32768).workers[0]
    assert arg(w, "-c") == "32768"
    with pytest.raises(PlanError, match=r"KV cache for 16777216 tokens .*need [0-9.]+ TiB but the GPUs \[0\] offer [0-9.]+ GiB"):
        plan1(machine("1socket-1gpu-24g"), q30, context=16_777_216)


def test_missing_gpu_index_is_an_error(models):
    with pytest.raises(PlanError, match=r"GPU 3 does not exist .*has 0"):
        plan1(machine("1socket-1gpu-24g"), models("qwen3-30b-a3b"), gpus=(3,))


def _llama_cpp_layer_gpu(ts: list[int], n_layers: int) -> list[int]:
    """llama.cpp's own mapping (src/llama-model.cpp load_tensors): cumulative -ts split points, upper_bound."""
    total = sum(ts)
    splits, acc = [], 0.0
    for x in ts:
        acc += x
        splits.append(acc / total)
    act = n_layers + 1
    return [bisect.bisect_right(splits, il / act) for il in range(n_layers)]


def test_layer_split_ts_reproduces_the_planned_ranges(models):
    ds = models("deepseek-v3")
    w = plan1(machine("2socket-8gpu"), ds).workers[0]
    assert arg(w, "-sm") == "layer"  # mainline refuses -sm tensor for deepseek2
    ts = [int(x) for x in arg(w, "-ts").split(",")]
    mapping = _llama_cpp_layer_gpu(ts, ds.n_layers)
    planned = {}
    for r in w.placement:
        for layer in range(r.first, r.last + 1):
            planned[layer] = int(r.attn.removeprefix("CUDA"))
    assert mapping == [planned[i] for i in range(ds.n_layers)]
    for d in w.memory:
        if d.device.startswith("CUDA"):
            assert d.total <= d.budget, d


def test_split_mode_follows_flavor_and_architecture(models):
    m = machine("2socket-2gpu")
    q235 = models("qwen3-235b-a22b")
    q30 = models("qwen3-30b-a3b")
    fits = plan1(m, q30).workers[0]
    assert arg(fits, "-sm") == "tensor" and not fits.cpu_expert_layers      # mainline, qwen3moe, f16 KV, all in VRAM
    assert arg(plan1(m, q30, type_k="q8_0", type_v="q8_0").workers[0], "-sm") == "layer"
    # experts overflowing to host memory: -sm layer (tensor was measured 7x slower and out of memory on 2 H200s)
    over = plan1(m, q235).workers[0]
    assert over.cpu_expert_layers and arg(over, "-sm") == "layer"
    assert any(d.what == "split mode" and "host memory" in d.why for d in over.decisions)
    assert arg(plan1(m, models("deepseek-v3")).workers[0], "-sm") == "layer"
    ik = plan1(m, q235, b=backend("ik_llama.cpp")).workers[0]
    assert arg(ik, "-sm") == "graph"
    assert "GGML_OP_OFFLOAD_MIN_BATCH" not in ik.env
    assert (arg(ik, "-cuda") or "").startswith("offload-batch-size=") == bool(ik.cpu_expert_layers)
    assert "--load-mode" not in ik.args and ("--no-mmap" in ik.args) == (ik.load_mode == "pinned")


def test_two_h200s_as_recorded_split_by_layer_when_experts_overflow_else_by_tensor(models):
    """The nvidia-h200-x2 machine as `inspect --save` recorded it (tests/fixtures/machines/h200x2.*): the
    235B shape under 12 GiB per GPU overflows to the host -> -sm layer with balanced ranges (what ran there);
    Qwen3-30B-A3B under 24 GiB per GPU fits -> -sm tensor, no -ot."""
    from pathlib import Path

    from orchestrator.hardware.dump import load_machine

    x2 = load_machine(Path(__file__).resolve().parents[1] / "fixtures" / "machines" / "h200x2.tar.gz")
    assert [g.name for g in x2.gpus] == ["NVIDIA H200", "NVIDIA H200"]
    w2 = plan1(with_gpu_free(x2, 12 << 30), models("qwen3-235b-a22b", layers=24), limit=12 << 30).workers[0]
    assert arg(w2, "-sm") == "layer" and w2.cpu_expert_layers and arg(w2, "-ts")
    assert all(d.total <= d.budget for d in w2.memory if d.device.startswith("CUDA"))
    # the load-mode reason names the bytes this placement leaves in host memory, not the planner's first guess
    lm = next(d for d in w2.decisions if d.what == "load mode")
    cpu = next(d for d in w2.memory if d.device == "CPU")
    assert lm.value == "pinned" and f"CPU-resident weights ({fmt_bytes(cpu.weights)})" in lm.why
    w1 = plan1(with_gpu_free(x2, 24 << 30), models("qwen3-30b-a3b"), limit=24 << 30).workers[0]
    assert arg(w1, "-sm") == "tensor" and not w1.cpu_expert_layers and arg(w1, "-ot") is None


def test_load_mode_follows_the_bytes_the_placement_leaves_in_host_memory(models):
    """Pinned only when the placement's host-resident weights + the RAM reserve fit the available memory; checked
    with the final placement, not the planner's first guess (whole expert layers can leave more on the host)."""
    m = machine("1socket-1gpu-24g")
    w = plan1(m, models("qwen3-30b-a3b"), limit=12 * GiB).workers[0]
    host = next(d for d in w.memory if d.device == "CPU")
    # the weights and what sits beside them in host memory (KV cache, compute and output buffers)
    cpu = host.weights + host.kv + host.compute + host.overhead
    assert w.load_mode == "pinned"
    reserve = NodeRequest(name="x").for_machine(m.memory_total_bytes).ram_reserve
    # just below it another micro-batch that leaves less in host memory keeps pinned buffers; far below, none does
    for avail, mode in ((cpu + reserve + (64 << 20), "pinned"), (cpu + reserve - (64 << 20), "pinned"),
                        (cpu + reserve - 4 * GiB, "mmap")):
        tight = dataclasses.replace(m, memory_available_bytes=avail)
        w2 = plan1(tight, models("qwen3-30b-a3b"), limit=12 * GiB).workers[0]
        assert w2.load_mode == mode, (avail, w2.load_mode)
        host2 = next(d for d in w2.memory if d.device == "CPU")
        if mode == "pinned":      # what is pinned fits, buffers and reserve included
            assert host2.weights + host2.kv + host2.compute + host2.overhead + reserve <= avail
        lm = next(d for d in w2.decisions if d.what == "load mode")
        assert f"({fmt_bytes(host2.weights)})" in lm.why


def test_numa_bind_when_it_fits_the_nearest_node_else_interleave_over_the_socket(models):
    m = machine("2socket-2gpu")
    w = plan1(m, models("qwen3-235b-a22b")).workers[0]
    assert w.numa.mode == "bind" and w.numa.mem_nodes == (0,)      # GPU 0 sits on node 0
    assert set(w.numa.cpus) <= set(m.node(0).cpus)
    w8 = plan1(machine("2socket-8gpu"), models("deepseek-v3")).workers[0]
    assert w8.numa.mode == "interleave" and set(w8.numa.mem_nodes) == {0, 1}   # socket of GPU 0
    # llama.cpp's --numa would move threads off the CPUs numactl binds: never passed
    for worker in (w, w8):
        assert "--numa" not in worker.args
        assert next(d for d in worker.decisions if d.what == "llama.cpp --numa").value == "not passed"


def test_cpu_only_two_sockets_of_two_nodes_run_one_replica_per_node(models):
    m = machine("2socket-2gpu")              # 2 sockets x 2 nodes of 32 CPUs, no bandwidth measured
    p = plan1(m, models("qwen3-30b-a3b"), gpus=())
    assert [w.port for w in p.workers] == [8081, 8082, 8083, 8084]
    layout = next(d for d in p.decisions if d.what.startswith("layout"))
    assert layout.value == "node x4"
    # the reason compares the two ways with numbers: one per node against one per socket over its nodes
    assert re.search(r"one replica per NUMA node.*: \d+ GB/s .*vs \d+ GB/s for one replica per socket", layout.why)
    for w, node in zip(p.workers, m.numa_nodes):
        assert arg(w, "-ngl") == "0"
        assert w.numa.mode == "bind" and w.numa.mem_nodes == (node.id,)
        assert w.numa.cpus == node.cpus
        assert int(arg(w, "-t")) == len({c.index for c in m.cores if c.node == node.id})


def test_threads_are_physical_cores_batch_threads_all_hardware_threads(models):
    m = machine("1socket-1gpu-24g")          # 14 cores, 20 threads (6 P-cores with SMT)
    w = plan1(m, models("qwen3-30b-a3b"), limit=12 * GiB).workers[0]
    assert (arg(w, "-t"), arg(w, "-tb")) == ("14", "20")


def test_main_gpu_is_the_one_with_the_best_measured_host_bandwidth(models):
    m = machine("2socket-2gpu")
    bw = Bandwidth(gpu_h2d={(0, 0): 20e9, (1, 2): 26e9}, gpu_d2h={}, host={})
    m = dataclasses.replace(m, bandwidth=bw)
    w = plan1(m, models("qwen3-235b-a22b"), split_mode="layer").workers[0]
    assert arg(w, "-mg") == "1"
    assert w.numa.mem_nodes[0] in (2, 3)       # host memory near the main GPU


def test_model_that_cannot_fit_anywhere_is_refused_with_numbers(models):
    m = with_gpu_free(machine("1socket-1gpu-24g"), 2 * GiB)
    with pytest.raises(PlanError, match=r"GiB"):
        plan1(m, models("deepseek-v3"))


def test_auto_kv_cache_falls_back_to_q8_0_when_f16_does_not_fit(models):
    q30 = models("qwen3-30b-a3b")
    m = machine("1socket-1gpu-24g")
    # 48 layers x 4 KV heads x 128 x 2 (K,V) x 2 bytes = 96 KiB per token: 512k tokens of f16 KV = 48 GiB
    with pytest.raises(PlanError):
        plan1(m, q30, context=524288)
    p = plan1(m, q30, context=524288, kv_auto=True)
    w = p.workers[0]
    assert (arg(w, "-ctk"), arg(w, "-ctv"), arg(w, "-fa")) == ("q8_0", "q8_0", "on")
    assert p.decisions[0].what == "KV cache"


def test_batch_and_gpu_groups_and_never_offload_follow_the_topology(models):
    m = machine("2socket-8gpu")
    q235 = models("qwen3-235b-a22b")
    p = plan1(m, q235, layout="gpu-group", gpu_group_size=2, batch=8192, op_offload_min_batch=1 << 30)
    assert [w.gpus for w in p.workers] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for w in p.workers:
        assert arg(w, "-b") == "8192"
        assert "--no-op-offload" in w.args and "GGML_OP_OFFLOAD_MIN_BATCH" not in w.env
    with pytest.raises(PlanError, match="gpu_group_size: 3 does not divide"):
        plan1(m, q235, layout="gpu-group", gpu_group_size=3)


def test_ik_llama_cpp_plans_with_its_own_kv_layout(models):
    """ik_llama.cpp keeps one unified KV stream: 8000 cells pad to 8192, where mainline gives each of the 3
    sequences its own stream of pad256(8192 / 3) = 2816 cells (8448 in all)."""
    from orchestrator.model.memory import kv_bytes_per_token

    q30 = models("qwen3-30b-a3b")
    m = machine("1socket-1gpu-24g")
    per_cell = kv_bytes_per_token(q30)
    ik = plan1(m, q30, b=backend("ik_llama.cpp"), context=8000, parallel=3)
    main = plan1(m, q30, context=8000, parallel=3)
    assert main.model["kv_bytes"] == 8448 * per_cell
    assert ik.model["kv_bytes"] == 8192 * per_cell


def test_a_request_built_in_code_plans_with_the_reserves_a_topology_gets(models):
    """One place for the defaults: NodeRequest() and a topology's "auto" reserve the same memory (256 MiB per
    GPU; 10% of the machine's RAM, 1-8 GiB), so planner tests plan what users get."""
    from orchestrator.config import parse_topology
    from orchestrator.plan.from_topology import request_from_topology
    from orchestrator.plan.request import default_ram_reserve

    from_yaml = request_from_topology(parse_topology("model: m.gguf\nnodes: [{name: n}]\n")).nodes[0]
    assert from_yaml == NodeRequest(name="n")
    m = machine("1socket-1gpu-24g")
    decided = from_yaml.for_machine(m.memory_total_bytes)
    assert decided.vram_reserve == 256 << 20 and decided.ram_reserve == default_ram_reserve(m.memory_total_bytes)
    assert 1 * GiB <= decided.ram_reserve <= 8 * GiB
    w = plan1(m, models("qwen3-30b-a3b"), limit=12 * GiB).workers[0]
    gpu = next(d for d in w.memory if d.device == "CUDA0")
    assert gpu.budget == 12 * GiB - (256 << 20)


def test_the_micro_batch_is_the_one_with_the_least_time_for_the_workloads_requests():
    """Objective generation: a bigger micro-batch that makes the 4096-token prompt much faster wins over a small
    loss of generation; a big loss of generation does not pay for it; within 1% of the least time the faster
    generation decides."""
    from types import SimpleNamespace as C

    from orchestrator.plan.candidates import REPLY_TOKENS, choose, request_seconds

    def cand(ub, tg, pp4096, pp512=2000.0):
        return C(ubatch=ub, tg=tg, pp={512: pp512, 4096: pp4096})

    small, big = cand(512, 200.0, 1900.0), cand(2048, 180.0, 4900.0)
    assert request_seconds(big) < request_seconds(small) and choose([small, big]) is big
    slow = cand(4096, 60.0, 6600.0)
    assert request_seconds(slow) > request_seconds(small) and choose([small, slow]) is small
    # equal prompts: the faster generation, whatever the micro-batch
    a, b = cand(1024, 150.0, 3000.0), cand(4096, 149.9, 3000.0)
    assert choose([b, a]) is a
    near = cand(4096, 140.0, 3600.0)
    assert abs(request_seconds(near) / request_seconds(a) - 1) < 0.01 and choose([near, a]) is a
    assert request_seconds(a) == pytest.approx((512 / 2000 + 4096 / 3000) / 2 + REPLY_TOKENS / 150.0)
    # the other objectives keep their rules
    assert choose([small, slow], "prompt") is slow


def test_a_deepseek_plan_takes_the_bigger_micro_batch_its_long_prompts_need(models):
    """DeepSeek-V3 (6 layers, 256 experts) on the recorded H200 at 12 GiB: the compute buffer grows with the
    micro-batch, so 512 gives the best generation, but 2048 answers the workload's requests sooner; the decision
    line shows every candidate's time."""
    from pathlib import Path

    from orchestrator.hardware.dump import load_machine

    h200 = load_machine(Path(__file__).resolve().parents[1] / "fixtures" / "machines" / "h200.inspect.json")
    b = backend("mainline")
    b = dataclasses.replace(b, features=b.features | {"expert_cache", "expert_cache_slot_reads"})
    req = PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=12 * GiB, vram_reserve=256 << 20),), context=8192)
    w = make_plan(machines={"h200": with_gpu_free(h200, 12 * GiB)}, model=models("deepseek-v3", layers=6),
                  request=req, backend=b).workers[0]
    d = next(x for x in w.decisions if x.what == "ubatch")
    times = {int(ub): float(s) for ub, s in re.findall(r"ub (\d+): tg [\d.]+ t/s, pp4096 \d+ t/s, ([\d.]+) s", d.why)}
    tgs = {int(ub): float(t) for ub, t in re.findall(r"ub (\d+): tg ([\d.]+) t/s", d.why)}
    assert set(times) == {512, 1024, 2048, 4096}
    assert max(tgs, key=tgs.get) == 512 and arg(w, "-ub") != "512"
    assert times[int(arg(w, "-ub"))] <= min(times.values()) * 1.01
