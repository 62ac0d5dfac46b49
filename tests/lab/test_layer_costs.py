"""lab/bench/layer_costs.py on a recorded CPU run of lab/device/run.sh's layer-costs step (real llama-bench on
--scale 0.1 cuts of every family), the plan's per-layer prediction it compares with, its refusal of bad input; and
the step itself run for real on the CPU build."""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lab" / "bench" / "layer_costs.py"
RUN = REPO / "lab" / "device" / "run.sh"
RECORDED = REPO / "tests" / "fixtures" / "layer-costs" / "cpu-scale0.1"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
FAMILIES = {"gpt-oss-20b (synthetic, scale 0.1), experts MXFP4", "gpt-oss-20b (synthetic, scale 0.1), experts Q4_0",
            "Qwen3-30B-A3B (synthetic, scale 0.1), experts Q4_0", "DeepSeek-V3 (synthetic, scale 0.1), experts Q4_0",
            "GLM-4.5-Air (synthetic, scale 0.1), experts Q4_0", "gpt-oss-120b (synthetic, scale 0.1), experts MXFP4"}


def _script(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=ENV,
                          cwd=REPO, timeout=120, **kw)


def _report(d: Path) -> dict:
    res = _script("report", d, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _unpacked(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    for name in ("layer-costs.jsonl", "models.jsonl"):
        (d / name).write_bytes(lzma.decompress((RECORDED / (name + ".xz")).read_bytes()))
    return d


def test_every_family_has_positive_slopes_and_the_plans_per_layer_constant():
    from orchestrator.plan import rates as R

    rep = _report(RECORDED)                    # the step's directory as recorded, compressed
    assert {f["family"] for f in rep["families"]} == FAMILIES
    sloped = 0
    for fam in rep["families"]:
        for t in fam["tests"]:
            assert t["device"] == "CPU" and all(s >= 3 for s in t["samples"])
            if t["variant"] != "default" or "experts Q4_0" in fam["family"] and "gpt-oss" in fam["family"]:
                assert "slope_s" not in t and len(t["layers"]) == 1     # one depth: nothing to take a slope of
                continue
            sloped += 1
            assert t["layers"][0] < t["layers"][1]
            assert t["slope_s"] > 0 and t["pred_slope_s"] > t["pred_slope_bare_s"] > 0
            assert len(t["round_slopes_s"]) == 3
            # the plan's per-layer constant on the CPU (the recorded rows ran one thread): CPU_LAYER_OVERHEAD_S
            # (tg), CPU_PP_LAYER_TOKEN_S for each of the prompt's 64 tokens (pp)
            const = t["pred_slope_s"] - t["pred_slope_bare_s"]
            want = R.CPU_LAYER_OVERHEAD_S if t["test"] == "tg32" else 64 * R.CPU_PP_LAYER_TOKEN_S
            assert const == pytest.approx(want, rel=1e-6)
    assert sloped == 2 * 5                      # tg and pp of the five families with two cuts
    e = {(x["test"], tuple(x["experts"]), x["layers"]) for x in rep["expert_types"]}
    assert e == {("pp64", ("MXFP4", "Q4_0"), 24), ("tg32", ("MXFP4", "Q4_0"), 24)}
    g = {(x["family"].split(" ")[0], x["layers"], x["test"]) for x in rep["graphs"]}
    assert g == {("gpt-oss-20b", 24, "pp64"), ("gpt-oss-20b", 24, "tg32"), ("Qwen3-30B-A3B", 48, "pp64"),
                 ("Qwen3-30B-A3B", 48, "tg32")}
    text = _script("report", RECORDED)
    assert text.returncode == 0
    for fam in FAMILIES:
        assert f"\n{fam}\n" in f"\n{text.stdout}"
    assert "CUDA graphs off" in text.stdout and "expert types at the same depth" in text.stdout


def test_gpu_rows_are_predicted_from_the_data_sheet(tmp_path):
    """The same runs as if on an H200: the plan's slope is each added layer's bytes at the data sheet's bandwidth
    x GPU_TG_EFFICIENCY, plus GPU_LAYER_OVERHEAD_S."""
    from orchestrator.plan import rates as R

    d = _unpacked(tmp_path)
    rows = [json.loads(x) for x in (d / "layer-costs.jsonl").read_text().splitlines()]
    (d / "layer-costs.jsonl").write_text("".join(json.dumps({**r, "gpu_info": "NVIDIA H200", "n_gpu_layers": 99})
                                                 + "\n" for r in rows))
    models = {m["file"]: m for m in map(json.loads, (d / "models.jsonl").read_text().splitlines())}
    rep = _report(d)
    bw = R.gpu_memory_bandwidth("NVIDIA H200")[0]
    fam = next(f for f in rep["families"] if f["family"].startswith("Qwen3-30B-A3B"))
    tg = next(t for t in fam["tests"] if t["test"] == "tg32" and t["variant"] == "default")
    assert tg["device"] == "NVIDIA H200"
    c = models["lc-qwen3-30b-a3b-48l.gguf"]["costs"]
    per_layer = c["layer_always"][-1] + c["layer_experts"][-1] * c["n_expert_used"] / c["n_expert"]
    assert tg["pred_slope_bare_s"] == pytest.approx(per_layer / (bw * R.GPU_TG_EFFICIENCY), rel=1e-6)
    assert tg["pred_slope_s"] - tg["pred_slope_bare_s"] == pytest.approx(R.GPU_LAYER_OVERHEAD_S, rel=1e-6)


def _bad(tmp_path: Path, d: Path) -> str:
    res = _script("report", d)
    assert res.returncode == 1 and res.stdout == "" and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path):
    assert _bad(tmp_path, tmp_path / "nowhere") == f"{tmp_path / 'nowhere'}: not a directory"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _bad(tmp_path, empty).startswith(f"{empty}: no models.jsonl")
    d = _unpacked(tmp_path)
    rows = (d / "layer-costs.jsonl").read_text().splitlines()
    (d / "layer-costs.jsonl").write_text(rows[0] + "\n{not json\n")
    assert _bad(tmp_path, d) == f"{d / 'layer-costs.jsonl'}: line 2 is not JSON (Expecting property name enclosed " \
                                "in double quotes)"
    other = json.loads(rows[0])
    other["model_filename"] = "/models/elsewhere.gguf"
    (d / "layer-costs.jsonl").write_text(rows[0] + "\n" + json.dumps(other) + "\n")
    assert _bad(tmp_path, d) == f"{d / 'layer-costs.jsonl'}: line 2: elsewhere.gguf has no description in models.jsonl"
    del other["samples_ts"]
    (d / "layer-costs.jsonl").write_text(json.dumps(other) + "\n")
    assert _bad(tmp_path, d) == f"{d / 'layer-costs.jsonl'}: line 1 is not a llama-bench row (no samples_ts)"
    (d / "layer-costs.jsonl").write_text("")
    assert _bad(tmp_path, d) == f"{d / 'layer-costs.jsonl'}: no llama-bench rows"
    res = _script("describe", tmp_path / "missing.gguf")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and "missing.gguf" in res.stderr


@pytest.mark.integration
def test_the_device_step_on_the_cpu_build(tmp_path, llama_server_path):
    """run.sh layer-costs with the CPU llama-bench: three cuts of gpt-oss-20b (12, 24, 24 with Q4_0 experts) and the
    24 without CUDA graphs, interleaved over two rounds, described, removed afterwards, and reported."""
    bench = Path(llama_server_path).parent / "llama-bench"
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DEVICE_WORK": str(work),
           "OUT": str(out), "RUN_SECONDS": "400", "LAYER_COSTS_BENCH": str(bench), "LAYER_COSTS_NGL": "0",
           "LAYER_COSTS_SCALE": "0.05", "LAYER_COSTS_TESTS": "-p 16 -n 4", "LAYER_COSTS_REPS": "1",
           "LAYER_COSTS_ROUNDS": "2", "LAYER_COSTS_ARGS": "-t 1"}
    res = subprocess.run(["bash", str(RUN), "layer-costs=gpt-oss"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    o = work / "out" / "layer-costs-gpt-oss"
    rows = [json.loads(x) for x in (o / "layer-costs.jsonl").read_text().splitlines()]
    runs = [(r["round"], Path(r["model_filename"]).name, r["variant"]) for r in rows if r["n_gen"]]
    cuts = ["lc-gpt-oss-20b-12l.gguf", "lc-gpt-oss-20b-24l.gguf", "lc-gpt-oss-20b-24l-q4_0x.gguf"]
    assert runs == [(k, c, "default") for c in cuts for k in (1,)] + [(1, cuts[1], "graphs-off")] + \
        [(2, c, "default") for c in cuts] + [(2, cuts[1], "graphs-off")]
    models = [json.loads(x) for x in (o / "models.jsonl").read_text().splitlines()]
    assert [(m["file"], m["n_layers"], m["shape"]["experts"]) for m in models] == \
        [(cuts[0], 12, "MXFP4"), (cuts[1], 24, "MXFP4"), (cuts[2], 24, "Q4_0")]
    assert not list((work / "models").glob("lc-*.gguf"))          # nothing left on the disk
    report = (o / "report.txt").read_text()
    assert "gpt-oss-20b (synthetic, scale 0.05), experts MXFP4" in report and "per layer per token" in report
    assert "CUDA graphs off" in report
    assert json.loads((o / "report.json").read_text())["graphs"]
    assert (out / "device.tgz").is_file()


def test_the_step_refuses_an_unknown_family_and_skips_what_does_not_fit(tmp_path):
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DEVICE_WORK": str(tmp_path / "w"),
           "OUT": str(tmp_path), "RUN_SECONDS": "60", "LAYER_COSTS_BENCH": shutil.which("true") or "/bin/true"}
    res = subprocess.run(["bash", str(RUN), "layer-costs=qwen3,nope"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    assert "layer-costs: unknown family 'nope' (gpt-oss, qwen3, deepseek, glm, gpt-oss-120b)" in res.stdout
    assert not list((tmp_path / "w").rglob("*.jsonl"))             # refused before anything ran
    res = subprocess.run(["bash", str(RUN), "layer-costs=deepseek"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    assert "layer-costs: no time left for deepseek (~82 s)" in res.stdout
    assert not list((tmp_path / "w" / "models").glob("*.gguf"))
    # W1 on the disk already: qwen3, whose deeper cut it is, goes first
    w1 = tmp_path / "w" / "models" / "qwen3-30b-a3b-q4_0.gguf"
    w1.write_bytes(b"")
    res = subprocess.run(["bash", str(RUN), "layer-costs=gpt-oss,glm,qwen3"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    skipped = [line.split("no time left for ")[1].split(" ")[0] for line in res.stdout.splitlines()
               if "no time left for" in line]
    assert skipped == ["qwen3", "gpt-oss", "glm"] and w1.exists()
