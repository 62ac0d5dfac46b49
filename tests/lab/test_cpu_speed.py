"""lab/cpu_speed.py measures for real here (llama-bench on a tiny model, the probe's bandwidth) and fits what it
measured; lab/device/cpu-calib.sh, which runs it on the GPU machine, refuses to start without what it needs
there. The constants fitted on the recorded runs are checked in tests/lab/test_calibration.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.integration
def test_measure_then_fit_on_this_machine(tmp_path, llama_server_path):
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_llama import write_tiny_llama

    bench = Path(llama_server_path).parent / "llama-bench"
    a = write_tiny_llama(tmp_path / "a.gguf")
    b = write_tiny_llama(tmp_path / "b.gguf", n_layer=4)
    out = tmp_path / "runs.json"
    res = subprocess.run([sys.executable, "-m", "lab.cpu_speed", "measure", "--bench", str(bench), "--model", str(a),
                          "--model", str(b), "--threads", "1", "--rounds", "2", "--reps", "1", "--gen", "8",
                          "--prompts", "8", "--out", str(out)], capture_output=True, text=True, env=ENV, cwd=REPO,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "orchestrator.cpu-speed/1" and doc["node_threads"] >= 1
    assert all(v > 1e8 for v in doc["host_bw"].values()) and str(doc["node_threads"]) in doc["host_bw_after"]
    assert [m["n_layers"] for m in doc["models"]] == [2, 4]
    # every configuration once per round, the order rotated from one round to the next
    order = [(r["round"], r["model"]) for r in doc["runs"] if r["n_gen"]]
    assert order == [(0, "a.gguf"), (0, "b.gguf"), (1, "b.gguf"), (1, "a.gguf")]
    assert all(r["argv"][0] == "llama-bench" and "jsonl" in r["argv"] and r["samples_ts"] for r in doc["runs"])
    fit = subprocess.run([sys.executable, "-m", "lab.cpu_speed", "fit", str(out)], capture_output=True, text=True,
                         env=ENV, cwd=REPO, timeout=300)
    assert fit.returncode == 0, fit.stderr
    assert "fitted on 2 generation points" in fit.stdout and "fitted on 2 prompt points" in fit.stdout
    assert fit.stdout.count("a.gguf") == 2 and fit.stdout.count("b.gguf") == 2


def test_fit_refuses_a_file_that_is_not_a_record(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"schema": "something else"}')
    res = subprocess.run([sys.executable, "-m", "lab.cpu_speed", "fit", str(bad)], capture_output=True, text=True,
                         env=ENV, cwd=REPO, timeout=60)
    assert res.returncode != 0 and res.stderr.strip() == f"{bad}: not a lab.cpu_speed record (schema 'something else')"


def test_device_script_parses_and_refuses_without_its_bundle(tmp_path):
    script = REPO / "lab" / "device" / "cpu-calib.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    (tmp_path / "lab" / "device").mkdir(parents=True)
    shutil.copy2(script, tmp_path / "lab" / "device" / "cpu-calib.sh")
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(tmp_path / "lab" / "device" / "cpu-calib.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(out)}, timeout=60)
    assert res.returncode == 2
    assert res.stdout.strip().endswith("cpu-calib.sh: .devbundle/ is missing (see the head of this script)")
    (tmp_path / ".devbundle").mkdir()
    (tmp_path / ".devbundle" / "on-device.sh").write_text("")
    res = subprocess.run(["bash", str(tmp_path / "lab" / "device" / "cpu-calib.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(out)}, timeout=60)
    assert res.returncode == 2 and ".devcpu/llama-server.xz is missing" in res.stdout


@pytest.mark.integration
def test_serve_runs_the_plans_own_argv_and_reads_its_timings(tmp_path, llama_server_path):
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf")
    topo = tmp_path / "t.yaml"
    topo.write_text(f"model: {{path: {model}, context: 512}}\nnodes: [{{name: here, gpus: none}}]\n"
                    "gateway: {port: 18580}\nworkers: {port_base: 18581}\n")
    env = {**ENV, "LLAMA_SERVER": llama_server_path}
    plan = subprocess.run([sys.executable, "-m", "orchestrator", "plan", str(topo), "--json"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert plan.returncode == 0, plan.stderr
    (tmp_path / "plan.json").write_text(plan.stdout)
    out = tmp_path / "serve.json"
    res = subprocess.run([sys.executable, "-m", "lab.cpu_speed", "serve", str(tmp_path / "plan.json"), "--rounds", "2",
                          "--tokens", "8", "--out", str(out)], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    assert doc["argv"] == json.loads(plan.stdout)["workers"][0]["argv"]
    assert len(doc["rounds"]) == 2 and all(r["predicted_n"] == 8 and r["tg"] > 0 for r in doc["rounds"])
    assert "tg over 8 tokens, 2 rounds: median" in res.stdout
