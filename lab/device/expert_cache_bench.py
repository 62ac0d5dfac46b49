"""Expert cache against the same placement without it, against `--fit on --load-mode none`, and a grid of
CPU expert layers x cache size, on one GPU held to a VRAM budget. Run on the GPU machine (lab/device/expert-cache.sh).

Each configuration is one llama-server start, measured through its HTTP API the way a user feels it:
- prompt speed: pp512 and pp4096 (random token ids, ``cache_prompt: false``, llama-server's own timings);
- generation: 128 tokens after a 16-token prompt, **sampled** (temperature 1, a seed per request), so the token
  stream does not loop as greedy decoding of a random-weight model does; the routing locality then comes from the
  model alone (``synth-model --locality``);
- time to first token p50/p95 of streamed requests with 128-token prompts;
- the expert cache's hit rate during generation (its /metrics counters), peak VRAM, GPU temperature and power
  during generation (nvidia-smi, sampled every 0.2 s).
Configurations are interleaved round by round (serpentine order) and the plan runs twice per round (A/A control).
Writes one JSON line per run to --out and prints a table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LAYER_EXPERT_MIB = 324.0   # W1 (Qwen3-30B-A3B shape, q4_0): one layer's routed experts, 3 x 128 x 0.84 MiB


@dataclass
class Config:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _metrics(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    return {k: float(v) for k, v in re.findall(r"^llamacpp:(\w+) (\S+)$", text, re.M)}


class GpuSampler(threading.Thread):
    """nvidia-smi every 0.2 s: memory used (MiB), temperature (C), power (W), with a time stamp."""

    def __init__(self, gpu: int):
        super().__init__(daemon=True)
        self.gpu = gpu
        self.samples: list[tuple[float, float, float, float]] = []
        self.stop_event = threading.Event()
        self.baseline = 0.0

    def settle(self, seconds: float = 1.5) -> None:
        """Record the memory in use now (ballast held, no server) as the baseline of every peak."""
        time.sleep(seconds)
        recent = [s[1] for s in self.samples[-5:]]
        self.baseline = min(recent) if recent else 0.0

    def run(self) -> None:
        argv = ["nvidia-smi", f"--id={self.gpu}", "--query-gpu=memory.used,temperature.gpu,power.draw",
                "--format=csv,noheader,nounits", "-lms", "200"]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if self.stop_event.is_set():
                    break
                try:
                    mem, temp, power = (float(x) for x in line.split(","))
                except ValueError:
                    continue
                self.samples.append((time.monotonic(), mem, temp, power))
        finally:
            proc.terminate()
            proc.wait()

    def window(self, t0: float, t1: float) -> list[tuple[float, float, float, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]


class Server:
    def __init__(self, binary: str, cfg: Config, log: Path, gpu: int):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), **cfg.env)
        argv = [binary, *cfg.args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = log
        self.logf = open(log, "w")
        self.logf.write("$ " + " ".join(argv) + "\n" + json.dumps(cfg.env) + "\n")
        self.logf.flush()
        self.proc = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float = 600) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-1500:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server not healthy in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.logf.close()


def _tokens(rng: random.Random, n: int, n_vocab: int) -> list[int]:
    return [rng.randrange(10, max(11, int(n_vocab * 0.9))) for _ in range(n)]


def _ttft(url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "n_predict": 4, "cache_prompt": False, "stream": True, "temperature": 1.0,
            "seed": 1, "ignore_eos": True}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and '"content"' in line:
                return (time.monotonic() - t0) * 1000.0
    return float("nan")


def measure(binary: str, cfg: Config, out_dir: Path, gpu: int, seed: int, tg_reps: int,
            ttft_n: int, sampler: GpuSampler) -> dict:
    rng = random.Random(seed)
    srv = Server(binary, cfg, out_dir / f"{cfg.name}-{seed}.log", gpu)
    rec: dict = {"config": cfg.name, "seed": seed, "args": cfg.args, "env": cfg.env}
    t_start = time.monotonic()
    baseline = sampler.baseline     # the ballast and whatever else held the GPU before any start
    try:
        rec["load_s"] = round(srv.wait_healthy(), 2)
        with urllib.request.urlopen(srv.url + "/v1/models", timeout=10) as r:
            n_vocab = int(json.loads(r.read())["data"][0]["meta"]["n_vocab"])
        _post(srv.url + "/completion", {"prompt": _tokens(rng, 64, n_vocab), "n_predict": 8, "cache_prompt": False,
                                        "temperature": 1.0, "seed": 7, "ignore_eos": True})       # warm-up
        for n, reps in ((512, 2), (4096, 1)):
            vals = []
            for _ in range(reps):
                d = _post(srv.url + "/completion", {"prompt": _tokens(rng, n, n_vocab), "n_predict": 1,
                                                    "cache_prompt": False, "temperature": 0.0})
                vals.append(d["timings"]["prompt_per_second"])
            rec[f"pp{n}"] = statistics.median(vals)
        m0 = _metrics(srv.url)
        t0 = time.monotonic()
        tg = []
        for i in range(tg_reps):
            d = _post(srv.url + "/completion", {"prompt": _tokens(rng, 16, n_vocab), "n_predict": 128,
                                                "cache_prompt": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                "min_p": 0.0, "seed": seed * 1000 + i, "ignore_eos": True})
            tg.append(d["timings"]["predicted_per_second"])
        t1 = time.monotonic()
        m1 = _metrics(srv.url)
        rec["tg"] = statistics.median(tg)
        rec["tg_samples"] = [round(x, 2) for x in tg]
        look = m1.get("moe_cache_lookups_total", 0) - m0.get("moe_cache_lookups_total", 0)
        hits = m1.get("moe_cache_hits_total", 0) - m0.get("moe_cache_hits_total", 0)
        rec["hit_rate"] = round(hits / look, 4) if look else None
        rec["cache_slots"] = m1.get("moe_cache_slots")
        rec["cache_bytes"] = m1.get("moe_cache_bytes")
        rec["uploaded_mib_per_token"] = round((m1.get("moe_cache_uploaded_bytes_total", 0)
                                               - m0.get("moe_cache_uploaded_bytes_total", 0))
                                              / 2**20 / (128 * tg_reps), 2) if look else None
        win = sampler.window(t0, t1)
        if win:
            rec["gpu_temp_c"] = round(statistics.mean(s[2] for s in win), 1)
            rec["gpu_power_w"] = round(statistics.mean(s[3] for s in win), 1)
        ttfts = sorted(_ttft(srv.url, _tokens(rng, 128, n_vocab)) for _ in range(ttft_n))
        rec["ttft_p50_ms"] = round(statistics.median(ttfts), 1)
        rec["ttft_p95_ms"] = round(ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))], 1)
    except Exception as err:  # a configuration that fails (out of memory, ...) is a result too
        rec["error"] = f"{type(err).__name__}: {err}"[:600]
    finally:
        t_end = time.monotonic()
        srv.stop()
    mem = [s[1] for s in sampler.window(t_start, t_end)]
    rec["vram_peak_mib"] = round(max(mem) - baseline) if mem else None
    return rec


def plan_config(model: str, cpu_layers: int, cache_mib: int, ub: int, threshold: int, max_batch: int) -> Config:
    layers = "|".join(str(i) for i in range(cpu_layers))
    args = ["-m", model, "-c", "8192", "-np", "1", "-ngl", "999", "--fit", "off", "-t", "16", "-tb", "16",
            "-b", "2048", "-ub", str(ub), "-fa", "on", "--load-mode", "none", "--metrics", "--no-warmup"]
    if cpu_layers:
        args += ["-ot", rf"blk\.({layers})\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"]
    if cache_mib:
        args += ["--moe-cache-mib", str(cache_mib), "--moe-cache-max-batch", str(max_batch)]
    name = f"ncmoe{cpu_layers}" + (f"+cache{cache_mib}" if cache_mib else "")
    return Config(name, args, {"GGML_OP_OFFLOAD_MIN_BATCH": str(threshold)})


def fit_pinned(model: str) -> Config:
    return Config("fit-pinned", ["-m", model, "-c", "8192", "-np", "1", "--fit", "on", "--fit-ctx", "8192",
                                 "--load-mode", "none", "-t", "16", "-tb", "16", "--metrics", "--no-warmup"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", default="", help="what the model is (its routing locality), for the table")
    ap.add_argument("--budget-gib", type=float, required=True, help="VRAM the configurations may use (ballast)")
    ap.add_argument("--plan-layers", type=int, required=True, help="the plan's CPU expert layers at this budget")
    ap.add_argument("--grid", default="4,8,12", help="extra CPU expert layers whose VRAM goes to the cache")
    ap.add_argument("--bare", default="", help="extra CPU expert layers also run without the cache (the same "
                    "placement, for prompt speed)")
    ap.add_argument("--ub", type=int, default=2048)
    ap.add_argument("--threshold", type=int, default=24, help="GGML_OP_OFFLOAD_MIN_BATCH")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tg-reps", type=int, default=3)
    ap.add_argument("--ttft", type=int, default=8)
    ap.add_argument("--no-fit", action="store_true")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=0, help="unix time after which no configuration starts")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from orchestrator.bench.ballast import VramBallast
    from orchestrator.units import GiB

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [plan_config(a.model, a.plan_layers, 0, a.ub, a.threshold, a.max_batch)]
    control = Config("plan-again", configs[0].args, configs[0].env)
    for extra in (int(x) for x in a.grid.split(",") if x):
        mib = int(extra * LAYER_EXPERT_MIB) - 64
        configs.append(plan_config(a.model, a.plan_layers + extra, mib, a.ub, a.threshold, a.max_batch))
    for extra in (int(x) for x in a.bare.split(",") if x):
        configs.append(plan_config(a.model, a.plan_layers + extra, 0, a.ub, a.threshold, a.max_batch))
    if not a.no_fit:
        configs.append(fit_pinned(a.model))
    configs.append(control)
    sampler = GpuSampler(a.gpu)
    sampler.start()
    results = []
    with open(out / "runs.jsonl", "a") as jf, VramBallast(int(a.budget_gib * GiB), gpus=[a.gpu]):
        sampler.settle()
        for r in range(a.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for cfg in order:
                if a.deadline and time.time() > a.deadline:
                    print(f"deadline: skipping {cfg.name} (round {r + 1})", flush=True)
                    continue
                rec = measure(a.server, cfg, out, a.gpu, 100 * r + len(results), a.tg_reps, a.ttft, sampler)
                rec.update(round=r + 1, budget_gib=a.budget_gib, label=a.label)
                results.append(rec)
                jf.write(json.dumps(rec) + "\n")
                jf.flush()
                print(json.dumps({k: rec.get(k) for k in ("config", "round", "pp512", "pp4096", "tg", "hit_rate",
                                                          "vram_peak_mib", "ttft_p50_ms", "error")}), flush=True)
    sampler.stop_event.set()
    print(f"\n{a.label} at {a.budget_gib:g} GiB (medians over rounds)")
    print("| config | pp512 | pp4096 | tg | hit rate | VRAM peak MiB | TTFT p50/p95 ms | temp C | power W |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cfg in configs:
        rs = [x for x in results if x["config"] == cfg.name and "error" not in x]
        if not rs:
            errs = [x.get("error") for x in results if x["config"] == cfg.name]
            print(f"| {cfg.name} | failed: {errs[:1]} |")
            continue

        def med(k):
            v = [x[k] for x in rs if x.get(k) is not None]
            return statistics.median(v) if v else None
        fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"   # noqa: E731
        print(f"| {cfg.name} | {fmt(med('pp512'), 0)} | {fmt(med('pp4096'), 0)} | {fmt(med('tg'))} | "
              f"{fmt(med('hit_rate'), 3)} | {fmt(med('vram_peak_mib'), 0)} | {fmt(med('ttft_p50_ms'))}/"
              f"{fmt(med('ttft_p95_ms'))} | {fmt(med('gpu_temp_c'))} | {fmt(med('gpu_power_w'))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
