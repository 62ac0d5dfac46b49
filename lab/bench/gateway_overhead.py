#!/usr/bin/env python3
"""Gateway overhead: concurrent streams straight to llama-server vs through the orchestrator gateway.

Both paths hit the same llama-server, interleaved round by round (direct, gateway, gateway, direct, ...) so drift
in the machine's load hits both alike. Per request it records the time to the first streamed token, the time to
the last and the time per token after the first; per round the generated tokens per second over all streams. It
prints p50/p90/p95/p99 of each, the added latency and the throughput loss, against the targets (<= 1 ms p50
added, <= 3 % throughput loss). ``--streams 1,4,16`` measures each count in turn on one deployment (llama-server
with as many slots as the largest count); each count gets at least ``--requests`` requests per path (a p99 wants
200 or more).

Every request is kept (``requests`` in the JSON): when it was sent within its round, its time to the first token
and to the last, its tokens, llama-server's own timings from the stream's last event (``prompt_ms``: the prompt's
share of the first token; ``predicted_ms``) and, through the gateway, the gateway's ``Server-Timing`` (the
gateway's time from the end of the request to the replica, and the replica's to the answer's head). The rest of
the first token splits into the gateway's part, the prompt, the wait for a slot and for the batch in progress (the
replica's time to the head, which comes with the first token, less the prompt) and the relay (the rest: the
request into the gateway and the first token back through it). The report splits the slowest 5 % of each path
that way, so a tail is put where it comes from.

Modes:
  --mode ray         (default) the real thing: `orchestrator.cluster.up` with one worker under an embedded Ray
                     head; the gateway is the Ray actor that `up` runs. Stopped with `down` at the end.
  --mode standalone  the same gateway code in its own process (`python -m orchestrator.cluster.gateway`) in
                     front of a llama-server started here; no Ray.
  --mode fake        the standalone gateway in front of a stand-in upstream that streams --max-tokens SSE events
                     every --token-ms (no model): the gateway's own cost without llama-server's scheduling noise.

The gateway process's CPU time per streamed chunk is printed too (psutil), in every mode. In standalone and fake
modes --gateway-cmd measures another gateway on the same footing, e.g. the aiohttp one this project used until
3e4fc22: `git show ae6ef30:orchestrator/cluster/gateway.py > /tmp/old_gateway.py` and
`--gateway-cmd 'python3 /tmp/old_gateway.py --port {port} --replica bench={upstream}'`.

  python lab/bench/gateway_overhead.py [--model M.gguf] [--binary llama-server] [--streams 16] [--rounds 8]
                                      [--out result.json]

Without --model a small random llama GGUF (tests/tiny_llama.py, --embd/--layers) is written to a
temporary directory; its tokens come fast, which makes the gateway's share of each request as large as it gets.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(path: Path, embd: int, layers: int) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_llama", REPO / "tests/tiny_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_tiny_llama(path, n_embd=embd, n_layer=layers, n_head=max(1, embd // 64), n_ff=embd * 2)


# the stand-in upstream for --mode fake: llama-server-sized SSE events at a fixed pace
FAKE_UPSTREAM = """
import asyncio, sys
from aiohttp import web
n, pace = int(sys.argv[2]), float(sys.argv[3]) / 1000
ev = (b'data: {"choices":[{"text":"tok","index":0,"logprobs":null,"finish_reason":null}],"created":1,'
      b'"model":"bench","system_fingerprint":"b1","object":"text_completion","id":"cmpl-0123456789abcdef"}\\n\\n')
async def completions(request):
    await request.read()
    r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await r.prepare(request)
    for _ in range(n):
        await asyncio.sleep(pace)
        await r.write(ev)
    await r.write(b"data: [DONE]\\n\\n")
    return r
async def health(request):
    return web.json_response({"status": "ok"})
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def gateway_pids(mode: str, procs: list) -> list[int]:
    """The processes that run the gateway: ours in standalone/fake mode, the Ray actors in ray mode."""
    import psutil

    if mode != "ray":
        return [procs[-1].pid]
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (p.info["cmdline"] or [""])[0].startswith("ray::GatewayActor"):
                pids.append(p.pid)
        except psutil.Error:
            continue
    return pids


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    try:
        for pid in pids:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        return total if pids else float("nan")
    except (psutil.Error, TypeError, ValueError):
        return float("nan")


def wait_http(url: str, timeout: float) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not healthy after {timeout:g}s")


def server_key(port: int) -> str | None:
    """The key `up` gave the llama-server listening on ``port`` (in its environment, never on its command line):
    asked directly, a server of a deployment answers only with it."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            argv = p.info["cmdline"] or []
            if any(a.endswith("llama-server") for a in argv) and str(port) in argv[argv.index("--port") + 1:][:1]:
                return p.environ().get("LLAMA_API_KEY")
        except (psutil.Error, ValueError):
            continue
    return None


RETRIED: dict[str, int] = {}   # url -> requests sent again after the server closed a kept-alive connection


async def one_stream(session, url: str, body: bytes, headers: dict | None = None, t_round: float = 0.0) -> dict:
    """One streamed request: ``ttft``, ``total`` (s), ``tokens`` (the time per token after the first is
    (total - ttft) / (tokens - 1)), ``sent`` (s after the round began), llama-server's ``prompt_ms`` and
    ``predicted_ms``, the gateway's ``gateway_ms`` and ``replica_ms`` (Server-Timing). A request whose kept-alive
    connection the server closed before it answered (the usual keep-alive race of HTTP/1.1; aiohttp does not
    resend a POST by itself) is sent once more and counted in RETRIED, which the report prints per path."""
    import aiohttp

    try:
        return await _one_stream(session, url, body, headers, t_round)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        RETRIED[url] = RETRIED.get(url, 0) + 1
        return await _one_stream(session, url, body, headers, t_round)


def server_timing(value: str) -> dict[str, float]:
    """``gateway;dur=0.08, replica;dur=351.2`` -> {"gateway_ms": 0.08, "replica_ms": 351.2}."""
    out = {}
    for part in value.split(","):
        name, _, params = part.strip().partition(";")
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k == "dur":
                try:
                    out[f"{name}_ms"] = float(v)
                except ValueError:
                    pass
    return out


async def _one_stream(session, url: str, body: bytes, headers: dict | None = None, t_round: float = 0.0) -> dict:
    t0 = time.perf_counter()
    first = None
    n = 0
    last_event = b""
    async with session.post(url, data=body, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        rec = server_timing(r.headers.get("Server-Timing", ""))
        async for line in r.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            if first is None:
                first = time.perf_counter()
            n += 1
            last_event = line
    end = time.perf_counter()
    try:
        timings = json.loads(last_event[5:]).get("timings") or {}
    except ValueError:
        timings = {}
    rec.update({"sent": t0 - t_round, "ttft": (first or end) - t0, "total": end - t0, "tokens": n,
                "prompt_ms": timings.get("prompt_ms"), "prompt_n": timings.get("prompt_n"),
                "predicted_ms": timings.get("predicted_ms")})
    return rec


async def one_round(session, url: str, streams: int, body: bytes, headers: dict | None = None
                    ) -> tuple[list, float, int]:
    t0 = time.perf_counter()
    res = await asyncio.gather(*[one_stream(session, url, body, headers, t0) for _ in range(streams)])
    wall = time.perf_counter() - t0
    return res, wall, sum(r["tokens"] for r in res)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rounds_for(streams: int, rounds: int, min_samples: int) -> int:
    """Rounds of ``streams`` requests so that each path gets at least ``min_samples`` requests (a p95 wants 20 or
    more, a p99 200 or more)."""
    return max(rounds, -(-min_samples // streams))


async def measure(direct: str, gateway: str, streams: int, rounds: int, max_tokens: int, warmup: int,
                  direct_key: str | None = None) -> dict:
    import aiohttp

    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    out = {p: {"ttft": [], "total": [], "per_token": [], "tps": [], "requests": []} for p in ("direct", "gateway")}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        targets = {"direct": direct + "/v1/completions", "gateway": gateway + "/v1/completions"}
        headers = {"direct": {"Authorization": f"Bearer {direct_key}"} if direct_key else {}, "gateway": {}}
        for _ in range(warmup):
            for name in ("direct", "gateway"):
                await one_round(s, targets[name], streams, body, headers[name])
        for i in range(rounds):
            order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
            for name in order:
                res, wall, toks = await one_round(s, targets[name], streams, body, headers[name])
                out[name]["ttft"] += [r["ttft"] for r in res]
                out[name]["total"] += [r["total"] for r in res]
                out[name]["per_token"] += [(r["total"] - r["ttft"]) / (r["tokens"] - 1) for r in res
                                           if r["tokens"] > 1]
                out[name]["tps"].append(toks / wall)
                out[name]["requests"] += [{"round": i, **r} for r in res]
    return out


def summarize(raw: dict, args, extra: dict, streams: int | None = None, rounds: int | None = None) -> dict:
    d, g = raw["direct"], raw["gateway"]
    ms = lambda xs, q: pct(xs, q) * 1e3 if xs else float("nan")  # noqa: E731
    s = {"streams": streams if streams is not None else args.streams, "rounds": rounds or args.rounds,
         "max_tokens": args.max_tokens, "samples": {"direct": len(d["ttft"]), "gateway": len(g["ttft"])}}
    for key, q in (("p50", .5), ("p90", .9), ("p95", .95), ("p99", .99)):
        s[f"ttft_{key}_ms"] = {"direct": ms(d["ttft"], q), "gateway": ms(g["ttft"], q)}
        s[f"per_token_{key}_ms"] = {"direct": ms(d["per_token"], q), "gateway": ms(g["per_token"], q)}
    s["total_p50_ms"] = {"direct": ms(d["total"], .5), "gateway": ms(g["total"], .5)}
    s["tokens_per_s_median"] = {"direct": statistics.median(d["tps"]), "gateway": statistics.median(g["tps"])}
    s["added_p50_ttft_ms"] = s["ttft_p50_ms"]["gateway"] - s["ttft_p50_ms"]["direct"]
    s["added_p95_ttft_ms"] = s["ttft_p95_ms"]["gateway"] - s["ttft_p95_ms"]["direct"]
    s["added_p99_ttft_ms"] = s["ttft_p99_ms"]["gateway"] - s["ttft_p99_ms"]["direct"]
    s["added_p50_per_token_ms"] = s["per_token_p50_ms"]["gateway"] - s["per_token_p50_ms"]["direct"]
    s["added_p95_per_token_ms"] = s["per_token_p95_ms"]["gateway"] - s["per_token_p95_ms"]["direct"]
    s["added_p50_total_ms"] = s["total_p50_ms"]["gateway"] - s["total_p50_ms"]["direct"]
    s["throughput_loss_pct"] = 100 * (1 - s["tokens_per_s_median"]["gateway"] / s["tokens_per_s_median"]["direct"])
    s["tail"] = {p: tail_split(raw[p]["requests"]) for p in ("direct", "gateway")}
    s.update(extra)
    s["requests"] = {p: [{k: (round(v * 1e3, 3) if k in ("sent", "ttft", "total") else v) for k, v in r.items()}
                         for r in raw[p]["requests"]] for p in ("direct", "gateway")}   # ms, per request
    return s


def tail_split(requests: list[dict], share: float = 0.05) -> dict:
    """The slowest ``share`` of requests by time to first token, and the median of where it went: ``gateway_ms``
    (Server-Timing: from the end of the request to the replica; 0 straight to llama-server), ``prompt_ms``
    (llama-server's), ``wait_ms`` (the rest of the replica's time to the head, which comes with the first token:
    the wait for a slot and for the batch in progress, the first decode step; straight to llama-server, all of the
    first token's time but the prompt), ``relay_ms`` (through the gateway: the rest, the request into the gateway
    and the first token back through it to the client); the same for all requests beside it."""
    def split(rs: list[dict]) -> dict:
        if not rs:
            return {}
        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        ttft = [r["ttft"] * 1e3 for r in rs]
        gw = [r.get("gateway_ms") or 0.0 for r in rs]
        prompt = [r["prompt_ms"] if r.get("prompt_ms") is not None else float("nan") for r in rs]
        replica = [r.get("replica_ms", t - g) for r, t, g in zip(rs, ttft, gw)]   # direct: all but the gateway's
        wait = [rp - p for rp, p in zip(replica, prompt)]
        relay = [t - g - rp for t, g, rp in zip(ttft, gw, replica)]
        sent = [r["sent"] * 1e3 for r in rs]
        return {"n": len(rs), "ttft_ms": med(ttft), "gateway_ms": med(gw), "prompt_ms": med(prompt),
                "wait_ms": med(wait), "relay_ms": med(relay), "sent_ms": med(sent)}
    ranked = sorted(requests, key=lambda r: r["ttft"])
    k = max(1, round(len(ranked) * share)) if ranked else 0
    return {"slowest": split(ranked[len(ranked) - k:]), "all": split(ranked)}


def report(s: dict) -> str:
    def row(label: str, key: str) -> str:
        a, b = s[key]["direct"], s[key]["gateway"]
        return f"{label:26}{a:>10.2f}ms{b:>10.2f}ms{b - a:>+10.2f}ms"

    lines = [
        f"gateway overhead, {s['streams']} concurrent streams x {s['max_tokens']} tokens, {s['rounds']} rounds "
        f"interleaved ({s['mode']} mode" + (f", {s['gateway_processes']} gateway processes" if s.get("gateway_processes")
                                             else "") + ")",
        f"{'':26}{'direct':>12}{'gateway':>12}{'added':>12}",
        row("time to first token p50", "ttft_p50_ms"),
        row("time to first token p90", "ttft_p90_ms"),
        row("time to first token p95", "ttft_p95_ms"),
        row("time to first token p99", "ttft_p99_ms"),
        row("per token p50", "per_token_p50_ms"),
        row("per token p95", "per_token_p95_ms"),
        row("request total p50", "total_p50_ms"),
        f"{'tokens/s (median round)':26}{s['tokens_per_s_median']['direct']:>12.1f}"
        f"{s['tokens_per_s_median']['gateway']:>12.1f}{-s['throughput_loss_pct']:>+11.2f}%",
        f"gateway CPU per streamed chunk: {s['gateway_cpu_us_per_chunk']:.1f} us",
        *tail_lines(s.get("tail") or {}),
        f"requests resent after the server closed a kept-alive connection: direct {s['resent']['direct']}, "
        f"gateway {s['resent']['gateway']}",
        f"target p50 added <= 1 ms: {'met' if s['added_p50_ttft_ms'] <= 1.0 else 'MISSED'} (first token), "
        f"{'met' if s['added_p50_total_ms'] <= 1.0 else 'MISSED'} (whole request); "
        f"throughput loss <= 3 %: {'met' if s['throughput_loss_pct'] <= 3.0 else 'MISSED'}",
    ]
    return "\n".join(lines)


def tail_lines(tail: dict) -> list[str]:
    lines = []
    for path in ("direct", "gateway"):
        for part in ("all", "slowest"):
            t = (tail.get(path) or {}).get(part) or {}
            if t:
                lines.append(f"{path:8}{'slowest 5%' if part == 'slowest' else 'all':>11} ({t['n']:>4}): first token "
                             f"{t['ttft_ms']:8.2f} ms = gateway {t['gateway_ms']:6.2f} + prompt {t['prompt_ms']:8.2f}"
                             f" + slot/batch wait {t['wait_ms']:8.2f} + relay {t['relay_ms']:6.2f} (medians; sent "
                             f"{t['sent_ms']:.2f} ms into the round)")
    return lines


def stream_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--streams {text!r}: a count or counts like 1,4,16")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("ray", "standalone", "fake"), default="ray")
    ap.add_argument("--token-ms", type=float, default=10.0, help="--mode fake: pace of the stand-in's tokens")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--binary", default=None, help="llama-server (default: $LLAMA_SERVER, PATH, build cache)")
    ap.add_argument("--streams", type=stream_counts, default=[16], help="concurrent streams: 16, or 1,4,16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", "--min-samples", dest="min_samples", type=int, default=0,
                    help="at least this many requests per path and stream count (more rounds when needed; a p99 "
                         "wants 200 or more)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--embd", type=int, default=256, help="width of the generated model (without --model)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the generated model (without --model)")
    ap.add_argument("--ngl", default=None, help="-ngl for llama-server (GPU runs)")
    ap.add_argument("--gateway-processes", default="auto",
                    help="--mode ray: gateway processes sharing the port (auto: as `up` decides: 1)")
    ap.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    ap.add_argument("--gateway-cmd", default=None, metavar="ARGV",
                    help="standalone/fake modes: measure another gateway instead, e.g. an older version of "
                         "gateway.py: 'python3 old.py --port {port} --replica bench={upstream}' (split like a shell "
                         "would, never run by one)")
    a = ap.parse_args(argv)

    from orchestrator.backend.detect import find_llama_server

    tmp = Path(tempfile.mkdtemp(prefix="orch-gwbench-"))
    binary = model = "-"
    if a.mode != "fake":
        binary = a.binary or find_llama_server(None)[0]
        model = a.model or tiny_model(tmp / "bench.gguf", a.embd, a.layers)
    port, gw_port = free_port(), free_port()
    slots = max(a.streams)
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * (a.max_tokens + 64)), "-t", str(a.threads), "--metrics", "--no-warmup"]
    if a.ngl:
        argv += ["-ngl", a.ngl]
    direct, gateway = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{gw_port}"
    procs: list[subprocess.Popen] = []
    extra = {"mode": a.mode, "model": str(model), "binary": binary, "machine": platform.node(),
             "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        if a.mode == "ray":
            os.environ.setdefault("ORCHESTRATOR_STATE", str(tmp / "state"))
            from orchestrator.cluster import Deployment, up
            from orchestrator.launch.spec import LaunchSpec

            from orchestrator.cluster.deployment import gateway_processes

            extra["gateway_processes"] = gateway_processes(a.gateway_processes)
            dep = Deployment(specs=(LaunchSpec(name="bench", argv=tuple(argv), port=port, model_alias="bench"),),
                             gateway_port=gw_port, dashboard_port=free_port(), namespace="gwbench",
                             gateway_processes=extra["gateway_processes"])
            up(dep, foreground=False)
        else:
            if a.mode == "fake":
                extra["token_ms"] = a.token_ms
                up_argv = [sys.executable, "-c", FAKE_UPSTREAM, str(port), str(a.max_tokens), str(a.token_ms)]
            else:
                up_argv = argv
            procs.append(subprocess.Popen(up_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True, cwd=tmp))
            wait_http(direct + "/health", 120)
            gw_argv = [sys.executable, "-m", "orchestrator.cluster.gateway", "--port", str(gw_port),
                       "--replica", f"bench={direct}"]
            if a.gateway_cmd:
                import shlex

                gw_argv = [w.replace("{port}", str(gw_port)).replace("{upstream}", direct)
                           for w in shlex.split(a.gateway_cmd)]
                extra["gateway_cmd"] = a.gateway_cmd
            procs.append(subprocess.Popen(gw_argv, cwd=REPO,
                                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                              [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                                                  os.pathsep) if p])}, start_new_session=True,
                                          stdout=subprocess.DEVNULL))
        wait_http(gateway + "/health", 120)
        gpids = gateway_pids(a.mode, procs)
        key = server_key(port) if a.mode == "ray" else None
        raws = {}
        for n in a.streams:
            rounds = rounds_for(n, a.rounds, a.min_samples)
            cpu0 = cpu_seconds(gpids)
            raws[n] = (rounds, asyncio.run(measure(direct, gateway, n, rounds, a.max_tokens, a.warmup, key)))
            chunks = (rounds + a.warmup) * n * (a.max_tokens + 1)
            raws[n] += ((cpu_seconds(gpids) - cpu0) / chunks * 1e6,)
        extra["resent"] = {"direct": RETRIED.get(direct + "/v1/completions", 0),
                           "gateway": RETRIED.get(gateway + "/v1/completions", 0)}
    finally:
        if a.mode == "ray":
            from orchestrator.cluster import down, state

            if state.read("gwbench") is not None:
                down("gwbench")
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    by = {}
    for n, (rounds, raw, cpu_us) in raws.items():
        by[n] = summarize(raw, a, {**extra, "gateway_cpu_us_per_chunk": cpu_us}, n, rounds)
        print(report(by[n]))
    s = by[a.streams[0]] if len(by) == 1 else {**extra, "max_tokens": a.max_tokens,
                                               "by_streams": {str(n): v for n, v in by.items()}}
    if a.json:
        print(json.dumps(s))
    if a.out is not None:
        a.out.write_text(json.dumps(s, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
