"""`orchestrator bench` on the command line: a real run, dry run, plan JSON, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[2]


def _run(argv, capsys):
    rc = main(["bench", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.integration
def test_cli_runs_plan_and_fit_and_prints_json(tmp_path, tiny_moe, llama_server_path, capsys):
    rc, out, err = _run(["--server", llama_server_path, "--config", f"plan=-m {tiny_moe} -c 512 -np 1 -t 1",
                         "--configs", "plan,fit", "--rounds", "1", "--pp", "16,64", "--pp-reps", "1",
                         "--tg-depths", "0", "--tg-tokens", "4", "--concurrency", "none",
                         "--out", str(tmp_path / "o"), "--json", "--progress", "plain", "--no-charts"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert set(d["summary"]) == {"plan", "fit"} and d["summary"]["fit"]["loaded"] == 1
    assert d["summary"]["plan"]["metrics"]["pp64"]["median"] > 0
    assert not [k for k in d["summary"]["plan"]["metrics"] if k.startswith("ttft")]      # --concurrency none
    assert any(r["kind"] == "plan/fit" and r["metric"] == "pp64" for r in d["ratios"])
    assert "1/2 round 1/1 plan: starting" in err and "2/2 round 1/1 fit: loaded in" in err
    assert (tmp_path / "o" / "bench.json").is_file() and (tmp_path / "o" / "bench.txt").is_file()


def test_dry_run_lists_configs_from_plan_json(tmp_path, capsys):
    plan = {"workers": [{"args": ["-m", "/m/q30.gguf", "-c", "8192", "-np", "1", "-ngl", "999", "-ot",
                                  r"blk\.(0|1)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU", "--fit", "off",
                                  "-ub", "2048", "-b", "2048", "--load-mode", "none"],
                         "env": {"GGML_OP_OFFLOAD_MIN_BATCH": "48"}, "cpu_expert_layers": [0, 1]}]}
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    rc, out, err = _run(["--plan-json", str(p), "--server", "/bin/true", "--dry-run", "--ub", "512,2048",
                         "--rounds", "3"], capsys)
    assert rc == 0, err
    names = [ln.split()[0] for ln in out.splitlines()[1:]]
    assert names[:4] == ["plan", "fit", "fit-pinned", "cpu-moe"]
    assert "ncmoe1-ub512-mmap" in names and "ncmoe3-ub2048-pinned" in names and "offload-never" in names
    assert len(names) == 4 + 3 * 2 * 2 + 6                           # offload 12, 24, 32, 96, 192, never
    assert out.splitlines()[0].startswith(f"{len(names)} configurations × 3 rounds = {len(names) * 3} server starts")
    assert "GGML_OP_OFFLOAD_MIN_BATCH=12 /bin/true" in out            # offload12 = 48 / 4


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to benchmark"),
    (["/nonexistent/topo.yaml"], "/nonexistent/topo.yaml"),
    (["topo.yaml", "--config", "plan=-m x"], "give the plan one way"),
    (["--set", "workers.threads=2", "--config", "a=-m x"], "--set changes a topology"),
    (["--config", "noflags"], "expected NAME='llama-server flags'"),
    (["--config", "plan=-m x", "--configs", "plan,bogus"], "unknown bench configuration group 'bogus'"),
    (["--configs", "fit", "--config", "a=-m x"], "--configs derives from the plan"),
    (["--config", "a=-m x", "--rounds", "0"], "--rounds must be at least 1"),
    (["--config", "a=-m x", "--vram-budget", "12 potatoes"], "--vram-budget: unknown size unit"),
    (["--plan-json", "/nonexistent/plan.json"], "--plan-json /nonexistent/plan.json: No such file"),
    (["--config", "plan=-m x -ngl 9", "--config", "fit=-m y"], "--config fit: that name is taken"),
    (["--config", "plan=-m x"], "give the sweep's values (--ncmoe N,...)"),
    (["--config", "a=-m x", "--server", "/nonexistent/llama-server"], "does not exist or is not executable"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    rc, out, err = _run([*argv, "--out", str(tmp_path / "o")], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("orchestrator bench: error: ") and message in err, err
    assert not (tmp_path / "o").exists()


def test_bad_list_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--pp", "8,x"])
    assert e.value.code == 2 and "expected comma-separated integers" in capsys.readouterr().err


def test_bench_imports_without_gguf_pydantic_ray():
    """The GPU machine's python3 has numpy, psutil, nvidia-ml-py, pyyaml, aiohttp, matplotlib (and rich, sent along)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('gguf', 'pydantic', 'ray'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import orchestrator.bench as b, orchestrator.bench.session, orchestrator.bench.report as r\n"
        "import orchestrator.commands.bench as cb, argparse\n"
        "try:\n"
        "    cb._plan_from_topology(argparse.Namespace(topology='t.yaml'))\n"
        "except Exception as e:\n"
        "    assert type(e).__name__ == 'ConfigError' and 'missing here' in str(e), e\n"
        "from orchestrator.bench.progress import make_progress\n"
        "assert type(make_progress('auto')).__name__ == 'PlainProgress'\n"
        "import io; f = io.StringIO(); f.isatty = lambda: True\n"
        "r.print_tables({'summary': {}, 'ratios': []}, file=f)\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.integration
def test_sigterm_stops_the_server_and_keeps_the_results(tmp_path, tiny_moe, llama_server_path):
    import os
    import signal
    import time

    import psutil

    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "orchestrator", "bench", "--server", llama_server_path,
           "--config", f"a=-m {tiny_moe} -c 512 -np 1 -t 1", "--config", f"b=-m {tiny_moe} -c 512 -np 1 -t 1",
           "--rounds", "50", "--pp", "16", "--pp-reps", "1", "--tg-depths", "none", "--concurrency", "none",
           "--out", str(out), "--progress", "plain", "--no-charts", "--no-prime"]
    p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = []
            try:
                runs = json.loads((out / "bench.json").read_text()).get("runs", [])
            except (OSError, ValueError):
                pass
            if len(runs) >= 2:
                break
            time.sleep(0.1)
        assert len(runs) >= 2
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "orchestrator bench: interrupted" in err, (p.returncode, err[-2000:])
    data = json.loads((out / "bench.json").read_text())
    assert data["interrupted"] == "KeyboardInterrupt" and len(data["runs"]) >= 2 and "summary" in data
    left = []
    for q in psutil.process_iter(["cmdline", "status"]):
        if str(tiny_moe) in " ".join(q.info["cmdline"] or []) and q.info["status"] != psutil.STATUS_ZOMBIE:
            left.append((q.pid, q.info["status"], q.info["cmdline"]))
    assert left == [], left


def test_vram_budget_without_gpu_exits_2_and_leaves_nothing(tmp_path, tiny_moe, llama_server_path, capsys):
    from orchestrator.hardware.nvml import Nvml

    if Nvml.open() is not None:
        pytest.skip("this machine has a GPU: test_gpu_run_holds_the_budget... covers it")
    rc, out, err = _run(["--server", llama_server_path, "--config", f"a=-m {tiny_moe}", "--vram-budget", "1GiB",
                         "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "needs an NVIDIA GPU" in err and not (tmp_path / "o").exists()


def test_server_verbosity_option(capsys, tmp_path):
    rc, out, err = _run(["--config", "a=-m x", "--server-verbosity", "loud"], capsys)
    assert rc == 2 and "--server-verbosity: expected a number or 'none'" in err


@pytest.mark.integration
def test_topology_is_planned_like_up_and_measured(tmp_path, tiny_moe, llama_server_path, capsys):
    """The real planner (orchestrator.resolve, as `plan` and `up` use it) on this machine, then the bench."""
    topo = tmp_path / "t.yaml"
    topo.write_text(f"model: {{path: {tiny_moe}, context: 1024, parallel: 1}}\n"
                    f"backend: {{binary: {llama_server_path}}}\n"
                    "nodes: [{name: local}]\nworkers: {layout: machine}\n")
    rc, out, err = _run([str(topo), "--set", "workers.threads=1", "--configs", "plan,defaults,control", "--rounds", "1",
                         "--pp", "8,64", "--pp-reps", "1", "--tg-depths", "0", "--tg-tokens", "4", "--concurrency",
                         "none", "--out", str(tmp_path / "o"), "--json", "--progress", "none", "--no-charts"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert set(d["summary"]) == {"plan", "defaults", "plan-control"}
    assert all(s["loaded"] == 1 for s in d["summary"].values())
    # a plan on the CPU only: graded against its CPU alternative without a target, never against GPU targets
    kinds = {r["kind"] for r in d["ratios"]}
    assert "plan/best-cpu" in kinds and not kinds & {"plan/fit", "plan/best-sweep", "threshold/best"}
    assert all(r["target"] is None for r in d["ratios"] if r["kind"] == "plan/best-cpu")
    data = json.loads((tmp_path / "o" / "bench.json").read_text())
    plan = next(c for c in data["configs"] if c["name"] == "plan")
    assert "-t" in plan["args"] and plan["args"][plan["args"].index("-t") + 1] == "1"      # --set reached the plan
    assert plan["predicted"].get("tg", 0) > 0 and plan["params"]["n_layers"] == 4
    assert data["server_binary"] == llama_server_path
    assert any(r["kind"] == "predicted/measured" for r in d["ratios"])
    # what the plan was made from travels with the results: its decisions (threads, as --set asked) and the
    # machine's measured bandwidths (none measured on a machine without GPUs and no probe cache)
    ctx = data["plan_context"]
    assert ctx["topology"] == str(topo) and ctx["node"] == "local" and "bandwidth" in ctx
    assert any(what == "threads" and value.startswith("-t 1") for what, value, _why in ctx["decisions"])


def _cpu_topology(tmp_path, tiny_moe, llama_server_path, replicas: int = 2):
    topo = tmp_path / "cpu.yaml"
    topo.write_text(f"model: {{path: {tiny_moe}, context: 1024, parallel: 1}}\n"
                    f"backend: {{binary: {llama_server_path}}}\n"
                    f"nodes: [{{name: local, gpus: none}}]\nworkers: {{replicas: {replicas}}}\n")
    return topo


def test_a_plan_on_the_cpu_gets_cpu_alternatives(tmp_path, tiny_moe, llama_server_path, capsys):
    """No GPU: llama.cpp's defaults, other -ub, the NUMA policies the plan did not choose and one replica over the
    machine; none of the GPU-only groups (fit, --n-cpu-moe sweeps, op-offload thresholds)."""
    topo = _cpu_topology(tmp_path, tiny_moe, llama_server_path)
    rc, out, err = _run([str(topo), "--dry-run", "--ub", "256,512"], capsys)
    assert rc == 0, err
    lines = out.splitlines()[1:]
    names = {ln.split()[0]: ln for ln in lines}
    assert {"plan", "defaults", "ub256", "numa-none", "numa-interleave", "replicas1"} <= set(names), out
    assert not [n for n in names if n.startswith(("fit", "cpu-moe", "ncmoe", "offload", "cache"))], out
    assert "numactl" not in names["defaults"] and " -t " not in names["defaults"]
    assert "numactl" not in names["numa-none"] and "--interleave=" in names["numa-interleave"]
    assert "--numa" not in names["numa-interleave"]            # numactl's binding, as the plan keeps it
    plan_t = names["plan"].split(" -t ")[1].split()[0]
    one_t = names["replicas1"].split(" -t ")[1].split()[0]
    assert int(one_t) >= int(plan_t)              # one worker gets at least one replica's threads


def test_a_gpu_only_group_on_a_cpu_plan_is_one_line(tmp_path, tiny_moe, llama_server_path, capsys):
    topo = _cpu_topology(tmp_path, tiny_moe, llama_server_path, replicas=1)
    rc, out, err = _run([str(topo), "--dry-run", "--configs", "plan,offload-sweep"], capsys)
    assert rc == 2
    assert err.strip().splitlines() == [
        "orchestrator bench: error: --configs offload-sweep: compares GPU placements, and the plan runs on the CPU "
        "only (CPU alternatives: defaults, threads-sweep, ub-sweep, numa-sweep)"]


@pytest.mark.integration
def test_a_deployment_of_replicas_is_measured_as_the_deployment(tmp_path, tiny_moe, llama_server_path, capsys,
                                                                 monkeypatch):
    """Two CPU replicas: the plan is both servers serving at once (the requests spread over them), against one
    server over the machine under the same load; every row and ratio says what it runs as; the replica row is one
    replica alone. No --out: the results go under the state folder, nothing into the working directory."""
    import os

    topo = _cpu_topology(tmp_path, tiny_moe, llama_server_path)
    state, cwd = tmp_path / "state", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("ORCHESTRATOR_STATE", str(state))
    monkeypatch.chdir(cwd)
    rc, out, err = _run([str(topo), "--configs", "plan,defaults", "--rounds", "1", "--pp", "64", "--pp-reps", "1",
                         "--tg-depths", "0", "--tg-tokens", "8", "--tg-reps", "1", "--concurrency", "none",
                         "--load-prompt", "32", "--json", "--progress", "none", "--no-charts", "--no-prime"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert list(cwd.iterdir()) == []                                             # nothing in the working directory
    assert Path(d["out"]).parent == state / "bench" and (Path(d["out"]) / "bench.json").is_file()
    data = json.loads((Path(d["out"]) / "bench.json").read_text())
    cpus = len(os.sched_getaffinity(0))
    configs = {c["name"]: c for c in data["configs"]}
    assert set(configs) == {"plan", "replica", "defaults"}
    plan = configs["plan"]
    assert len(plan["members"]) == 2 and plan["params"]["load_streams"] == 2          # 2 replicas × 1 slot
    assert configs["replica"]["params"]["scope"].startswith("one replica of 2, on ")
    assert configs["defaults"]["params"]["scope"] == f"one server on {cpus} core{'s' * (cpus > 1)}"
    run = next(r for r in data["runs"] if r["config"] == "plan")
    ports = {a[a.index("--port") + 1] for a in run["replica_argv"]}
    assert len(run["replica_argv"]) == 2 and len(ports) == 2                        # both served, side by side
    s = data["summary"]
    for name in ("plan", "replica", "defaults"):                                  # the same load on every one
        assert s[name]["metrics"]["load_x2"]["median"] > 0 and s[name]["metrics"]["load_req_x2"]["n"] == 2
    # the deployment's memory is both servers' (the sampler follows every replica); the replica's is one
    assert s["plan"]["metrics"]["rss_peak"]["median"] > 1.5 * s["replica"]["metrics"]["rss_peak"]["median"]
    load = next(r for r in d["ratios"] if r["kind"] == "plan/best-cpu" and r["metric"] == "load_x2")
    assert load["compares"].startswith(f"2 replicas × 1 core vs one server on {cpus} core")
    assert load["compares"].endswith("the same 2 requests at once, aggregate")
    per_request = next(r for r in d["ratios"] if r["kind"] == "plan/best-cpu" and r["metric"] == "pp64")
    assert "one request at a time: each served by one replica of 2" in per_request["compares"]
    assert per_request["fewer_cores"] == f"1 core against {cpus}"       # said, not shown as a plain loss
    memory = [r for r in d["ratios"] if r["kind"] == "predicted/measured" and r["metric"] == "rss_peak"]
    assert all(r["other_config"] == "replica" for r in memory)                  # predicted per server
    assert data["comparison"].startswith("plan = the deployment, 2 replicas × 1 core, all replicas serving at once")
    text = (Path(d["out"]) / "bench.txt").read_text()
    assert "runs as" in text and "2 replicas × 1 core" in text and data["comparison"] in " ".join(text.split())
