"""run_bench end to end with the real llama-server on a tiny MoE model (CPU), and the interleaving order."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

import psutil
import pytest

from orchestrator.bench import BenchOptions, VramBallast, Workload, build_configs, parse_config_option, run_bench
from orchestrator.bench.configs import OFFLOAD_ENV, OFFLOAD_NEVER, BenchConfig
from orchestrator.bench.progress import Progress
from orchestrator.bench.session import binary_has_flag, schedule
from orchestrator.bench.server import default_launcher
from orchestrator.errors import ConfigError, HardwareError

SMALL = Workload(pp=(8, 32, 128), pp_reps=2, tg_depths=(0, 200), tg_tokens=8, concurrency=(1, 2), ttft_prompt=16,
                 ttft_tokens=2, ttft_requests=2)


def _opts(**kw) -> BenchOptions:
    base = dict(rounds=2, workload=SMALL, load_timeout=60, request_timeout=60, sample_interval=0.05)
    base.update(kw)
    return BenchOptions(**base)


def _plan(model) -> BenchConfig:
    return parse_config_option(f"plan=-m {model} -c 1024 -np 2 -t 1 -ub 128 -b 256")


def _servers_left() -> list[psutil.Process]:
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if "llama-server" in " ".join(p.cmdline() or [])]


class Recorder(Progress):
    def __init__(self):
        self.begun, self.lines = [], []

    def begin(self, index, round_, rounds, name):
        self.begun.append((round_, name))

    def end(self, line):
        self.lines.append(line)


# --- order -------------------------------------------------------------------------------------------------

def test_schedule_orders():
    names = ["a", "b", "c"]
    assert schedule(names, 3, "serpentine") == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"),
                                                (3, "a"), (3, "b"), (3, "c")]
    assert [n for _, n in schedule(names, 3, "rotate")] == list("abcbcacab")
    assert [n for _, n in schedule(names, 2, "fixed")] == list("abcabc")
    with pytest.raises(ConfigError):
        schedule(names, 1, "random")


@pytest.mark.parametrize("n", [2, 5, 8])
def test_serpentine_gives_every_config_the_same_mean_position(n):
    names = [f"c{i}" for i in range(n)]
    order = schedule(names, 2)
    pos = {name: [i for i, (_, x) in enumerate(order) if x == name] for name in names}
    means = {name: sum(p) / len(p) for name, p in pos.items()}
    assert len(set(means.values())) == 1
    assert all(len(p) == 2 for p in pos.values())


def test_bad_options_and_inputs(tmp_path, llama_server_path):
    with pytest.raises(ConfigError, match="--rounds"):
        BenchOptions(rounds=0)
    with pytest.raises(ConfigError, match="--pp"):
        BenchOptions(workload=Workload(pp=(0,)))
    cfg = BenchConfig("a", ("-m", "x.gguf"))
    with pytest.raises(ConfigError, match="two bench configurations are named 'a'"):
        run_bench([cfg, cfg], llama_server_path, tmp_path)
    with pytest.raises(Exception, match="does not exist or is not executable"):
        run_bench([cfg], str(tmp_path / "nope"), tmp_path)
    assert not (tmp_path / "bench.json").exists()


# --- end to end --------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_two_configs_two_rounds_and_a_broken_one(tmp_path, tiny_moe, llama_server_path):
    plan = _plan(tiny_moe)
    configs = build_configs(plan, ["plan", "fit", "offload-sweep"], offload_values=[64])
    broken = BenchConfig("broken", plan.args + ("-ot", r"blk\..*=CUDA0"))
    configs.append(broken)
    rec = Recorder()
    data = run_bench(configs, llama_server_path, tmp_path / "out", _opts(), progress=rec)

    names = ["plan", "fit", "offload64", "broken"]
    assert [c["name"] for c in data["configs"]] == names
    expected = [(1, n) for n in names] + [(2, n) for n in reversed(names)]
    assert [(r["round"], r["config"]) for r in data["runs"]] == expected == rec.begun
    assert [r["position"] for r in data["runs"]] == list(range(8))

    for r in data["runs"]:
        if r["config"] == "broken":
            assert r["loaded"] is False and r["status"] == "load-failed"
            assert "unknown buffer type" in r["error"]
            assert (tmp_path / "out" / r["log"]).is_file()
            continue
        assert r["loaded"] and r["status"] == "ok" and r["errors"] == [] and r["context_kept"] is True
        assert 0 < r["load_s"] < 60
        s = r["samples"]
        assert sorted({p["n"] for p in s["pp"]}) == [8, 32, 128] and len(s["pp"]) == 6
        assert all(p["prompt_n"] == p["n"] and 10 < p["tps"] < 1e7 for p in s["pp"])
        assert [(t["depth"], t["predicted_n"]) for t in s["tg"]] == [(0, 8), (200, 8)]
        assert all(1 < t["tps"] < 1e6 for t in s["tg"])
        assert {k: len(v) for k, v in s["ttft"].items()} == {"1": 2, "2": 2}
        assert (1 << 20) < r["resources"]["rss_peak"] < (2 << 30)     # the model is mapped, nothing absurd
        assert "--port" in r["argv"] and r["argv"][0] == llama_server_path
        assert r["argv"][-2:] == ["-lv", "4"]                           # llama.cpp's buffer sizes in the log
        assert r["llama"]["buffers"]["model"]["CPU_Mapped"] > 500_000   # the ~1 MB model, mapped
        assert r["config"] != "fit" or any("fit" in x or "memory" in x for x in r["llama"]["fit"])
    assert next(r for r in data["runs"] if r["config"] == "offload64")["env"] == {OFFLOAD_ENV: "64"}
    assert rec.lines[3].startswith("FAILED (load-failed)")

    summ = data["summary"]
    assert summ["plan"]["loaded"] == 2 and summ["broken"]["loaded"] == 0
    assert "unknown buffer type" in summ["broken"]["errors"][0]
    m = summ["plan"]["metrics"]
    assert m["pp128"]["n"] == 4 and m["pp128"]["min"] <= m["pp128"]["median"] <= m["pp128"]["max"]
    assert m["tg8@0"]["n"] == 2 and m["ttft_p95_c2"]["n"] == 4
    assert summ["plan"]["llama_buffers"]["CPU_Mapped"] > 500_000 and "llama_buffers" not in summ["broken"]
    kinds = {(r["kind"], r["metric"]) for r in data["ratios"]}
    assert {("plan/fit", "pp128"), ("plan/fit", "tg8@0"), ("threshold/best", "pp8")} <= kinds
    assert all(r["value"] > 0 for r in data["ratios"])

    out = tmp_path / "out"
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["runs"] == data["runs"] and on_disk["summary"] == summ
    assert data["files"]["charts"] == ["speed.png", "offload.png"]
    for png in ("speed.png", "offload.png"):
        b = (out / png).read_bytes()
        assert b[:8] == b"\x89PNG\r\n\x1a\n" and len(b) > 10_000
    text = (out / "bench.txt").read_text()
    assert "plan/fit" in text and "broken:" in text and "unknown buffer type" in text
    assert not [p for p in out.iterdir() if p.name.startswith(".")]      # no temporary files left
    assert _servers_left() == []


@pytest.mark.integration
def test_a_server_that_dies_while_measured_is_recorded_and_the_run_goes_on(tmp_path, tiny_moe, llama_server_path):
    real = default_launcher()

    def killing_launcher(spec, log):
        proc = real(spec, log)
        if spec.name == "bench-victim":
            wait = proc.wait_healthy

            def wait_then_die(timeout):
                t = wait(timeout)
                os.kill(proc.pid, signal.SIGKILL)
                while proc.running():                   # until the manager sees it gone
                    time.sleep(0.01)
                return t

            proc.wait_healthy = wait_then_die
        return proc

    plan = _plan(tiny_moe)
    victim = BenchConfig("victim", plan.args)
    data = run_bench([victim, plan], llama_server_path, tmp_path, _opts(rounds=1), launcher=killing_launcher,
                     progress=Progress(), charts=False)
    v, p = data["runs"]
    assert v["loaded"] is True and v["status"] == "crashed" and v["crashed"] is True
    assert "measuring failed" in v["error"]
    assert p["status"] == "ok" and p["samples"]["pp"]
    assert data["summary"]["victim"]["crashed"] == 1
    assert _servers_left() == []


@pytest.mark.integration
def test_time_budget_stops_starting_new_configs(tmp_path, tiny_moe, llama_server_path):
    plan = _plan(tiny_moe)
    configs = [plan, BenchConfig("other", plan.args)]
    data = run_bench(configs, llama_server_path, tmp_path, _opts(rounds=2, max_seconds=0.001), progress=Progress(),
                     charts=False)
    assert len(data["runs"]) == 1 and "3 of 4 runs not started" in data["stopped_early"]
    assert data["summary"]["plan"]["loaded"] == 1 and data["summary"]["other"]["runs"] == 0


@pytest.mark.integration
def test_ctrl_c_keeps_what_was_measured_and_leaves_no_server(tmp_path, tiny_moe, llama_server_path):
    real = default_launcher()
    started = []

    def launcher(spec, log):
        if started:
            raise KeyboardInterrupt
        started.append(spec.name)
        return real(spec, log)

    plan = _plan(tiny_moe)
    with pytest.raises(KeyboardInterrupt):
        run_bench([plan, BenchConfig("second", plan.args)], llama_server_path, tmp_path, _opts(rounds=1),
                  launcher=launcher, progress=Progress(), charts=False)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["interrupted"] == "KeyboardInterrupt"
    assert [r["config"] for r in data["runs"]] == ["plan"] and data["summary"]["plan"]["loaded"] == 1
    assert _servers_left() == []


def test_a_held_ballast_is_recorded_and_its_loss_stops_the_run(tmp_path, tiny_moe, llama_server_path):
    plan = _plan(tiny_moe)
    with VramBallast(1 << 30, gpus=[0], simulate="2GiB") as ballast:
        ballast.children[0].kill()
        ballast.children[0].wait()
        with pytest.raises(HardwareError, match="ballast process is gone"):
            run_bench([plan], llama_server_path, tmp_path, _opts(rounds=1), ballast=ballast, nvml=None,
                      progress=Progress(), charts=False)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["ballast"]["budget"] == 1 << 30 and data["ballast"]["gpus"]["0"]["device"] == "simulated"
    assert data["runs"] == [] and "HardwareError" in data["interrupted"]


@pytest.mark.gpu
def test_gpu_run_holds_the_budget_and_records_vram_power_temperature(tmp_path, tiny_moe, llama_server_path):
    """Device counterpart (CUDA llama-server on the GPU machine): `pytest tests/bench -m gpu -q -s`."""
    budget = 4 << 30
    plan = parse_config_option(f"plan=-m {tiny_moe} -c 1024 -np 1 -t 2 -ngl 999")
    configs = build_configs(plan, ["plan", "cpu-moe"])
    data = run_bench(configs, llama_server_path, tmp_path, _opts(rounds=1, vram_budget=budget, gpus=(0,)),
                     progress=Progress())
    held = data["ballast"]["gpus"]["0"]
    assert abs(held["free"] - budget) <= 32 << 20
    for r in data["runs"]:
        assert r["status"] == "ok", r.get("error")
        g = r["resources"]["gpus"]["0"]
        print(r["config"], {k: v for k, v in g.items()}, r["gpu_free_before"])
        assert abs(r["gpu_free_before"]["0"] - budget) <= 64 << 20     # every config starts at the budget
        assert g["peak_delta"] > 100 << 20                              # at least a CUDA context
        assert g["power_mean_w"] > 0 and 0 < g["temp_max_c"] < 120
    m = data["summary"]["plan"]["metrics"]
    assert m["vram_peak_gpu0"]["median"] > 0 and "power_mean_w_gpu0" in m
    assert data["gpus"][0]["uuid"].startswith("GPU-")                  # which GPU (and host) measured it
    assert _servers_left() == []


def test_the_record_names_each_gpu_by_its_uuid_where_the_driver_gives_it():
    from orchestrator.bench.session import _gpu_inventory

    class Driver:                       # the NVML wrapper's answers for two GPUs, the second without a UUID
        def memory(self, i):
            return (100, 40, 60)

        def name(self, i):
            return "NVIDIA H200"

        def uuid(self, i):
            if i == 1:
                raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
            return "GPU-265e2bc1-ed21-b662-5b9a-846805de6d81"

    got = _gpu_inventory(Driver(), [0, 1])
    assert got[0]["uuid"] == "GPU-265e2bc1-ed21-b662-5b9a-846805de6d81" and got[0]["free"] == 60
    assert "uuid" not in got[1] and got[1]["name"] == "NVIDIA H200"


@pytest.mark.integration
def test_a_port_taken_at_start_is_retried_on_another(tmp_path, tiny_moe, llama_server_path):
    from orchestrator.errors import LaunchError

    real = default_launcher()
    ports = []

    def launcher(spec, log):
        ports.append(spec.port)
        if len(ports) == 1:
            raise LaunchError(f"worker {spec.name}: port {spec.port} on 127.0.0.1 is already in use")
        return real(spec, log)

    data = run_bench([_plan(tiny_moe)], llama_server_path, tmp_path, _opts(rounds=1, workload=Workload(
        pp=(8,), pp_reps=1, tg_depths=(), concurrency=())), launcher=launcher, progress=Progress(), charts=False)
    (r,) = data["runs"]
    assert r["status"] == "ok" and len(ports) == 2 and r["argv"][r["argv"].index("--port") + 1] == str(ports[1])


@pytest.mark.integration
def test_every_kind_of_derived_configuration_loads_on_the_real_server(tmp_path, tiny_moe, llama_server_path):
    """The flags and values the generators emit (--fit on --fit-ctx, --load-mode none/mmap, --n-cpu-moe, -ot,
    the threshold variable) are accepted by the real llama-server."""
    plan = parse_config_option(
        rf"plan=-m {tiny_moe} -c 1024 -np 1 -t 1 -ngl 999 -ot blk\.(0|1)\.ffn_(up|down|gate)_exps=CPU "
        "--fit off -ub 256 -b 512 --load-mode none")
    assert plan.params["n_cpu_moe"] == 2
    configs = build_configs(plan, ncmoe_values=[1], ubatches=[128], load_modes=("mmap", "pinned"),
                            offload_values=[OFFLOAD_NEVER])
    assert [c.name for c in configs] == ["plan", "fit", "fit-pinned", "cpu-moe", "ncmoe1-ub128-mmap",
                                         "ncmoe1-ub128-pinned", "offload-never"]
    # the cache grid's flags (-ot over more layers, --moe-cache-mib): a CPU build keeps the cache off
    cached = parse_config_option(
        rf"plan=-m {tiny_moe} -c 1024 -np 1 -t 1 -ngl 999 -ot blk\.(0)\.ffn_(up|down|gate)_exps=CPU "
        "--fit off -ub 256 -b 512 --load-mode none --moe-cache-mib 1")
    if binary_has_flag(llama_server_path, "--moe-cache-mib"):   # a build with our patch series
        configs += build_configs(cached, ["cache-grid"], layer_expert_bytes=64 << 20)[:2]
    w = Workload(pp=(8,), pp_reps=1, tg_depths=(), concurrency=(), warmup=False)
    data = run_bench(configs, llama_server_path, tmp_path, _opts(rounds=1, workload=w, prime_page_cache=False),
                     progress=Progress(), charts=False)
    assert [(r["config"], r["status"]) for r in data["runs"]] == [(c.name, "ok") for c in configs], \
        [r.get("error") for r in data["runs"]]


@pytest.mark.integration
def test_a_configuration_with_its_own_llama_server_and_the_threads_sweep(tmp_path, tiny_moe, llama_server_path):
    """LLAMA_SERVER=PATH in --config runs that configuration on another build (here the same binary under another
    path), beside the run's own; threads-sweep changes -t only. Both are what the real server ran."""
    other = tmp_path / "other-build" / "llama-server"
    other.parent.mkdir()
    other.symlink_to(llama_server_path)
    plan = parse_config_option(f"plan=-m {tiny_moe} -c 1024 -np 1 -t 2 -tb 2 -ub 128 -b 256")
    alt = parse_config_option(f"alt=LLAMA_SERVER={other} {OFFLOAD_ENV}=64 -m {tiny_moe} -c 1024 -np 1 -t 1")
    assert alt.server == str(other) and alt.env == {OFFLOAD_ENV: "64"}
    configs = build_configs(plan, ["plan", "threads-sweep"], thread_values=[1]) + [alt]
    w = Workload(pp=(8,), pp_reps=1, tg_depths=(0,), tg_tokens=4, concurrency=(), warmup=False)
    data = run_bench(configs, llama_server_path, tmp_path / "out", _opts(rounds=1, workload=w,
                     prime_page_cache=False), progress=Progress(), charts=False)
    runs = {r["config"]: r for r in data["runs"]}
    assert {n: r["status"] for n, r in runs.items()} == {"plan": "ok", "threads1": "ok", "alt": "ok"}
    assert runs["alt"]["argv"][0] == str(other) and runs["plan"]["argv"][0] == llama_server_path
    assert runs["alt"]["argv"][-2:] == ["-lv", "4"]
    t = runs["threads1"]["argv"]
    assert t[0] == llama_server_path and t[t.index("-t") + 1] == "1" and t[t.index("-tb") + 1] == "2"
    assert data["config_servers"]["alt"]["binary"] == str(other) and "plan" not in data["config_servers"]
    assert next(c for c in data["configs"] if c["name"] == "alt")["server"] == str(other)
    with pytest.raises(Exception, match="does not exist"):
        run_bench([replace(alt, server=str(tmp_path / "nope"))], llama_server_path, tmp_path / "out2",
                  _opts(rounds=1, workload=w), progress=Progress(), charts=False)
    assert _servers_left() == []


def test_an_interrupt_while_stopping_still_stops_the_server():
    from orchestrator.bench.session import _stop_server

    class Proc:
        calls = 0

        def stop(self, grace):
            Proc.calls += 1
            if Proc.calls == 1:
                raise KeyboardInterrupt       # Ctrl-C / SIGTERM lands inside the first stop

    with pytest.raises(KeyboardInterrupt):
        _stop_server(Proc(), 1.0)
    assert Proc.calls == 2


def test_an_interrupt_during_a_server_start_is_held_until_the_start_returned():
    from orchestrator.sigutil import interrupts_held

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGTERM)     # lands "between fork and exec"
                time.sleep(0.05)
                done.append("start returned")            # the process object would exist now
        assert done == ["start returned"]
        assert signal.getsignal(signal.SIGTERM) is raise_interrupt
        with interrupts_held():                         # nothing held: nothing raised
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
