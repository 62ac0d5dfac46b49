"""Configurations derived from the plan: what each generator drops, keeps and adds (pure)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.bench.configs import (
    OFFLOAD_ENV,
    OFFLOAD_NEVER,
    BenchConfig,
    build_configs,
    config_from_plan_json,
    config_from_worker,
    cpu_moe_config,
    default_ncmoe_values,
    default_offload_values,
    fit_config,
    get_arg,
    has_flag,
    ncmoe_sweep,
    offload_sweep,
    parse_args,
    parse_config_option,
    plan_config,
    server_from_plan_json,
    threads_sweep,
    default_thread_values,
    with_args,
    without,
)
from orchestrator.errors import ConfigError

OT = r"blk\.(0|1|2|3|4|5|6|7|8|9|1[0-9])\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
PLAN_ARGS = ("-m", "/models/q30.gguf", "--alias", "model", "--host", "0.0.0.0", "--port", "8081", "-c", "16384",
             "-np", "2", "-ngl", "999", "-ot", OT, "--fit", "off", "-t", "16", "-tb", "32", "-b", "4096", "-ub",
             "4096", "-ctk", "q8_0", "--load-mode", "none", "--numa", "distribute", "--metrics")
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PLAN_ENV = {OFFLOAD_ENV: "64", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.fixture()
def plan() -> BenchConfig:
    return plan_config(PLAN_ARGS, PLAN_ENV, wrapper=("numactl", "--cpunodebind=0", "--membind=0", "--"),
                       cpu_expert_layers=tuple(range(20)))


def test_parse_args_pairs_switches_negative_numbers_and_equals():
    a = parse_args(["-ngl", "999", "--cpu-moe", "--seed", "-1", "--fit=off", "-ot", OT, "--metrics"])
    assert [(x.flag, x.value) for x in a] == [("-ngl", "999"), ("--cpu-moe", None), ("--seed", "-1"),
                                              ("--fit", "off"), ("-ot", OT), ("--metrics", None)]
    assert get_arg(["-c", "1", "--ctx-size", "2"], "-c") == "2"          # aliases, last one wins
    assert get_arg(["--cpu-moe"], "-cmoe") == "" and get_arg([], "-c") is None
    assert without(["-ngl", "5", "--n-gpu-layers", "6", "-t", "4"], ["--gpu-layers"]) == ("-t", "4")
    assert with_args(["-ub", "512", "-t", "4"], ("--ubatch-size", "2048")) == ("-t", "4", "--ubatch-size", "2048")


def test_plan_params_come_from_its_flags(plan):
    assert plan.group == "plan"
    assert plan.params == {"ubatch": 4096, "batch": 4096, "load_mode": "pinned", "op_offload_min_batch": 64,
                           "n_cpu_moe": 20}
    assert plan.ctx == 16384 and plan.parallel == 2 and plan.model_path == "/models/q30.gguf"


def test_argv_puts_wrapper_binary_flags_and_our_endpoint(plan):
    argv = plan.argv("/bin/llama-server", "127.0.0.1", 9999)
    assert argv[:4] == ("numactl", "--cpunodebind=0", "--membind=0", "--")
    assert argv[4] == "/bin/llama-server"
    assert argv[-4:] == ("--host", "127.0.0.1", "--port", "9999")
    assert "0.0.0.0" not in argv and "8081" not in argv


def test_fit_keeps_context_threads_and_drops_every_placement_decision(plan):
    fit = fit_config(plan)
    a = fit.args
    for flag in ("-ngl", "-ot", "-ub", "-b", "--load-mode"):
        assert not has_flag(a, flag), flag
    assert get_arg(a, "--fit") == "on" and get_arg(a, "--fit-ctx") == "16384"
    for flag, v in (("-c", "16384"), ("-np", "2"), ("-t", "16"), ("-tb", "32"), ("-ctk", "q8_0"),
                    ("--numa", "distribute"), ("-m", "/models/q30.gguf")):
        assert get_arg(a, flag) == v, flag
    assert OFFLOAD_ENV not in fit.env and fit.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert fit.wrapper == plan.wrapper


def test_fit_without_fit_flag_in_plan_adds_none():
    p = plan_config(["-m", "m.gguf", "-c", "4096", "-ngl", "99"])        # a binary without --fit (ik_llama.cpp)
    assert fit_config(p).args == ("-m", "m.gguf", "-c", "4096")


def test_cpu_moe_recipe(plan):
    c = cpu_moe_config(plan)
    assert get_arg(c.args, "-ngl") == "999" and has_flag(c.args, "--cpu-moe")
    assert not has_flag(c.args, "-ot") and not has_flag(c.args, "-ub") and not has_flag(c.args, "--fit")
    assert OFFLOAD_ENV not in c.env


def test_ncmoe_sweep_grid(plan):
    cs = ncmoe_sweep(plan, [19, 20, 21], [512, 4096], ("mmap", "pinned"))
    assert len(cs) == 12 and len({c.name for c in cs}) == 12
    c = next(c for c in cs if c.name == "ncmoe19-ub512-pinned")
    assert get_arg(c.args, "--n-cpu-moe") == "19" and get_arg(c.args, "-ub") == "512"
    assert get_arg(c.args, "-b") == "4096"                             # max(ub, plan's -b)
    assert get_arg(c.args, "--load-mode") == "none" and get_arg(c.args, "--fit") == "off"
    assert not has_flag(c.args, "-ot") and get_arg(c.args, "-c") == "16384"
    assert c.env[OFFLOAD_ENV] == "64"                                  # the plan's threshold is kept
    m = next(c for c in cs if c.name == "ncmoe21-ub4096-mmap")
    assert get_arg(m.args, "--load-mode") is None and not has_flag(m.args, "--no-mmap")   # mmap: the default
    assert m.params == {"n_cpu_moe": 21, "ubatch": 4096, "load_mode": "mmap", "op_offload_min_batch": 64}


def test_cpu_expert_layers_read_from_the_flags():
    from orchestrator.bench.configs import cpu_expert_layers_of

    from orchestrator.launch.llama_args import parse_server_args

    def layers(args):
        return cpu_expert_layers_of(parse_server_args(args))

    assert layers(PLAN_ARGS) == tuple(range(20))
    # first match wins: layer 3's experts are sent to CUDA0 before the CPU pattern sees them
    ot = r"blk\.3\.ffn_.*_exps=CUDA0,blk\.[0-5]\.ffn_(up|down|gate)_exps=CPU"
    assert layers(["-ngl", "99", "-ot", ot]) == (0, 1, 2, 4, 5)
    assert layers(["-ngl", "99", "-ncmoe", "3"]) == (0, 1, 2)
    assert layers(["-ngl", "99"]) == ()
    assert layers(["-ngl", "99", "--cpu-moe"]) is None
    assert layers(["-m", "x.gguf"]) is None
    assert plan_config(["-m", "x", "-ngl", "99", "-ncmoe", "7"]).params["n_cpu_moe"] == 7


def test_ncmoe_defaults_and_bad_mode(plan):
    assert default_ncmoe_values(plan) == [19, 20, 21]
    assert default_ncmoe_values(plan_config(["-m", "x"], cpu_expert_layers=(0,))) == [0, 1, 2]
    assert default_ncmoe_values(plan, n_layers=20) == [19, 20]                 # never past the last layer
    from_json = config_from_plan_json({"model": {"n_layers": 6}, "workers": [
        {"args": ["-m", "x", "-ngl", "0"], "cpu_expert_layers": list(range(6))}]})
    assert from_json.params["n_layers"] == 6 and default_ncmoe_values(from_json) == [5, 6]
    with pytest.raises(ConfigError, match="--ncmoe N"):
        default_ncmoe_values(plan_config(["-m", "x"]))
    with pytest.raises(ConfigError, match="load mode"):
        ncmoe_sweep(plan, [1], [512], ("paged",))


def test_offload_sweep_replaces_threshold_and_skips_the_plans_own(plan):
    vals = default_offload_values(plan)
    assert vals == [16, 32, 128, 256, OFFLOAD_NEVER]
    cs = offload_sweep(plan, [32, 64, 128, OFFLOAD_NEVER])
    assert [c.name for c in cs] == ["offload32", "offload128", "offload-never"]
    assert [c.env[OFFLOAD_ENV] for c in cs] == ["32", "128", str(OFFLOAD_NEVER)]
    assert all(c.args == plan.args for c in cs)
    with pytest.raises(ConfigError):
        offload_sweep(plan, [0])


def test_offload_sweep_ik_llama_uses_its_own_knob():
    p = plan_config(["-m", "x.gguf", "-cuda", "offload-batch-size=48"])
    assert p.params["op_offload_min_batch"] == 48
    (c,) = offload_sweep(p, [96])
    assert get_arg(c.args, "-cuda") == "offload-batch-size=96" and OFFLOAD_ENV not in c.env


def test_control_is_the_plan_again_by_request_only(plan):
    cs = build_configs(plan, ["plan", "control"])
    assert [c.name for c in cs] == ["plan", "plan-control"]
    assert cs[1].args == plan.args and cs[1].env == plan.env and cs[1].group == "control"
    assert "plan-control" not in [c.name for c in build_configs(plan, ncmoe_values=[1], offload_values=[32])]


def test_threads_sweep_changes_generation_threads_only(plan):
    assert default_thread_values(plan) == [4, 8, 12, 15]
    cs = build_configs(plan, ["plan", "threads-sweep"], thread_values=[8, 16, 12])
    assert [c.name for c in cs] == ["plan", "threads8", "threads12"]          # 16 is the plan itself
    for c, t in zip(cs[1:], (8, 12)):
        assert get_arg(c.args, "-t") == str(t) and get_arg(c.args, "-tb") == "32"
        assert without(c.args, ["-t"]) == without(plan.args, ["-t"]) and c.env == plan.env
        assert c.group == "threads-sweep" and c.params["threads"] == t and c.wrapper == plan.wrapper
    # by request only; a plan without -tb keeps its prompt threads at the plan's -t
    assert not any(c.group == "threads-sweep" for c in build_configs(plan, ncmoe_values=[1], offload_values=[32]))
    (c,) = threads_sweep(plan_config(["-m", "x.gguf", "-t", "16"]), [8])
    assert get_arg(c.args, "-t") == "8" and get_arg(c.args, "-tb") == "16"
    with pytest.raises(ConfigError, match="no -t"):
        default_thread_values(plan_config(["-m", "x.gguf"]))
    with pytest.raises(ConfigError, match="at least 1"):
        threads_sweep(plan, [0])


def test_build_configs_order_unique_and_unknown_group(plan):
    cs = build_configs(plan, ncmoe_values=[20], ubatches=[4096], load_modes=("pinned",), offload_values=[32])
    assert [c.name for c in cs] == ["plan", "fit", "fit-pinned", "cpu-moe", "ncmoe20-ub4096-pinned", "offload32"]
    with pytest.raises(ConfigError, match="unknown bench configuration group 'fitt'"):
        build_configs(plan, ["fitt"])


def test_every_flag_we_emit_is_in_mainline_help(plan):
    """The generated flags exist in the real llama-server (help text recorded from the mainline build)."""
    help_text = (FIXTURES / "backend" / "mainline-llama-server-help.txt").read_text()
    known = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", help_text))
    for c in build_configs(plan, ncmoe_values=[20], offload_values=[32]):
        for a in parse_args(c.args):
            assert a.flag in known, f"{c.name}: {a.flag} is not a llama-server flag"


def test_parse_config_option():
    c = parse_config_option("off64=GGML_OP_OFFLOAD_MIN_BATCH=64 -m 'my model.gguf' -ngl 99")
    assert c.name == "off64" and c.env == {OFFLOAD_ENV: "64"} and c.args == ("-m", "my model.gguf", "-ngl", "99")
    assert c.params["op_offload_min_batch"] == 64
    assert parse_config_option("plan=-m x.gguf").group == "plan"
    for bad, msg in (("noequals", "expected NAME="), ("x=", "no llama-server flags"), ("a b=-m x", "name"),
                     ("x=-m 'unclosed", "cannot split")):
        with pytest.raises(ConfigError, match=msg):
            parse_config_option(bad)


def test_config_from_plan_json_args_and_argv_forms():
    w = {"args": list(PLAN_ARGS), "argv": ["numactl", "--membind=0", "--", "/b/llama-server", *PLAN_ARGS],
         "env": PLAN_ENV, "gpus": [3], "cpu_expert_layers": [0, 1, 2],
         "predicted": {"pp": {"512": 900.0}, "tg": 40.0}, "devices": {"CUDA0": 11 << 30, "CPU": 6 << 30}}
    c = config_from_plan_json({"workers": [w]})
    assert c.wrapper == ("numactl", "--membind=0", "--") and c.args == PLAN_ARGS
    assert c.predicted == {"pp": {512: 900.0}, "tg": 40.0, "memory": {"gpu3": 11 << 30, "CPU": 6 << 30}}
    assert c.params["n_cpu_moe"] == 3
    d2 = {"workers": [{"argv": ["/opt/bin/llama-server", "-m", "x.gguf"], "env": {}}]}
    c2 = config_from_plan_json(d2)
    assert c2.args == ("-m", "x.gguf") and c2.wrapper == ()
    assert server_from_plan_json(d2) == "/opt/bin/llama-server" and server_from_plan_json({"workers": []}) is None
    assert server_from_plan_json({"workers": [w]}) == "/b/llama-server"
    with pytest.raises(ConfigError, match="workers"):
        config_from_plan_json({})
    with pytest.raises(ConfigError, match="worker 2 does not exist"):
        config_from_plan_json({"workers": [w]}, worker=2)
    with pytest.raises(ConfigError, match="no llama-server"):
        config_from_plan_json({"workers": [{"argv": ["numactl", "--", "server"]}]})


def _worker():
    """A planned worker whose settings render exactly PLAN_ARGS/PLAN_ENV for the pinned mainline build."""
    from dataclasses import replace

    from orchestrator.backend.info import nominal_backend
    from orchestrator.launch.llama_args import parse_server_args
    from orchestrator.plan.types import DeviceMemory, Prediction, WorkerPlan

    from orchestrator.launch.numa import NumaPolicy

    settings = replace(parse_server_args(PLAN_ARGS), gpus=(1,), op_offload_min_batch=64,
                       numa=NumaPolicy.bind([0], cpu_nodes=[0]), disable_numa_balancing=True)
    return WorkerPlan(name="w0", node="local", settings=settings, backend=nominal_backend("mainline", cuda=True),
                      placement=(), memory=(DeviceMemory("CUDA0", weights=10), DeviceMemory("CPU", weights=5, kv=1)),
                      predicted=Prediction(pp={512: 800.0}, tg=35.0), decisions=(), cpu_expert_layers=(0, 1))


def test_config_from_worker_plan():
    w = _worker()
    assert parse_args(w.args) == parse_args(PLAN_ARGS)              # the same flags, rendered from the settings
    c = config_from_worker(w)
    assert c.name == "plan" and c.params["n_cpu_moe"] == 2 and c.params["op_offload_min_batch"] == 64
    assert c.params["load_mode"] == "pinned" and c.params["ubatch"] == 4096
    assert c.predicted == {"pp": {512: 800.0}, "tg": 35.0, "memory": {"gpu1": 10, "CPU": 6}}
    assert c.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1", OFFLOAD_ENV: "64"}
    back = BenchConfig.from_dict(c.to_dict())
    assert (back.args, back.env, back.settings, back.backend) == (c.args, c.env, w.settings, w.backend)


def test_config_from_launch_spec_takes_the_wrappers_before_the_planned_flags():
    from orchestrator.bench.configs import config_from_launch_spec
    from orchestrator.launch import spec_for_worker

    w = _worker()
    spec = spec_for_worker(w.name, w.settings, w.backend)
    c = config_from_launch_spec(spec, w)
    assert c.wrapper == spec.argv[:spec.argv.index("--") + 1] and c.wrapper[-1] == "--"
    assert c.args == w.args and c.env == spec.env and c.group == "plan" and c.settings == w.settings
    assert c.argv("llama-server", "127.0.0.1", 1)[:len(c.wrapper) + 1] == spec.argv[:len(c.wrapper) + 1]
    with pytest.raises(ConfigError, match="needs the planned worker"):
        config_from_launch_spec(spec)


def test_a_plan_that_never_offloads_is_recorded_as_never_and_the_sweep_varies_it(tmp_path):
    """The planner renders "never offload" as --no-op-offload (no GGML_OP_OFFLOAD_MIN_BATCH): the bench must read
    that as never, not as llama.cpp's default 32, and every other sweep point must drop the switch (a point
    that keeps it measures "never" again under another name)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plan"))
    from planfixtures import backend, machine, shape_model

    from orchestrator.launch.llama_args import OFFLOAD_NEVER as LAUNCH_NEVER
    from orchestrator.plan import NodeRequest, PlanRequest, make_plan
    from orchestrator.plan.request import OFFLOAD_NEVER as PLAN_NEVER

    assert OFFLOAD_NEVER == LAUNCH_NEVER == PLAN_NEVER                # one "never" in the whole code base
    model = shape_model(tmp_path, "qwen3-30b-a3b", "q8_0")
    req = PlanRequest(nodes=(NodeRequest(name="n", vram_limit=12 << 30),), op_offload_min_batch=OFFLOAD_NEVER)
    plan = make_plan(machines={"n": machine("1socket-1gpu-24g")}, model=model, request=req, backend=backend())
    w = plan.workers[0]
    assert "--no-op-offload" in w.args and OFFLOAD_ENV not in w.env
    as_json = {**plan.to_dict(), "backend": w.backend.to_dict()}      # what `orchestrator plan --json` writes
    assert config_from_plan_json(as_json).settings == w.settings
    for c in (config_from_worker(w), config_from_plan_json(plan.to_dict()), config_from_plan_json(as_json)):
        assert c.params["op_offload_min_batch"] == OFFLOAD_NEVER
        sweep = build_configs(c, ("offload-sweep",))
        assert sweep and OFFLOAD_NEVER not in [s.params["op_offload_min_batch"] for s in sweep]
        for s in sweep:
            assert "--no-op-offload" not in s.args, s.name
            assert s.env[OFFLOAD_ENV] == str(s.params["op_offload_min_batch"]), s.name
    # and back: a plan at T sweeps to never with the switch the binary offers
    plan_t = plan_config([*without(w.args, ["--no-op-offload"])], {**w.env, OFFLOAD_ENV: "64"})
    never = next(s for s in offload_sweep(plan_t, [OFFLOAD_NEVER]))
    assert never.name == "offload-never" and never.params["op_offload_min_batch"] == OFFLOAD_NEVER


def test_fit_pinned_is_fit_with_pinned_host_weights(plan):
    c = next(c for c in build_configs(plan, ["fit-pinned"]))
    assert c.settings.fit is True and c.settings.load_mode == "pinned"
    assert get_arg(c.args, "--fit") == "on" and get_arg(c.args, "--load-mode") == "none"
    assert not has_flag(c.args, "-ot") and not has_flag(c.args, "--moe-cache-mib")


def test_cache_grid_moves_layers_into_the_cache():
    from orchestrator.bench.configs import cache_grid, cpu_expert_layers_of, parse_config_option

    p = parse_config_option(r"plan=-m m.gguf -c 8192 -ngl 999 -ot blk\.(0|1|2)\.ffn_(up|down|gate)_exps=CPU "
                            "-ub 2048 --load-mode none --moe-cache-mib 1000")
    assert p.renders_for.has("expert_cache")
    layer = 324 << 20
    grid = cache_grid(p, layer)
    assert [c.name for c in grid] == ["ncmoe3", "ncmoe7+cache2232", "ncmoe11+cache3528", "ncmoe15+cache4824"]
    for c, d in zip(grid, (0, 4, 8, 12)):
        assert cpu_expert_layers_of(c.settings) == tuple(range(3 + d))
        assert c.settings.n_ubatch == 2048 and c.settings.load_mode == "pinned"     # the rest is the plan's
        assert c.params["expert_cache_mib"] == c.settings.expert_cache_mib
    assert not has_flag(grid[0].args, "--moe-cache-mib")
    # without a cache in the plan, its own point is the plan itself
    bare = parse_config_option(r"plan=-m m.gguf -ngl 999 -ot blk\.(0|1|2)\.ffn_(up|down|gate)_exps=CPU "
                               "--moe-cache-mib 0")
    assert [c.name for c in cache_grid(bare, layer)][0] == "ncmoe7+cache1232"
    # the default groups leave the grid out when the plan's binary has no cache; asked for by name, it says why
    assert not [c for c in build_configs(plan_without_cache(), ncmoe_values=[1], offload_values=[32],
                                         layer_expert_bytes=layer) if c.group == "cache-grid"]
    with pytest.raises(ConfigError, match="cache-grid needs"):
        build_configs(plan_without_cache(), ["cache-grid"], layer_expert_bytes=layer)


@pytest.mark.parametrize("like,layers,gib", [("qwen3-235b-a22b", 24, 12), ("qwen3-30b-a3b", None, 6)])
def test_cache_grid_of_a_two_gpu_plan_fits_every_gpu(tmp_path, like, layers, gib):
    """The plan with the cache on the recorded two-H200 machine (-sm layer): every grid point moves the next layers
    after some GPU's own host-resident ones, and the banks our patch would allocate for the point's argv (one slot
    count: MiB / one expert of every host-resident expert tensor, each bank on its layer's GPU) fit in what that
    GPU had for banks in the plan plus the experts moved off it."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plan"))
    from planfixtures import backend, shape_model, with_gpu_free

    from orchestrator.bench.configs import cache_grid, cpu_expert_layers_of
    from orchestrator.hardware.dump import load_machine
    from orchestrator.plan import NodeRequest, PlanRequest, make_plan
    from orchestrator.plan.costs import model_costs

    MiB, GiB = 1 << 20, 1 << 30
    model = shape_model(tmp_path, like, "q4_0", layers=layers)
    x2 = with_gpu_free(load_machine(FIXTURES / "machines" / "h200x2.tar.gz"), gib * GiB)
    b = backend()
    b = b.__class__(**{**b.__dict__, "features": b.features | {"expert_cache"}})
    req = PlanRequest(nodes=(NodeRequest(name="x2", vram_limit=gib * GiB, vram_reserve=256 * MiB),),
                      ubatch=2048)   # the grid needs layers left to move at this budget
    w = make_plan(machines={"x2": x2}, model=model, request=req, backend=b).workers[0]
    assert w.settings.split_mode == "layer" and w.settings.expert_cache_mib
    costs = model_costs(model)
    layer = max(costs.layer_experts)
    expert = layer / costs.n_expert
    counts = list(w.settings.tensor_split)
    dev = [g for g, c in enumerate(counts) for _ in range(int(c))][:model.n_layers]   # integer -ts: ranges

    def banks(mib, host):                        # the patch: one slot count, each bank on its layer's GPU
        slots = min(mib * MiB // int(len(host) * expert), costs.n_expert)
        return [slots * expert * sum(1 for i in host if dev[i] == g) for g in (0, 1)]

    plan_host = set(w.cpu_expert_layers)
    plan_banks = banks(w.settings.expert_cache_mib, plan_host)
    grid = cache_grid(config_from_worker(w), layer, n_layers=model.n_layers)
    left = model.n_layers - len(plan_host)                  # whole expert layers the plan keeps in VRAM
    assert [c.params["n_cpu_moe"] - len(plan_host) for c in grid] == [d for d in (0, 4, 8, 12) if d <= left]
    assert not has_flag(grid[0].args, "--moe-cache-mib")
    for c in grid[1:]:
        host = set(cpu_expert_layers_of(c.settings))
        assert plan_host < host and c.settings.tensor_split == w.settings.tensor_split
        for g in (0, 1):
            mine = [i for i in range(model.n_layers) if dev[i] == g]
            own = [i for i in mine if i in host]
            assert own == mine[:len(own)]                    # each GPU's first layers, as the planner moves them
            moved = sum(1 for i in own if i not in plan_host)
            assert banks(c.settings.expert_cache_mib, host)[g] <= plan_banks[g] + moved * layer, (c.name, g)
        assert sum(c.params["expert_cache_mib_per_gpu"].values()) <= c.settings.expert_cache_mib
    # more layers moved, a bigger cache
    mibs = [c.settings.expert_cache_mib for c in grid[1:]]
    assert mibs == sorted(mibs) and mibs[0] > w.settings.expert_cache_mib


def test_cache_grid_refuses_what_it_cannot_split():
    from orchestrator.bench.configs import cache_grid

    tensor = parse_config_option(r"plan=-m m.gguf -ngl 999 -sm tensor -ts 1,1 -ot "
                                 r"blk\.(0|1)\.ffn_(up|down|gate)_exps=CPU --moe-cache-mib 100")
    with pytest.raises(ConfigError, match="-sm tensor"):
        cache_grid(tensor, 324 << 20)
    shares = parse_config_option(r"plan=-m m.gguf -ngl 999 -sm layer -ts 0.4,0.6 -ot "
                                 r"blk\.(0|1)\.ffn_(up|down|gate)_exps=CPU --moe-cache-mib 100")
    with pytest.raises(ConfigError, match="layer count"):
        cache_grid(shares, 324 << 20)
    # 10 layers: 0-4 on CUDA0 (il / 11 < 0.4), 5-9 on CUDA1. Layers 2, 3, 4 move on CUDA0 (each grows the cache
    # most there), then 5 on CUDA1: T' = min(100 + 3 x 324) x 6 / 5, 324 x 6 / 1) - 64 = 1222 MiB, of which CUDA0
    # holds 5/6 = 1018 MiB <= its 1072; one GPU's rule (100 + 4 x 324 - 64 = 1332) would put 1110 MiB there
    grid = cache_grid(shares, 324 << 20, steps=(4,), n_layers=10)
    assert [c.name for c in grid] == ["ncmoe6+cache1222"]
    assert grid[0].params["expert_cache_mib_per_gpu"] == {"CUDA0": 1018, "CUDA1": 203}
    # the default groups leave out a grid they cannot split; asked for by name, it says why
    assert not [c for c in build_configs(tensor, ncmoe_values=[1], offload_values=[32], layer_expert_bytes=324 << 20)
                if c.group == "cache-grid"]
    with pytest.raises(ConfigError, match="-sm tensor"):
        build_configs(tensor, ["cache-grid"], layer_expert_bytes=324 << 20)


def plan_without_cache():
    from orchestrator.bench.configs import parse_config_option

    return parse_config_option(r"plan=-m m.gguf -ngl 999 -ot blk\.(0|1)\.ffn_(up|down|gate)_exps=CPU")


CPU_ARGS = ("-m", "/models/q30.gguf", "-c", "4096", "-np", "2", "-ngl", "0", "--fit", "off", "-t", "8", "-tb", "16",
            "-b", "2048", "-ub", "512", "--metrics")


def _cpu_plan(numa=None):
    from dataclasses import replace

    from orchestrator.launch.numa import NumaPolicy

    from orchestrator.backend.info import nominal_backend

    plan = plan_config(CPU_ARGS, wrapper=("/usr/bin/numactl", "--physcpubind=0-7", "--membind=1", "--"))
    return replace(plan, settings=replace(plan.settings, numa=numa or NumaPolicy("bind", tuple(range(8)), (), (1,))),
                   backend=nominal_backend("mainline", cuda=False))


def test_a_cpu_plan_is_told_apart_from_a_gpu_plan():
    from orchestrator.bench.configs import runs_on_cpu_only

    assert runs_on_cpu_only(_cpu_plan()) and runs_on_cpu_only(plan_config(CPU_ARGS))
    assert not runs_on_cpu_only(plan_config(PLAN_ARGS))


def test_the_cpu_alternatives_change_one_choice_each():
    from orchestrator.bench.configs import CPU_GROUPS

    plan = _cpu_plan()
    out = {c.name: c for c in build_configs(plan, CPU_GROUPS, numa_nodes=(0, 1), ubatches=(256, 512, 1024))}
    assert list(out) == ["plan", "defaults", "threads2", "threads4", "threads6", "threads7", "ub256", "ub1024",
                         "numa-none", "numa-interleave"]
    d = out["defaults"]
    assert d.wrapper == () and not has_flag(d.args, "-t") and not has_flag(d.args, "-ub")
    assert get_arg(d.args, "-c") == "4096" and get_arg(d.args, "-np") == "2"
    assert get_arg(out["ub256"].args, "-ub") == "256" and out["ub256"].wrapper == plan.wrapper
    assert out["numa-none"].wrapper == () and get_arg(out["numa-none"].args, "-t") == "8"
    assert out["numa-interleave"].wrapper == ("/usr/bin/numactl", "--physcpubind=0-7", "--interleave=0-1", "--")
    assert not has_flag(out["numa-interleave"].args, "--numa")     # numactl's binding holds without it


def test_a_plan_without_numactl_gets_bind_and_interleave():
    from orchestrator.bench.configs import numa_sweep
    from orchestrator.launch.numa import NumaPolicy

    plan = plan_config(CPU_ARGS)
    from dataclasses import replace

    plan = replace(plan, settings=replace(plan.settings, numa=NumaPolicy.none((0, 1))))
    got = {c.name: c.wrapper for c in numa_sweep(plan, (0,))}
    assert got == {"numa-bind": ("numactl", "--physcpubind=0-1", "--membind=0", "--"),
                   "numa-interleave": ("numactl", "--physcpubind=0-1", "--interleave=0", "--")}


def test_a_cpu_plan_is_graded_against_its_alternatives_without_a_target():
    from orchestrator.bench.summary import ratios

    def s(tg):
        return {"metrics": {"tg128@0": {"median": tg, "values": [tg]}}}

    summary = {"plan": s(10.0), "defaults": s(8.0), "ub256": s(12.0)}
    configs = [{"name": "plan", "group": "plan"}, {"name": "defaults", "group": "defaults"},
               {"name": "ub256", "group": "ub-sweep"}]
    out = [r for r in ratios(summary, configs) if r["kind"] == "plan/best-cpu"]
    assert len(out) == 1 and out[0]["other_config"] == "ub256" and out[0]["target"] is None
    assert out[0]["value"] == pytest.approx(10 / 12, rel=1e-3)


def test_the_baseline_leaves_every_placement_option_of_the_table_to_llama_cpp():
    """The baseline drops what the option table marks as placement (its fields and its flags in the user's own
    arguments), the batches, load mode and op offload, and the cache; it keeps what every configuration shares."""
    from dataclasses import replace

    from orchestrator.backend.server_options import OPTIONS, PLACEMENT
    from orchestrator.bench.configs import baseline
    from orchestrator.launch.llama_args import parse_server_args
    from orchestrator.launch.settings import WorkerSettings

    s = replace(parse_server_args(PLAN_ARGS, PLAN_ENV), expert_cache_mib=512, expert_cache_slots="device",
                extra_args=("-dev", "CUDA0", "--seed", "-1", "-fitt", "1024", "-ub", "64", "-cuda", "fusion=1"))
    b = baseline(s)
    fresh = WorkerSettings()
    for o in OPTIONS:
        if o.owner == PLACEMENT and o.field:
            assert getattr(b, o.field) == getattr(fresh, o.field), o.field
    assert (b.n_batch, b.n_ubatch, b.load_mode, b.op_offload_min_batch, b.expert_cache_mib) == (
        None, None, "mmap", None, 0)
    assert b.extra_args == ("--seed", "-1")
    assert (b.context, b.parallel, b.threads, b.threads_batch, b.type_k, b.numa_flag, b.metrics) == (
        s.context, s.parallel, s.threads, s.threads_batch, s.type_k, s.numa_flag, s.metrics)
