"""``run_bench``: start each configuration's llama-server in turn, measure it, stop it; R interleaved rounds.

Design (see docs/bench.md):
- One configuration at a time: configurations compete for the same VRAM and cores, so they cannot run side by
  side. A deployment of several replicas is one configuration: all its servers run (and serve) together.
- Every round starts every configuration afresh (load, warm-up, measure, stop). Order is serpentine
  (A B C, C B A, A B C ...) so a slow drift of the machine (heat, other load) lands on every configuration's
  average position alike. A restart costs load time, but it is the honest unit: what ``up`` starts, measured
  from cold process state with the model file in the page cache (primed once before round 1, so the first
  configuration is not the only one that reads from disk).
- A configuration that fails to load, runs out of memory or crashes is recorded with llama-server's reason and
  the run goes on. The JSON is rewritten after every configuration: a run that is cut off (time budget,
  Ctrl-C, a lost machine) still leaves every finished measurement on disk.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from orchestrator.bench.configs import BenchConfig, has_flag
from orchestrator.bench.logparse import parse_server_log
from orchestrator.bench.measure import MeasureError, Workload, pp_reps, run_measure
from orchestrator.bench.progress import Progress, make_progress
from orchestrator.bench.report import render_text, write_charts, write_json
from orchestrator.fsutil import write_atomic
from orchestrator.bench.sampler import Nvml, ResourceSampler, gpu_free
from orchestrator.bench.server import Launcher, default_launcher, free_port
from orchestrator.bench.summary import comparison, ratios, summarize
from orchestrator.errors import BackendError, ConfigError, HardwareError, LaunchError
from orchestrator.launch.llama_args import LOG_VERBOSITY, log_verbosity_args
from orchestrator.launch.spec import LaunchSpec
from orchestrator.sigutil import interrupts_held
from orchestrator.units import MiB

SCHEMA = "orchestrator-bench/1"
ORDERS = ("serpentine", "rotate", "fixed")
_PORT_TAKEN = re.compile(r"already in use|couldn't bind|address in use", re.IGNORECASE)
_OOM = re.compile(r"out of memory|\bOOM\b|cudaMalloc failed|failed to allocate|unable to allocate", re.IGNORECASE)


@dataclass(frozen=True)
class BenchOptions:
    rounds: int = 2
    workload: Workload = field(default_factory=Workload)
    order: str = "serpentine"
    load_timeout: float = 900.0          # seconds for one server to answer /health (pinned loads of big models)
    request_timeout: float = 900.0
    stop_grace: float = 30.0
    sample_interval: float = 0.25
    prime_page_cache: bool = True
    max_seconds: float | None = None     # stop starting configurations when the next one would end after this
    host: str = "127.0.0.1"
    seed: int = 0
    vram_budget: int | None = None       # bytes left free on each GPU by the ballast (the plan's vram_limit)
    vram_tolerance: int = 32 * MiB
    gpus: tuple[int, ...] | None = None  # machine GPUs sampled (and held to the budget); default all
    log_verbosity: int | None = 4        # -lv for every server (when the binary has it): buffer sizes, fit decisions

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be at least 1, got {self.rounds}")
        if self.order not in ORDERS:
            raise ConfigError(f"order {self.order!r}: expected one of {', '.join(ORDERS)}")
        w = self.workload
        if any(n < 1 for n in w.pp) or any(d < 0 for d in w.tg_depths) or any(c < 1 for c in w.concurrency):
            raise ConfigError("--pp lengths and --concurrency must be ≥ 1, --tg-depths ≥ 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def schedule(names: Sequence[str], rounds: int, order: str = "serpentine") -> list[tuple[int, str]]:
    """(round, configuration) in run order. ``serpentine``: forward, backward, forward ...; ``rotate``: round r
    starts r places later; ``fixed``: the same order every round."""
    out: list[tuple[int, str]] = []
    n = len(names)
    for r in range(rounds):
        if order == "serpentine":
            seq = list(names) if r % 2 == 0 else list(reversed(names))
        elif order == "rotate":
            seq = [names[(i + r) % n] for i in range(n)]
        elif order == "fixed":
            seq = list(names)
        else:
            raise ConfigError(f"order {order!r}: expected one of {', '.join(ORDERS)}")
        out += [(r + 1, name) for name in seq]
    return out


def _check_configs(configs: Sequence[BenchConfig]) -> None:
    if not configs:
        raise ConfigError("no configurations to benchmark")
    seen: set[str] = set()
    for c in configs:
        if c.name in seen:
            raise ConfigError(f"two bench configurations are named {c.name!r}")
        seen.add(c.name)


def _check_binary(path: str) -> None:
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise BackendError(f"llama-server {path!r} does not exist or is not executable")


def server_version(binary: str) -> str:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    keep = [ln for ln in lines if re.search(r"version|built with|Device \d|ggml_cuda_init", ln)]
    return " | ".join((keep or lines)[:6])


def binary_has_flag(binary: str, flag: str) -> bool:
    """Whether ``binary --help`` lists ``flag`` (False when it cannot be run)."""
    try:
        r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", r.stdout + r.stderr) is not None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def prime_page_cache(paths: Sequence[str]) -> list[dict]:
    """Read each model file once so every configuration loads it from the page cache, the first one too.
    Files larger than half of the available memory are left alone (they would not stay cached)."""
    out = []
    avail = _mem_available()
    for p in dict.fromkeys(paths):
        try:
            size = os.path.getsize(p)
        except OSError as e:
            out.append({"path": p, "primed": False, "why": e.strerror})
            continue
        if avail is not None and size > avail // 2:
            out.append({"path": p, "primed": False, "size": size,
                        "why": f"larger than half of the available memory ({avail} bytes)"})
            continue
        t0 = time.monotonic()
        with open(p, "rb", buffering=0) as f:
            while f.read(16 * MiB):
                pass
        out.append({"path": p, "primed": True, "size": size, "seconds": round(time.monotonic() - t0, 2)})
    return out


def _gpu_inventory(nvml: Any, gpus: Sequence[int]) -> list[dict]:
    """Each measured GPU's name and memory, and its UUID: the one thing that tells two hosts of the same model apart
    when runs of different days are compared."""
    out = []
    for i in gpus:
        try:
            total, used, free = nvml.memory(i)
            entry = {"index": i, "name": nvml.name(i), "total": total, "used": used, "free": free}
        except Exception:
            continue
        try:
            entry["uuid"] = nvml.uuid(i)
        except Exception:
            pass
        out.append(entry)
    return out


def _stop_server(proc: Any, grace: float) -> None:
    """Stop a server even when Ctrl-C/SIGTERM lands in the middle of stopping it: finish, then re-raise."""
    try:
        proc.stop(grace=grace)
    except KeyboardInterrupt:
        proc.stop(grace=grace)
        raise


class _Bench:
    def __init__(self, configs: Sequence[BenchConfig], server_binary: str, out_dir: Path, options: BenchOptions,
                 progress: Progress, launcher: Launcher, nvml: Any, ballast: Any):
        self.configs = {c.name: c for c in configs}
        self.binary = server_binary
        self.out = out_dir
        self.opt = options
        self.progress = progress
        self.launcher = launcher
        self.nvml = nvml
        self.ballast = ballast
        self.gpus = list(options.gpus) if options.gpus is not None else (list(range(nvml.count())) if nvml else [])
        self._log_flags: dict[str, tuple[str, ...]] = {}

    def log_flags(self, binary: str) -> tuple[str, ...]:
        """``-lv N`` when that llama-server has the flag (asked once per binary)."""
        if binary not in self._log_flags:
            ok = self.opt.log_verbosity is not None and binary_has_flag(binary, LOG_VERBOSITY)
            self._log_flags[binary] = log_verbosity_args(self.opt.log_verbosity) if ok else ()
        return self._log_flags[binary]

    def argv(self, cfg: BenchConfig, port: int) -> tuple[str, ...]:
        argv = cfg.argv(self.binary, self.opt.host, port)
        flags = self.log_flags(cfg.server or self.binary)
        if flags and not has_flag(cfg.args, LOG_VERBOSITY):                  # any of its spellings
            argv += flags
        return argv

    def _settle_gpus(self) -> dict[str, int]:
        """Free memory per GPU before a start; with a budget, wait (up to 15 s) for the previous server's memory
        to come back so that every configuration starts with the same free memory."""
        free = gpu_free(self.nvml, self.gpus)
        if self.opt.vram_budget is None or not free:
            return free
        want = self.opt.vram_budget - 2 * self.opt.vram_tolerance
        deadline = time.monotonic() + 15
        while any(v < want for v in free.values()) and time.monotonic() < deadline:
            time.sleep(0.25)
            free = gpu_free(self.nvml, self.gpus)
        return free

    def _start(self, cfg: BenchConfig, name: str, log: Path) -> tuple[Any, LaunchSpec]:
        """Start one server of ``cfg`` on a free port (another one when the port is taken meanwhile)."""
        o = self.opt
        for attempt in (1, 2):
            port = free_port(o.host)
            spec = LaunchSpec(name=name, argv=self.argv(cfg, port), env=dict(cfg.env), host=o.host, port=port)
            try:
                with interrupts_held():
                    return self.launcher(spec, log), spec
            except LaunchError as e:
                if attempt == 2 or not _PORT_TAKEN.search(str(e)):
                    raise                 # else someone took the port between our check and the start
        raise AssertionError("unreachable")

    def run_one(self, cfg: BenchConfig, round_: int, position: int) -> dict:
        o = self.opt
        if self.ballast is not None and not self.ballast.alive():
            raise HardwareError("the VRAM ballast process is gone: further results would not be under the budget")
        servers = list(cfg.members) or [cfg]
        logs = [self.out / "logs" / (f"r{round_}-{cfg.name}.log" if len(servers) == 1
                                     else f"r{round_}-{cfg.name}-{k}.log") for k in range(len(servers))]
        log = logs[0]
        run: dict[str, Any] = {"config": cfg.name, "round": round_, "position": position, "status": "error",
                               "loaded": False, "argv": list(self.argv(servers[0], 0)), "env": dict(cfg.env),
                               "log": str(log.relative_to(self.out)), "warnings": []}
        if len(servers) > 1:
            run["replica_logs"] = [str(p.relative_to(self.out)) for p in logs]
        run["gpu_free_before"] = self._settle_gpus()
        if o.vram_budget is not None:
            low = {g: v for g, v in run["gpu_free_before"].items() if v < o.vram_budget - 2 * o.vram_tolerance}
            if low:
                run["warnings"].append(f"free VRAM before start below the budget: {low}")
        sampler = ResourceSampler(self.nvml, self.gpus, interval=o.sample_interval)
        sampler.baseline()
        sampler.start()
        t0 = time.monotonic()
        procs: list[Any] = []
        proc = None
        try:
            specs = []
            for k, (member, member_log) in enumerate(zip(servers, logs)):
                p, spec = self._start(member, f"bench-{cfg.name}" + (f"-{k}" if len(servers) > 1 else ""),
                                      member_log)
                procs.append(p)
                specs.append(spec)
            proc = procs[0]
            run["argv"] = list(specs[0].argv)
            if len(specs) > 1:
                run["replica_argv"] = [list(s.argv) for s in specs]
            sampler.attach(*(p.pid for p in procs))
            sampler.phase("load")
            # the replicas load together, as `up` starts them: the deployment is loaded when the last one is
            run["load_s"] = round(max(float(p.wait_healthy(o.load_timeout)) for p in procs), 3)
            run["loaded"] = True
            sampler.phase("measure")
            samples = run_measure([s.url for s in specs], o.workload, timeout=o.request_timeout,
                                  seed=o.seed * 100_003 + position, on_step=self.progress.step,
                                  alive=lambda: all(p.running() for p in procs))
            run["errors"] = samples.pop("errors")
            run["crashed"] = samples.pop("crashed")
            run["samples"] = samples
            run["status"] = "ok"
            if run["crashed"]:
                run["status"] = "crashed"
                dead = next((p for p in procs if not p.running()), proc)
                run["error"] = f"llama-server died while measuring: {dead.failure_cause() or '(no reason in the log)'}"
            self._check_context(cfg, samples, run)
        except LaunchError as e:
            run["status"] = "load-failed"
            run["error"] = str(e)
        except MeasureError as e:
            gone = next((p for p in procs if not p.running()), None)
            dead = gone is not None
            run["status"] = "crashed" if dead else "error"
            run["crashed"] = dead
            cause = gone.failure_cause() if dead else ""
            run["error"] = f"measuring failed: {e}" + (f"; llama-server died: {cause}" if cause else "")
        finally:
            try:
                sampler.phase("stop")
            finally:                                  # the servers are stopped even if Ctrl-C lands just here
                for p in procs:
                    _stop_server(p, o.stop_grace)
            sampler.stop()
            run["resources"] = sampler.summary()
            llama = parse_server_log(log)
            if llama:
                run["llama"] = llama
            run["wall_s"] = round(time.monotonic() - t0, 2)
        run["oom"] = bool(run.get("error") and _OOM.search(run["error"]))
        return run

    @staticmethod
    def _check_context(cfg: BenchConfig, samples: dict, run: dict) -> None:
        """The same context for every configuration: a slot must hold -c / -np tokens (or all of -c, unified)."""
        ctx, n_par = cfg.ctx, cfg.parallel or 1
        slot = samples.get("slot_ctx")
        if ctx and slot and slot * n_par < ctx and slot < ctx:
            run["warnings"].append(f"context shrank: {n_par} slot(s) of {slot} tokens for -c {ctx}")
            run["context_kept"] = False
        elif ctx and slot:
            run["context_kept"] = True

    @staticmethod
    def result_line(run: dict) -> str:
        if not run["loaded"]:
            return f"FAILED ({'OOM' if run.get('oom') else run['status']}): {run.get('error', '')}"
        parts = [f"loaded in {run['load_s']:.1f} s"]
        s = run.get("samples") or {}
        by_len: dict[int, list[float]] = {}
        for p in s.get("pp", []):
            by_len.setdefault(p["n"], []).append(p["tps"])
        for n in sorted(by_len):
            v = sorted(by_len[n])
            parts.append(f"pp{n} {v[len(v) // 2]:.0f}")
        for t in s.get("tg", []):
            parts.append(f"tg{t['n']}@{t['depth']} {t['tps']:.1f}")
        if run.get("error"):
            parts.append(f"ERROR: {run['error']}")
        return " · ".join(parts)


def run_bench(configs: Sequence[BenchConfig], server_binary: str, out_dir: str | os.PathLike,
              options: BenchOptions | None = None, *, progress: Progress | None = None,
              launcher: Launcher | None = None, nvml: Any = "auto", ballast: Any = None,
              charts: bool = True, plan_context: Mapping[str, Any] | None = None) -> dict:
    """Measure ``configs`` side by side on this machine and write ``bench.json``, ``bench.txt`` and PNG charts
    (``speed.png``, ``offload.png``) under ``out_dir``; returns the JSON data.

    ``options.vram_budget``: hold a VRAM ballast for the whole run (unless ``ballast``, an already held
    :class:`~orchestrator.bench.ballast.VramBallast`, is given: then the caller planned under it and owns it).
    ``launcher``/``nvml``: seams for tests (default: the launch process manager, NVML when present).
    ``plan_context``: what the plan was made from (its decisions and the machine's measured bandwidths), kept in
    ``bench.json`` so a later reader knows, e.g., which host bandwidth this machine instance measured.
    """
    options = options or BenchOptions()
    _check_configs(configs)
    _check_binary(server_binary)
    for c in configs:
        if c.server:
            _check_binary(c.server)
    out = Path(out_dir)
    progress = progress or make_progress("auto")
    launcher = launcher or default_launcher()
    own_nvml = nvml == "auto"
    if own_nvml:
        nvml = Nvml.open()
    own_ballast = None
    data: dict[str, Any] = {}
    json_path = out / "bench.json"
    try:
        if options.vram_budget is not None and ballast is None:
            from orchestrator.bench.ballast import VramBallast

            own_ballast = ballast = VramBallast(options.vram_budget, options.gpus,
                                                tolerance=options.vram_tolerance).start()
        try:
            (out / "logs").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot create it: {e.strerror}") from None
        bench = _Bench(configs, server_binary, out, options, progress, launcher, nvml, ballast)
        plan_order = schedule([c.name for c in configs], options.rounds, options.order)
        data = {
            "schema": SCHEMA, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            "server_binary": server_binary, "server_version": server_version(server_binary),
            "config_servers": {c.name: {"binary": c.server, "version": server_version(c.server)}
                               for c in configs if c.server},
            "options": options.to_dict(), "gpus": _gpu_inventory(nvml, bench.gpus) if nvml else [],
            "vram_budget": options.vram_budget, "ballast": ballast.status() if ballast is not None else None,
            "configs": [c.to_dict() for c in configs], "schedule": [list(x) for x in plan_order], "runs": [],
            **({"plan_context": dict(plan_context)} if plan_context else {}),
        }
        if options.prime_page_cache:
            progress.note("priming the page cache with the model file(s)")
            data["page_cache"] = prime_page_cache([c.model_path for c in configs if c.model_path])
        write_json(json_path, data)
        progress.start(len(plan_order))
        t_start = time.monotonic()
        for i, (rnd, name) in enumerate(plan_order):
            if options.max_seconds is not None and data["runs"]:
                mean = sum(r["wall_s"] for r in data["runs"]) / len(data["runs"])
                if time.monotonic() - t_start + mean > options.max_seconds:
                    data["stopped_early"] = (f"time budget of {options.max_seconds:g} s: {len(plan_order) - i} "
                                             f"of {len(plan_order)} runs not started")
                    progress.note(data["stopped_early"])
                    break
            progress.begin(i + 1, rnd, options.rounds, name)
            run = bench.run_one(bench.configs[name], rnd, i)
            data["runs"].append(run)
            progress.end(bench.result_line(run))
            write_json(json_path, data)
        _finish(data, out, charts)
        return data
    except BaseException as e:
        if data:
            data["interrupted"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            try:
                _finish(data, out, charts=False)
            except Exception:  # noqa: BLE001 - keep the original error
                write_json(json_path, data)
        raise
    finally:
        progress.close()
        if own_ballast is not None:
            try:
                own_ballast.stop()
            except KeyboardInterrupt:
                own_ballast.stop()
                raise
        if own_nvml and nvml is not None:
            nvml.close()


def _finish(data: dict, out: Path, charts: bool) -> None:
    data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    data["summary"] = summarize(data["configs"], data["runs"])
    data["ratios"] = ratios(data["summary"], data["configs"], vram_budget=data.get("vram_budget"))
    if line := comparison(data["configs"]):
        data["comparison"] = line
    files = {"json": "bench.json", "table": "bench.txt"}
    if charts:
        try:
            files["charts"] = [p.name for p in write_charts(data, out)]
        except Exception as e:  # noqa: BLE001 - charts are secondary: never lose the measurements over them
            data.setdefault("notes", []).append(f"no charts: {type(e).__name__}: {e}")
    data["files"] = files
    write_json(out / "bench.json", data)
    write_atomic(out / "bench.txt", (render_text(data) + "\n").encode())


def describe(configs: Sequence[BenchConfig], server_binary: str, options: BenchOptions) -> str:
    """What a run would do, without starting anything (``--dry-run``)."""
    w = options.workload
    per = (2 * w.warmup + sum(pp_reps(w.pp_reps, n) for n in w.pp) + len(w.tg_depths) * w.tg_reps
           + sum(max(1, -(-w.ttft_requests // c)) * c for c in w.concurrency))
    lines = [f"{len(configs)} configurations × {options.rounds} rounds = {len(configs) * options.rounds} server "
             f"starts, {per} requests each ({options.order} order)"]
    for c in configs:
        scope = c.params.get("scope")
        lines.append(f"  {c.name:<24} [{c.group}]" + (f" {scope}:" if scope else "") + f" {c.shell_line(server_binary)}")
        for k, m in enumerate(c.members[1:], start=2):
            lines.append(f"  {'':<24} replica {k}: {m.shell_line(server_binary)}")
    if options.workload.load_streams:
        lines.append(f"load: {options.workload.load_streams} requests of {options.workload.load_prompt} + "
                     f"{options.workload.tg_tokens} tokens at once, on every configuration")
    return "\n".join(lines)
