"""A two-GPU plan run end to end on two ggml-rpc-server devices (tests/multigpu/rpc_devices.py).

The plan is made for a described machine with two GPUs of a small stand-in VRAM each, and its llama-server argv
is run as it is against two local RPC servers, which llama.cpp splits over as over CUDA0 and CUDA1. Checked:

- ``-sm layer`` with the plan's ``-ts``: llama.cpp puts every layer on the device the plan says (its KV cache
  log), and each device's weights and KV cache are the bytes the plan predicts for it; what each server really
  allocated (its resident memory) is within the memory model's tolerance of the plan's per-device total;
- per-device ``-ot`` and the expert cache on both devices: the 64 greedy tokens are those of the one-device plan
  (and of the same two-device plan without the cache), the cache is the size the plan says, and each device
  receives the experts uploaded into its own slots (the bytes on its connection beyond the same run without the
  cache, in proportion to its host-resident layers);
- a plan that cannot fit is refused with the numbers.

The RPC devices compute with the CPU's kernels, so speed is not measured here (docs/multi-gpu.md says what only
two real GPUs show).
"""

from __future__ import annotations

import re

import pytest

from lab.calibrate import within
from orchestrator.backend import devices as D
from orchestrator.errors import PlanError
from tests.multigpu.rpc_devices import STAND_IN, MiB, plan_for, rpc_devices, run_plan

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two(model, llama_server_path):
    return plan_for(model, llama_server_path, 2, STAND_IN)


@pytest.fixture(scope="module")
def one(model, llama_server_path):
    return plan_for(model, llama_server_path, 1, 2 * STAND_IN)


def _arg(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def _without_cache(args):
    a = list(args)
    i = a.index("--moe-cache-mib")
    return a[:i] + a[i + 2:]


@pytest.fixture(scope="module")
def runs(two, one, llama_server_path, rpc_server, tmp_path_factory):
    """The two-device plan with and without its cache, and the one-device plan, each on fresh RPC servers."""
    out = {}
    tmp = tmp_path_factory.mktemp("runs")
    for name, worker, args, n in (("two", two, two.args, 2), ("two-nocache", two, _without_cache(two.args), 2),
                                  ("one", one, one.args, 1)):
        (tmp / name).mkdir()
        with rpc_devices(rpc_server, n, tmp / name) as devs:
            out[name] = run_plan(llama_server_path, args, worker.env, devs, tmp / name, name)
    return out


def test_the_plan_splits_two_devices_with_host_experts_and_a_cache_on_each(two, model):
    """What the other tests rely on: -sm layer over two devices, each with whole expert layers, host-resident
    expert layers and cache banks."""
    args = two.args
    assert _arg(args, "-sm") == "layer" and _arg(args, "-ts") and _arg(args, "--moe-cache-mib")
    gpus = {m.device: m for m in two.memory if D.is_gpu(m.device)}
    assert sorted(gpus) == ["CUDA0", "CUDA1"]
    assert all(m.cache > 0 for m in gpus.values()), two.memory
    host = set(two.cpu_expert_layers)
    for dev in gpus:
        layers = {i for r in two.placement if r.attn == dev for i in range(r.first, r.last + 1)}
        assert layers & host, (dev, two.placement)


def test_layers_go_to_the_devices_the_plan_says(two, runs, model):
    run = runs["two"]
    want = {}
    for r in two.placement:
        for i in range(r.first, r.last + 1):
            want[i] = D.gpu(D.parse(r.attn).index, D.RPC)
    assert run.layer_device == want, (run.layer_device, two.placement, _arg(two.args, "-ts"))
    assert sorted(set(want.values())) == ["RPC0", "RPC1"]


def test_each_device_holds_the_bytes_the_plan_predicts(two, runs):
    run = runs["two"]
    bufs = run.buffers()
    total_cache = 0
    for k, m in enumerate(x for x in two.memory if D.is_gpu(x.device)):
        dev = D.gpu(k, D.RPC)
        b = bufs[dev]
        # llama.cpp logs MiB with two decimals
        assert abs(b["model"] - m.weights) <= 0.01 * MiB, (dev, b, m)
        assert abs(b["kv"] - m.kv) <= 0.01 * MiB, (dev, b, m)
        # the compute buffer: the plan's is CUDA's, with room to copy in a host-resident expert tensor on the first
        # GPU; the CPU backend behind RPC needs no more than that
        assert b["compute"] <= m.compute, (dev, b, m)
        # what the server process itself holds, as NVML's used memory tells it on a GPU (there is no CUDA context
        # here): within the memory model's tolerance of the plan's total, never above it (a buffer's pages count
        # once touched: all weights and KV, the compute buffer and slots as far as they were used)
        held = run.rss_loaded[k] - run.rss_before[k]
        predicted = m.weights + m.kv + m.compute + m.cache
        assert within(predicted, held), (dev, predicted / MiB, held / MiB)
        assert b["model"] + b["kv"] <= held <= predicted + 2 * MiB, (dev, held / MiB, predicted / MiB, b)
        total_cache += m.cache
        print(f"{dev}: weights {b['model'] / MiB:.2f} MiB (plan {m.weights / MiB:.2f}), KV {b['kv'] / MiB:.2f} "
              f"({m.kv / MiB:.2f}), compute {b['compute'] / MiB:.2f} ({m.compute / MiB:.2f}), cache plan "
              f"{m.cache / MiB:.2f}; server holds {held / MiB:.1f} MiB, plan {predicted / MiB:.1f} MiB")
    assert abs(run.cache_bytes() - total_cache) <= 0.1 * MiB, (run.cache_bytes(), total_cache)


def test_tokens_match_the_one_device_plan_and_no_cache(runs, one):
    two, nocache, single = runs["two"], runs["two-nocache"], runs["one"]
    assert len(two.tokens) == 64
    assert two.tokens == single.tokens, (two.tokens, single.tokens)
    assert nocache.tokens == single.tokens


def test_both_devices_upload_into_their_own_slots(two, runs):
    run, base = runs["two"], runs["two-nocache"]
    m = run.metrics
    assert m.get("moe_cache_active") == 1, run.log[-3000:]
    assert m["moe_cache_lookups_total"] == m["moe_cache_hits_total"] + m["moe_cache_misses_total"]
    assert m["moe_cache_misses_total"] > 0 and m["moe_cache_hits_total"] > 0
    assert not base.metrics.get("moe_cache_active")
    uploaded = m["moe_cache_uploaded_bytes_total"]
    host = set(two.cpu_expert_layers)
    per_dev = [sum(1 for r in two.placement if r.attn == d for i in range(r.first, r.last + 1) if i in host)
               for d in ("CUDA0", "CUDA1")]
    extra = [a - b for a, b in zip(run.received, base.received)]
    print(f"uploaded {uploaded / MiB:.1f} MiB; host-resident layers per device {per_dev}; received beyond no "
          f"cache: {[round(x / MiB, 1) for x in extra]} MiB (with {[round(x / MiB, 1) for x in run.received]}, "
          f"without {[round(x / MiB, 1) for x in base.received]})")
    for k, n in enumerate(per_dev):
        share = uploaded * n / sum(per_dev)
        assert extra[k] > 0.5 * share, (k, extra, share)


def test_a_plan_that_cannot_fit_is_refused_with_the_numbers(model, llama_server_path):
    with pytest.raises(PlanError) as e:
        plan_for(model, llama_server_path, 2, 16 * MiB)
    msg = str(e.value)
    m = re.search(r"need ([\d.]+) MiB but the GPUs \[0, 1\] offer (-?[\d.]+) MiB", msg)
    assert m and float(m.group(1)) > float(m.group(2)), msg
    assert "\n" not in msg
