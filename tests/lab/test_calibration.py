"""Predictions against what real llama-server runs reported (tests/fixtures/calibration/*).

Each fixture directory holds one log per case, xz-compressed (its first line is the exact command) and cases.json (the case
settings and the buffers parsed from the log). The models are regenerated here from the case's spec (sparse
files: only the header matters), read with our reader and predicted with our memory model.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from lab.calibmodels import write_model
from lab.calibrate import Case, grid_spec, predict_case, recorded_by_device, within
from orchestrator.bench.logparse import parse_load_log
from orchestrator.model.memory import compute_buffer_estimate
from orchestrator.model.reader import read_model

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "calibration"
REPO = Path(__file__).resolve().parents[2]
CASE_DIRS = sorted(p.parent for p in FIX.glob("*/cases.json"))
ROWS = [(d.name, row) for d in CASE_DIRS for row in json.loads((d / "cases.json").read_text())]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("calib-models")


def _model(c: Case, model_dir: Path) -> str:
    spec = c.spec()
    path = model_dir / f"{c.preset}-L{c.layers}-X{c.experts}-V{spec.n_vocab}.gguf"
    if not path.exists():
        write_model(str(path), spec)
    return str(path)


def test_fixtures_exist():
    assert CASE_DIRS, "no calibration fixtures"
    cpu = [r for d, r in ROWS if d == "cpu"]
    assert len(cpu) >= 12
    archs = {r["case"]["preset"] for r in cpu}
    assert len(archs) >= 3
    assert {r["case"]["ctx"] for r in cpu} >= {4096, 32768} and {r["case"]["ubatch"] for r in cpu} >= {512, 4096}
    # the mixed CPU/GPU half of the target, run on the H200: experts in host memory, the rest on the GPU
    gpu = [r for d, r in ROWS if d == "gpu" and r["case"]["placement"] == "cpu-moe"]
    assert len(gpu) >= 8 and len({r["case"]["preset"] for r in gpu}) >= 2
    assert {r["case"]["ctx"] for r in gpu} >= {4096, 32768} and {r["case"]["ubatch"] for r in gpu} >= {512, 4096}


GPU_ROWS = [r for d, r in ROWS if d == "gpu" and r.get("nvidia_used_batch")]


@pytest.mark.parametrize("row", GPU_ROWS, ids=[r["case"]["name"] for r in GPU_ROWS])
def test_cuda_overhead_matches_nvidia_smi_after_a_full_batch(row, model_dir):
    """What the GPU really used after loading and one full micro-batch (nvidia-smi minus its value before)
    against the prediction with the CUDA context and pool: the overhead part alone within 64 MiB, the whole
    within the target."""
    c = Case(**row["case"])
    pred = predict_case(c, _model(c, model_dir))["CUDA0"]
    used = row["nvidia_used_batch"][0] - row["nvidia_used_before"][0]
    buffers = recorded_by_device(row)["CUDA0"]["total"]
    assert abs(pred["overhead"] - (used - buffers)) <= 64 << 20, (pred["overhead"] >> 20, (used - buffers) >> 20)
    assert within(pred["total"] + pred["overhead"], used), ((pred["total"] + pred["overhead"]) >> 20, used >> 20)


@pytest.mark.parametrize("where,row", ROWS, ids=[f"{d}/{r['case']['name']}" for d, r in ROWS])
def test_log_is_the_source_of_the_numbers(where, row):
    log = lzma.decompress((FIX / where / f"{row['case']['name']}.log.xz").read_bytes()).decode()
    first = log.splitlines()[0]
    assert first == "# " + " ".join(row["argv"])
    assert row["argv"][0] == "llama-server"
    assert parse_load_log(log).to_json()["by_device"] == recorded_by_device(row)


@pytest.mark.parametrize("where,row", ROWS, ids=[f"{d}/{r['case']['name']}" for d, r in ROWS])
def test_prediction_within_target(where, row, model_dir):
    assert row["loaded"], row["error"]
    c = Case(**row["case"])
    pred = predict_case(c, _model(c, model_dir))
    meas = recorded_by_device(row)
    assert set(pred) == set(meas)
    for dev, m in meas.items():
        p = pred[dev]
        assert within(p["total"], m["total"]), (dev, p, m)
        # the exact parts are exact (to the two decimals of MiB llama.cpp logs, per buffer)
        close = 3 * 10486
        assert abs(p["kv"] - m["kv"]) <= close, (dev, "kv", p, m)
        if dev == "CPU" and c.placement == "cpu":
            assert abs(p["weights"] - m["model"]) <= close, (dev, "weights", p, m)
        # compute buffers of CPU-only runs: within 1 % (the calibrated part)
        if c.placement == "cpu":
            assert abs(p["compute"] - m["compute"]) <= 0.01 * m["compute"] + (1 << 20), (dev, p, m)


GRID = [json.loads(x) for x in lzma.decompress((FIX / "grid" / "grid.jsonl.xz").read_bytes()).decode().splitlines()]


def test_grid_exists():
    assert len(GRID) >= 100
    assert all(r["loaded"] for r in GRID)


@pytest.mark.parametrize("row", GRID, ids=[f"{r['preset']}-{'-'.join(f'{k}{v}' for k, v in r['dims'].items()) or 'real'}-"
                                          f"T{r['ubatch']}-c{r['ctx']}-{'fa' if r['flash_attn'] else 'nofa'}"
                                          for r in GRID])
def test_compute_buffer_on_the_grid(row, model_dir):
    """At the real models' widths the compute buffer is exact (within 1 %); with one width changed it may be
    over-estimated (the allocator's fragmentation is not linear) but never under by more than 2 %."""
    spec = grid_spec(row["preset"], row["dims"])
    tag = "-".join(f"{k}{v}" for k, v in sorted(row["dims"].items())) or "real"
    path = model_dir / f"grid-{row['preset']}-{tag}.gguf"
    if not path.exists():
        write_model(str(path), spec)
    m = read_model(path)
    est = compute_buffer_estimate(m, n_ubatch=row["ubatch"], n_ctx=row["ctx"], flash_attn=row["flash_attn"],
                                  n_batch=max(row["ubatch"], 2048))
    meas = row["compute"]["CPU"]
    err = (est.total - meas) / meas
    if not row["dims"]:
        assert abs(err) < 0.01, err
    else:
        assert -0.02 < err < 0.30, err


# ---- the CPU speed model (lab/cpu_speed.py): llama-bench runs of CPU-only models, and the constants of rates.py

SPEED = sorted((FIX / "cpu").glob("speed-*.json.xz"))
# taken with this VM's cores otherwise idle (load under 1); the others while other work shared them
IDLE_RECORDS = {"speed-devvm-5.json.xz", "speed-devvm-6.json.xz"}
# the H200's CPU (16 cores, 1, 4 and 16 threads): another machine, for its cpu_rate and the thread exponent
H200_CPU = sorted((REPO / "docs" / "benchmarks" / "h200-2026-12-02-cpu-calib").glob("cpu-speed*.json.xz")) + [
    REPO / "docs" / "benchmarks" / "h200-2026-12-04-cpu" / "cpu-speed.json.xz"]


def _speed_points(files=SPEED):
    from lab import cpu_speed

    return cpu_speed.points([cpu_speed.load(p) for p in files])


def test_cpu_speed_records_are_llama_bench_runs():
    from lab import cpu_speed

    assert SPEED, "no CPU speed records"
    for path in SPEED:
        doc = cpu_speed.load(path)
        assert doc["runs"] and doc["host_bw"] and doc["models"]
        for r in doc["runs"]:
            assert r["argv"][0] == "llama-bench" and r["argv"][r["argv"].index("-o") + 1] == "jsonl"
            assert r["argv"][r["argv"].index("-t") + 1] == str(r["threads"]) and r["samples_ts"]
    pts = _speed_points()
    # both regimes: a model far bigger than the caches and small ones whose layers cost more than their bytes
    sizes = {p["model"]["file_bytes"] for p in pts}
    assert max(sizes) > 2 << 30 and min(sizes) < 100 << 20
    assert {p["model"]["n_layers"] for p in pts} >= {6, 12, 24}


def test_cpu_speed_constants_come_out_of_their_runs():
    """Fitted again on the committed runs, the CPU-only constants are the ones in orchestrator/plan/rates.py (to
    their rounding): a change to the data, to the fit or to rates.py shows here."""
    from lab import cpu_speed
    from orchestrator.plan import rates as R

    pts = _speed_points(SPEED + H200_CPU)
    tg = cpu_speed.fit_tg(pts)
    assert tg["CPU_ONLY_TG_EFFICIENCY"] == pytest.approx(R.CPU_ONLY_TG_EFFICIENCY, abs=0.005)
    assert tg["CPU_LAYER_OVERHEAD_S"] == pytest.approx(R.CPU_LAYER_OVERHEAD_S, abs=0.5e-6)
    assert tg["CPU_TOKEN_OVERHEAD_S"] == pytest.approx(R.CPU_TOKEN_OVERHEAD_S, abs=0.5e-6)
    pp = cpu_speed.fit_pp(pts)
    assert pp["CPU_ONLY_PP_FLOPS_FACTOR"] == pytest.approx(R.CPU_ONLY_PP_FLOPS_FACTOR, abs=0.01)
    assert pp["CPU_PP_LAYER_TOKEN_S"] == pytest.approx(R.CPU_PP_LAYER_TOKEN_S, abs=0.5e-6)
    assert pp["CPU_PP_ATTN_MAC_S"] == pytest.approx(R.CPU_PP_ATTN_MAC_S, abs=0.5e-12)
    assert pp["CPU_PP_THREAD_EXPONENT"] == pytest.approx(R.CPU_PP_THREAD_EXPONENT, abs=0.005)


def test_the_probes_reference_is_the_reference_machines_prediction_of_the_probe(tmp_path):
    """CPU_PROBE_REFERENCE_PP is what predict_pp gives for the probe's model (the demo's shape, written as the
    probe writes it) on one core of the reference machine: a machine's cpu_rate is its probe over this."""
    from orchestrator.hardware.probe import CPU_PROBE_PROMPT, CPU_PROBE_SHAPE
    from orchestrator.model.reader import read_model
    from orchestrator.model.synth import write_model
    from orchestrator.plan import rates as R
    from orchestrator.plan.costs import model_costs
    from orchestrator.plan.placement import place_cpu_only
    from orchestrator.plan.predict import SpeedInputs, predict_pp

    like, scale, quant = CPU_PROBE_SHAPE
    write_model(tmp_path / "probe.gguf", like, scale=scale, quant=quant, fsync=False)
    costs = model_costs(read_model(tmp_path / "probe.gguf"))
    sp = SpeedInputs((), (), 1.0, 20e9, R.CPU_REFERENCE_CORE_FLOPS, threads=1, cpu_rate=1.0)
    pred = predict_pp(costs, place_cpu_only(costs, [0] * costs.n_layers), sp, 512, None,
                      lengths=(CPU_PROBE_PROMPT,))[CPU_PROBE_PROMPT]
    assert pred == pytest.approx(R.CPU_PROBE_REFERENCE_PP, rel=0.01)
    assert R.cpu_flops_per_core("AMD EPYC")[0] == R.CPU_REFERENCE_CORE_FLOPS


def test_cpu_prompts_follow_the_prompt_length_on_the_demo_and_the_h200():
    """Predicted / measured (the fastest run) within +-25%: the demo on this VM at one thread, the plan's threads
    per replica (pp512, pp4096 and generation, in each record with prompts of 4096 tokens: both taken on idle
    cores; their own probe points set nothing: the reference rate 1), and W1 on the H200's 16 cores (pp512,
    generation, and pp4096 where recorded) at the H200's cpu_rate from its probe point (the demo model's pp512
    on one core, in the 2026-12-02 record), and every prompt of 512 tokens or more on several threads."""
    from lab import cpu_speed

    pts = cpu_speed.with_rates(_speed_points(SPEED + H200_CPU), cpu_speed.machine_rates(_speed_points(SPEED + H200_CPU)))
    long_sets = {p["set"] for p in pts if p["n_prompt"] == 4096 and p["machine"] == "AMD EPYC"}
    assert len(long_sets) >= 2
    for s in long_sets:
        got = {(f"pp{p['n_prompt']}" if p["n_prompt"] else "tg"): cpu_speed.predict(p) / p["ts"] for p in pts
               if p["set"] == s and p["model"]["name"] == "demo-moe.gguf" and p["threads"] == 1}
        assert set(got) >= {"pp512", "pp4096", "tg"}
        for what in ("pp512", "pp4096", "tg"):
            assert 0.75 <= got[what] <= 1.25, (s, got)
        # the prediction falls with the prompt's length as the measurement does (attention over a longer context)
        assert got["pp4096"] / got["pp512"] == pytest.approx(1.0, abs=0.25)
    w1 = [p for p in pts if p["machine"] != "AMD EPYC" and p["threads"] == 16 and p["model"]["n_layers"] == 48
          and p["n_prompt"] in (0, 512, 4096)]
    assert {p["set"] for p in w1} and len({p["set"] for p in w1}) >= 2
    for p in w1:
        ratio = cpu_speed.predict(p) / p["ts"]
        assert 0.75 <= ratio <= 1.25, (p["set"], p["n_prompt"], ratio)
    # every prompt of 512 tokens or more on several threads (the demo and its 24 layers at 4 and 16 threads, W1 at
    # 16, on both H200 records): the threads' scaling fitted on them holds each within the target
    multi = [p for p in pts if p["threads"] > 1 and p["n_prompt"] >= 512]
    assert len(multi) >= 8 and {p["threads"] for p in multi} >= {4, 16}
    for p in multi:
        ratio = cpu_speed.predict(p) / p["ts"]
        assert 0.75 <= ratio <= 1.25, (p["set"], p["model"]["name"], p["threads"], p["n_prompt"], ratio)


def test_the_threads_exponent_is_not_set_by_w1_or_by_one_record():
    """The threads' exponent fitted without any one record still holds W1's 16-thread prompts on both H200 records
    within +-25%: W1 meets the target through the other records' scaling, not through its own. Without W1's points
    (the demo and its 24 layers only) the exponent stays within 0.035 of the stored one. W1's record of the native
    build (2026-12-04, faster kernels than the portable build its machine's CPU rate was measured with) reads
    0.76-0.79 with the stored constants and down to 0.70 with these exponents: held at 0.68; 2026-12-02's within the
    target."""
    from lab import cpu_speed
    from orchestrator.plan import rates as R

    pts = _speed_points(SPEED + H200_CPU)
    pts = cpu_speed.with_rates(pts, cpu_speed.machine_rates(pts))
    multi = [p for p in pts if p["threads"] > 1 and p["n_prompt"] >= cpu_speed.THREAD_FIT_MIN_PROMPT]
    w1 = [p for p in multi if p["model"]["n_layers"] == 48]
    assert len(w1) >= 3 and len({p["set"] for p in w1}) >= 2
    subsets = [[p for p in multi if p["model"]["n_layers"] != 48]]
    subsets += [[p for p in multi if p["set"] != s] for s in sorted({p["set"] for p in multi})]
    for k, subset in enumerate(subsets):
        exponent = cpu_speed.fit_thread_exponent(subset)
        assert exponent == pytest.approx(R.CPU_PP_THREAD_EXPONENT, abs=0.035 if k == 0 else 0.025)
        with cpu_speed.constants(CPU_PP_THREAD_EXPONENT=exponent):
            for p in w1:
                low = 0.68 if p["set"] == max(q["set"] for q in w1) else 0.75
                assert low <= cpu_speed.predict(p) / p["ts"] <= 1.25, (exponent, p["set"], p["n_prompt"])


def test_cpu_generation_on_every_core_of_the_h200():
    """Generation on all 16 cores of the H200 (the demo, demo-24l, W1; both records) within +-25% of the fastest
    run: the per-layer cost grows as threads ** CPU_LAYER_THREAD_EXPONENT (without it the demo read 1.32). The
    exponent fitted without any one of these points stays near the stored one and keeps the others within the
    target: no one point sets it."""
    from lab import cpu_speed
    from orchestrator.plan import rates as R

    pts = _speed_points(SPEED + H200_CPU)
    full = [p for p in pts if p["n_gen"] and not p["n_prompt"] and p["threads"] > 1
            and p["threads"] == p["node_threads"]]
    assert len(full) >= 5 and {p["model"]["n_layers"] for p in full} >= {6, 24, 48}
    for p in full:
        assert 0.75 <= cpu_speed.predict(p) / p["ts"] <= 1.25, (p["set"], p["model"]["name"])
    with cpu_speed.constants(CPU_LAYER_THREAD_EXPONENT=0.0):
        assert max(cpu_speed.predict(p) / p["ts"] for p in full) > 1.25      # the demo at 16 threads, as before
    for left in full:
        rest = [p for p in full if p is not left]
        exponent = cpu_speed.fit_layer_thread_exponent(rest)["CPU_LAYER_THREAD_EXPONENT"]
        assert exponent == pytest.approx(R.CPU_LAYER_THREAD_EXPONENT, abs=0.035), left["model"]["name"]
        with cpu_speed.constants(CPU_LAYER_THREAD_EXPONENT=exponent):
            for p in rest:
                assert 0.75 <= cpu_speed.predict(p) / p["ts"] <= 1.25, (exponent, p["set"], p["model"]["name"])


def _thread_limited(pts: list[dict], docs: list[dict]) -> set[int]:
    """Sets whose runs used fewer threads than the node's cores while those threads read at under 3/4 of the
    all-core figure the plan predicts from (the record's own probe of each thread count says so)."""
    out = set()
    for i, doc in enumerate(docs):
        node = str(doc["node_threads"])
        for t in {str(p["threads"]) for p in pts if p["set"] == i}:
            probes = [d for d in (doc["host_bw"], doc.get("host_bw_after", {})) if t in d and node in d]
            if t != node and probes and max(d[t] / d[node] for d in probes) < 0.75:
                out.add(i)
    return out


def test_cpu_generation_of_the_demo_against_its_fastest_runs():
    """The demo model (6 layers, what scripts/demo.sh serves) with the plan's one thread per replica, predicted
    against the fastest llama-bench run of each record: the target is +-25%, met by the records taken on idle
    cores; those taken while other work shared the 2 cores (load 3-11) sit at 0.69-0.96, so the test holds them
    within 35% and the median of all within the target. Every other point: generation within 50%, prompts within
    35%."""
    import statistics

    from lab import cpu_speed

    pts = cpu_speed.with_rates(_speed_points(), {cpu_speed.REFERENCE_MACHINE: 1.0})
    idle = {i for i, f in enumerate(SPEED) if f.name in IDLE_RECORDS}
    assert idle
    tg = [p for p in pts if p["n_gen"] and not p["n_prompt"]]
    demo = {p["set"]: cpu_speed.predict(p) / p["ts"] for p in tg
            if p["model"]["name"] == "demo-moe.gguf" and p["threads"] == 1}
    assert len(demo) >= 6 and idle <= set(demo)
    assert all(0.75 <= r <= 1.25 for s, r in demo.items() if s in idle), demo
    assert all(0.65 <= r <= 1.35 for r in demo.values()), demo
    assert 0.75 <= statistics.median(demo.values()) <= 1.25, demo
    from lab import cpu_speed as cs

    limited = _thread_limited(pts, [cs.load(f) for f in SPEED])
    for p in pts:
        if p["set"] in limited and not p["n_prompt"]:
            continue                        # test_generation_of_one_thread_reads_at_the_all_core_figure
        ratio = cpu_speed.predict(p) / p["ts"]
        limit = 0.35 if p["n_prompt"] else 0.5
        assert abs(ratio - 1.0) <= limit, (p["set"], p["model"]["name"], p["n_prompt"], ratio)


@pytest.mark.xfail(strict=True, reason="the CPU-only generation model reads at the node's all-core bandwidth "
                   "whatever the worker's threads; on idle cores one thread of two reads at about half of it")
def test_generation_of_one_thread_reads_at_the_all_core_figure():
    """Where one thread reads at well under the all-core probe (this VM on idle cores: 28-33 against 51-66 GB/s),
    bandwidth-bound generation is predicted too fast (w1-6l: 2.3x). Fails until the prediction takes the
    worker's threads' share of the bandwidth; then the xfail goes."""
    from lab import cpu_speed

    pts = cpu_speed.with_rates(_speed_points(), {cpu_speed.REFERENCE_MACHINE: 1.0})
    limited = _thread_limited(pts, [cpu_speed.load(f) for f in SPEED])
    assert limited
    for p in pts:
        if p["set"] in limited and not p["n_prompt"]:
            assert abs(cpu_speed.predict(p) / p["ts"] - 1.0) <= 0.5, (p["model"]["name"], p["threads"])


FAMILIES_CPU = REPO / "docs" / "benchmarks" / "devvm-2026-12-04-cpu-families" / "runs.json.xz"


def test_cpu_prompts_of_the_other_families_held_out():
    """Cuts of GLM-4.5-Air, DeepSeek-V3 and gpt-oss on one thread of the reference machine, which the CPU constants
    were not fitted on: every 512-token prompt within +-25% of its fastest run. The GLM and DeepSeek cuts end on
    their MoE layer, whose feed-forward a prompt skips (0.65 and 0.79 while the model counted it)."""
    from lab import cpu_speed

    pts = [p for p in _speed_points([FAMILIES_CPU]) if p["n_prompt"] == 512]
    arches = {p["model"]["arch"] for p in pts}
    assert {"glm4moe", "deepseek2", "gpt-oss", "qwen3moe"} <= arches
    for p in pts:
        ratio = cpu_speed.predict({**p, "cpu_rate": 1.0}) / p["ts"]
        assert 0.75 <= ratio <= 1.25, (p["model"]["name"], ratio)
