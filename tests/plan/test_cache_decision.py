"""The expert cache of one worker is decided by one pure step, decide_expert_cache: a small context and one
candidate in, one result out that holds everything the worker runs with and the one line the plan prints for it.

The worker is W1 (Qwen3-30B-A3B q4_0) on the recorded H200 at a 12 GiB budget, its 30 expert layers in host memory
and a 3362 MiB cache beside them, planned by a backend with the cache, its device slots and prompts' staging."""

from __future__ import annotations

import dataclasses

import pytest
from planfixtures import FIX, backend, with_gpu_free

from orchestrator.hardware.dump import load_machine
from orchestrator.model.routing_profile import default_curve
from orchestrator.plan import NodeRequest, PlanRequest, make_plan
from orchestrator.plan.cache_choice import CacheContext, decide_expert_cache
from orchestrator.plan.candidates import evaluate, kv_layers
from orchestrator.plan.planning_context import PlanningContext
from orchestrator.plan.costs import model_costs
from orchestrator.plan.cpu import CpuWants, choose_cpu

GiB, MiB = 1 << 30, 1 << 20
FEATURES = {"expert_cache", "expert_cache_slot_reads", "expert_cache_slots", "expert_cache_staging"}
BUDGET = 12 * GiB


@pytest.fixture(scope="module")
def h200():
    return with_gpu_free(load_machine(FIX / "machines" / "h200.inspect.json"), BUDGET)


def _request(**kw) -> PlanRequest:
    fixed = dict(expert_layers_on_cpu=tuple(range(30)), expert_cache_bytes=3362 * MiB, ubatch=2048, objective="prompt")
    return PlanRequest(nodes=(NodeRequest(name="h200", vram_limit=BUDGET, vram_reserve=256 * MiB),),
                       **{**fixed, **kw})


def _inputs(models, h200, **kw):
    """The step's inputs as the planner builds them: the context, and the candidate of the request's micro-batch."""
    model, req = models("qwen3-30b-a3b"), _request(**kw)
    back = dataclasses.replace(backend("mainline"), features=backend("mainline").features | FEATURES)
    node_req = req.nodes[0].for_machine(h200.memory_total_bytes)
    ctx = PlanningContext(machine=h200, model=model, costs=model_costs(model), req=req, node_req=node_req, backend=back,
                      curve=default_curve(model.n_expert, model.n_expert_used, model.arch), fa="on")
    gpus = list(h200.gpus[:1])
    cpu = choose_cpu(h200, host_bytes=ctx.costs.total_bytes, ram_reserve=node_req.ram_reserve,
                     anchor_node=h200.nearest_cpu_node(gpus[0]), package=None, share=None,
                     wants=CpuWants(req.numa, req.smt, req.threads, req.threads_batch))
    cand = evaluate(ctx, gpus, kv_layers(model, req, ctx.flavor, ub=2048, fa="on"), mode="none", ub=2048,
                    load_mode="pinned", cpu=cpu)
    return CacheContext(plan=ctx, gpus=tuple(gpus), load_mode="pinned", cpu=cpu, split_mode="none"), cand, back


def test_one_result_holds_what_the_worker_runs_with(models, h200):
    cc, cand, _back = _inputs(models, h200)
    got = decide_expert_cache(cc, cand)
    assert got == decide_expert_cache(cc, cand)             # pure: the same inputs, the same decision
    c = got.plan.chosen
    assert got.cache_mib == c.cache_mib == 3362 and got.decision.value == "3362 MiB"
    assert got.stage_buffers == c.stage_buffers == 2 and "prompts staged: 2 buffers" in got.decision.why
    assert got.slot_assignment == ("device" if c.device_slots else "host") and got.max_batch is None
    assert len(got.bank_bytes) == 1 and got.bank_bytes[0] >= c.stage_bytes > 0      # the buffers sit on the first GPU
    assert got.candidate.tg == c.tokens_per_s and got.candidate.pp != cand.pp    # predicted with the cache
    assert got.decision.why.startswith(got.plan.reason)     # one line: the split's reason, then the steps' notes


def test_the_planner_runs_the_decision_as_it_stands(models, h200):
    cc, cand, back = _inputs(models, h200)
    got = decide_expert_cache(cc, cand)
    w = make_plan(machines={"h200": h200}, model=cc.plan.model, request=cc.plan.req, backend=back).workers[0]
    s = w.settings
    assert (s.expert_cache_mib, s.expert_cache_stage_buffers, s.expert_cache_slots == "device") == \
        (got.cache_mib, got.stage_buffers, got.slot_assignment == "device")
    assert next(d for d in w.decisions if d.what == "expert cache") == got.decision
    assert w.memory[0].cache == got.bank_bytes[0] and w.expert_cache == got.plan


def test_a_cache_the_topology_turns_off_leaves_the_candidate_as_it_was(models, h200):
    cc, cand, _back = _inputs(models, h200, expert_cache_bytes=0)
    got = decide_expert_cache(cc, cand)
    assert got.candidate is cand and got.plan is None and got.bank_bytes == ()
    assert (got.cache_mib, got.stage_buffers, got.slot_assignment) == (0, 0, "host")
    assert (got.decision.value, got.decision.why) == ("off", "set by the topology")
