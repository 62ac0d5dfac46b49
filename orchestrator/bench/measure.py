"""Measurements through llama-server's own HTTP API, exactly as ``up`` serves it.

- Prompt processing: ``POST /completion`` with a prompt of random token ids (``"prompt": [ids...]``),
  ``cache_prompt: false`` and ``n_predict: 1``; the rate is llama-server's own ``timings.prompt_n /
  timings.prompt_ms``.
- Generation at a context depth (like ik_llama.cpp's sweep-bench): a prompt of ``depth`` random tokens, then
  ``n`` tokens with ``ignore_eos``; the rate is ``timings.predicted_per_second``.
- Time to first token: streamed requests, measured on the client from sending to the first event, ``c`` at a
  time.
- Load: ``S`` requests of ``load_prompt`` prompt tokens and ``tg_tokens`` generated, all sent at once: the
  aggregate (every request's prompt and generated tokens over the wall time from the first send to the last
  answer) and each request's own rate. The same load for every configuration, so a deployment of several
  replicas (its requests spread over them, as the gateway spreads them) and one server over the machine are
  compared as they serve it.
- Expert cache: llama-server's ``/metrics`` counters (``llamacpp:moe_cache_hits_total``, ``..._lookups_total``)
  read before and after the generation requests; their difference is the generation's hit rate.

Every request samples (temperature 1, a seed of its own from the seeded generator; llama-server's other sampler
settings as it defaults them: top_k 40, top_p 0.95, min_p 0.05): greedy decoding of a random-weight model falls
into loops, which would repeat the same experts and fake locality for an expert cache, and would differ from how
chat clients decode. ``top_k`` stays at its default on purpose: with ``top_k 0``, ``top_p`` sorts the whole
vocabulary for every token, which costs 10-20 ms per token at Qwen3's 151936 tokens (lab/bench/sampler_cost.py)
and would swamp the decode time being measured.

Random ids per request (from a seeded generator) and ``cache_prompt: false`` mean no request reuses another's
KV cache, whichever slot it lands in. A request that does not fit the slot's context is shortened by at most
5% (the tokens actually processed are recorded) or else skipped with the reason.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

FIT_SLACK = 0.05          # a prompt may be shortened by this fraction to fit the slot's context


class MeasureError(Exception):
    """A request failed (HTTP error, bad answer, connection lost)."""


@dataclass(frozen=True)
class ServerInfo:
    n_vocab: int
    slot_ctx: int
    n_ctx_train: int | None = None


def fit_length(want: int, extra: int, slot_ctx: int) -> int | None:
    """Prompt length to use for ``want`` tokens when ``extra`` more are generated in a slot of ``slot_ctx``.

    llama-server refuses a request whose prompt is >= the slot's context, and generation must fit as well.
    Returns ``want`` when it fits, a length shortened by at most FIT_SLACK when that fits, else None.
    """
    limit = slot_ctx - extra - 1 if extra > 0 else slot_ctx - 1
    if want <= limit:
        return want
    if limit >= max(1, want * (1 - FIT_SLACK)):
        return limit
    return None


class Client:
    """An aiohttp session on one server, or on the replicas of a deployment: each request goes to the next
    replica in turn (as the gateway's round robin does)."""

    def __init__(self, url: str | Sequence[str], *, timeout: float, rng: random.Random):
        self.urls = [u.rstrip("/") for u in ([url] if isinstance(url, str) else url)]
        self._next = 0
        self.timeout = timeout
        self.rng = rng
        self._session = None
        self.info: ServerInfo | None = None

    async def __aenter__(self) -> "Client":
        import aiohttp

        # a fresh connection per request: llama-server may close a kept-alive connection after a streamed answer
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                              connector=aiohttp.TCPConnector(limit=0, force_close=True))
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    @property
    def url(self) -> str:
        """The replica the next request goes to (then the one after it)."""
        u = self.urls[self._next % len(self.urls)]
        self._next += 1
        return u

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        import aiohttp

        try:
            async with self._session.request(method, self.url + path, json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise MeasureError(f"{method} {path}: HTTP {r.status}: {_error_text(text)}")
                return json.loads(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            raise MeasureError(f"{method} {path}: {type(e).__name__}: {e}") from None

    async def server_info(self) -> ServerInfo:
        d = await self._json("GET", "/v1/models")
        meta = (d.get("data") or [{}])[0].get("meta") or {}
        if "n_vocab" not in meta or "n_ctx" not in meta:
            raise MeasureError("GET /v1/models: no n_vocab/n_ctx in the model's meta (is this llama-server?)")
        self.info = ServerInfo(n_vocab=int(meta["n_vocab"]), slot_ctx=int(meta["n_ctx"]),
                               n_ctx_train=meta.get("n_ctx_train"))
        return self.info

    def tokens(self, n: int) -> list[int]:
        """``n`` random ids from the lower 90% of the vocabulary (special tokens tend to sit at the end)."""
        hi = max(2, int(self.info.n_vocab * 0.9))
        lo = min(10, hi - 1)
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    def _body(self, n_prompt: int, n_predict: int, **extra) -> dict:
        return {"prompt": self.tokens(max(1, n_prompt)), "n_predict": n_predict, "cache_prompt": False,
                "ignore_eos": True, "temperature": 1.0, "seed": self.rng.randrange(1, 1 << 31),
                "return_tokens": False, **extra}

    async def expert_cache_counters(self) -> dict[str, float] | None:
        """The expert cache's counters from ``/metrics`` (see :func:`parse_expert_cache_counters`); None when the
        server has no such counters (no --metrics, or no expert cache in the binary)."""
        import aiohttp

        try:
            async with self._session.get(self.urls[0] + "/metrics") as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        return parse_expert_cache_counters(text)

    async def completion(self, n_prompt: int, n_predict: int, slot: int | None = None) -> dict:
        """llama-server's timings of one request (with ``id_slot``: the slot it ran on); ``slot``: run it there."""
        extra = {} if slot is None else {"id_slot": slot}
        d = await self._json("POST", "/completion", self._body(n_prompt, n_predict, **extra))
        t = d.get("timings")
        if not isinstance(t, dict) or "prompt_ms" not in t:
            raise MeasureError("POST /completion: the answer has no timings")
        return {**t, "id_slot": d.get("id_slot")}

    async def first_token(self, n_prompt: int, n_predict: int) -> tuple[float, float, dict | None]:
        """Streamed request: (seconds to the first event, seconds to the end, final timings)."""
        import aiohttp

        body = self._body(n_prompt, n_predict, stream=True)
        t0 = time.perf_counter()
        ttft = None
        timings = None
        try:
            async with self._session.post(self.url + "/completion", json=body) as r:
                if r.status != 200:
                    raise MeasureError(f"POST /completion (stream): HTTP {r.status}: {_error_text(await r.text())}")
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    try:
                        ev = json.loads(line[5:])
                    except json.JSONDecodeError:
                        continue
                    if "error" in ev:
                        raise MeasureError(f"POST /completion (stream): {ev['error']}")
                    if ev.get("stop"):
                        timings = ev.get("timings")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise MeasureError(f"POST /completion (stream): {type(e).__name__}: {e}") from None
        if ttft is None:
            raise MeasureError("POST /completion (stream): no event came back")
        return ttft, time.perf_counter() - t0, timings


def _error_text(text: str) -> str:
    try:
        d = json.loads(text)
        e = d.get("error", d)
        return str(e.get("message", e)) if isinstance(e, dict) else str(e)
    except (json.JSONDecodeError, AttributeError):
        return " ".join(text.split())[:300]


@dataclass(frozen=True)
class Workload:
    """What is measured on each configuration (see ``BenchOptions``)."""

    pp: tuple[int, ...] = (8, 32, 64, 128, 512, 4096)
    pp_reps: int = 3                 # requests per length up to 1024 tokens; fewer above (see pp_reps())
    tg_depths: tuple[int, ...] = (0, 4096)
    tg_tokens: int = 128
    tg_reps: int = 1
    concurrency: tuple[int, ...] = (1, 4)
    tg_streams: tuple[int, ...] = ()     # streams generating at once, for aggregate generation (none: skipped)
    ttft_prompt: int = 128
    ttft_tokens: int = 4
    ttft_requests: int = 8
    load_streams: int = 0                # requests sent at once for the load measurement (0: skipped)
    load_prompt: int = 512
    warmup: bool = True


_COUNTER = re.compile(r"^llamacpp:moe_cache_(\w+?)_total\s+(\S+)\s*$", re.M)
# Where a run's samples keep the deltas of those counters: under the stem of llama-server's own names, the keys
# recorded runs carry and the lab's fit scripts read
COUNTERS = "moe_cache"            # generation's (and, under tg_streams, each stream count's)
PROMPT_COUNTERS = "moe_cache_pp"  # per prompt length


def parse_expert_cache_counters(text: str) -> dict[str, float] | None:
    """Every ``llamacpp:moe_cache_<name>_total`` of a Prometheus text page as ``{name: value}`` (hits, lookups,
    misses, uploaded_bytes, cpu_misses: what the binary exports); None without hits and lookups."""
    found = {k: float(v) for k, v in _COUNTER.findall(text)}
    if "hits" not in found or "lookups" not in found:
        return None
    return found


def pp_reps(reps: int, length: int) -> int:
    """Requests per prompt length: ``reps`` up to 1024 tokens, fewer for longer prompts (about reps × 1024
    tokens each; at least 1) — a long prompt is already a long, stable measurement, and rounds add samples."""
    return max(1, min(reps, -(-reps * 1024 // length)))


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), ``q`` in [0, 1]."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def measure(client: Client, w: Workload, *, on_step: Callable[[str], None] = lambda s: None,
                  alive: Callable[[], bool] = lambda: True) -> dict:
    """Run the workload on one started server. Returns the samples; a request that fails is recorded in
    ``errors`` and, when the server died, measuring stops (``crashed``)."""
    out: dict[str, Any] = {"pp": [], "tg": [], "ttft": {}, "skipped": [], "errors": [], "crashed": False}
    info = client.info or await client.server_info()
    out["slot_ctx"] = info.slot_ctx
    out["n_vocab"] = info.n_vocab

    async def guarded(what: str, request: Callable[[], Any]) -> Any:
        """One request; a failure while the server still runs is retried once (a dropped connection must not
        cost a configuration its number), then recorded."""
        for attempt in (1, 2):
            try:
                return await request()
            except MeasureError as e:
                if not alive():
                    out["crashed"] = True
                    out["errors"].append(f"{what}: {e}")
                    return None
                if attempt == 2:
                    out["errors"].append(f"{what}: {e}")
                    return None
                out["retried"] = out.get("retried", 0) + 1

    if w.warmup:
        on_step("warm-up")
        for n_prompt, n_gen in ((8, 4), (min(512, info.slot_ctx // 2), 8)):
            n = fit_length(n_prompt, n_gen, info.slot_ctx)
            if n:
                await guarded("warm-up", lambda: client.completion(n, n_gen))
                if out["crashed"]:
                    return out

    for length in w.pp:
        n = fit_length(length, 1, info.slot_ctx)
        if n is None:
            out["skipped"].append(f"pp{length}: does not fit the slot context of {info.slot_ctx} tokens")
            continue
        on_step(f"pp{length}")
        pp_before = await client.expert_cache_counters()
        for _ in range(pp_reps(w.pp_reps, length)):
            t = await guarded(f"pp{length}", lambda: client.completion(n, 1))
            if out["crashed"]:
                return out
            if t and t.get("prompt_ms", 0) > 0:
                out["pp"].append({"n": length, "prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"],
                                  "tps": 1000.0 * t["prompt_n"] / t["prompt_ms"]})
        pp_after = await client.expert_cache_counters() if pp_before is not None else None
        if pp_before is not None and pp_after is not None:
            # what the prompts did with the slots: experts read from them instead of copied over the host link
            out.setdefault(PROMPT_COUNTERS, {})[str(length)] = {k: pp_after[k] - pp_before[k] for k in pp_after
                                                               if k in pp_before}

    cache_before = await client.expert_cache_counters()
    for depth in w.tg_depths:
        n = fit_length(max(depth, 1), w.tg_tokens, info.slot_ctx)
        if n is None:
            out["skipped"].append(f"tg{w.tg_tokens}@{depth}: does not fit the slot context of {info.slot_ctx} tokens")
            continue
        on_step(f"tg{w.tg_tokens}@{depth}")
        for _ in range(w.tg_reps):
            t = await guarded(f"tg@{depth}", lambda: client.completion(n, w.tg_tokens))
            if out["crashed"]:
                return out
            if t and t.get("predicted_ms", 0) > 0:
                out["tg"].append({"depth": depth, "n": w.tg_tokens, "prompt_n": t["prompt_n"],
                                  "predicted_n": t["predicted_n"], "predicted_ms": t["predicted_ms"],
                                  "tps": 1000.0 * t["predicted_n"] / t["predicted_ms"]})

    cache_after = await client.expert_cache_counters() if cache_before is not None else None
    if cache_before is not None and cache_after is not None:
        # what generation did: how misses were served (uploaded or on the CPU) is what a miss mode changes
        out[COUNTERS] = {k: cache_after[k] - cache_before[k] for k in cache_after if k in cache_before}

    # several streams generating at once: one batch per decode step, the union of their experts per layer
    n = fit_length(1, w.tg_tokens, info.slot_ctx)
    for streams in w.tg_streams:
        if n is None:
            out["skipped"].append(f"tg{w.tg_tokens} x{streams}: does not fit the slot context of {info.slot_ctx} tokens")
            continue
        on_step(f"tg{w.tg_tokens} x{streams}")
        before = await client.expert_cache_counters()
        runs = []
        for _ in range(w.tg_reps):
            # stream i on slot i: with llama-server's KV cache split per slot, busy slots with a gap between them
            # ({0, 2}) cannot share one micro-batch, so each step would run one graph per stream (llama.cpp issue
            # 25840), and which slots llama-server picks for free requests changes from run to run
            res = await asyncio.gather(*(guarded(f"tg x{streams}",
                                                 lambda i=i: client.completion(n, w.tg_tokens, slot=i))
                                         for i in range(streams)))
            if out["crashed"]:
                return out
            done = [t for t in res if t and t.get("predicted_ms", 0) > 0]
            if len(done) == streams:
                # the streams decode together: the aggregate is their tokens over the longest decode
                window = max(t["predicted_ms"] for t in done)
                runs.append({"streams": streams, "predicted_n": sum(t["predicted_n"] for t in done),
                             "window_ms": window,
                             "tps": 1000.0 * sum(t["predicted_n"] for t in done) / window,
                             "per_stream_tps": [1000.0 * t["predicted_n"] / t["predicted_ms"] for t in done],
                             "slots": [t.get("id_slot") for t in done]})
        after = await client.expert_cache_counters() if before is not None else None
        entry: dict[str, Any] = {"runs": runs}
        if before is not None and after is not None:
            entry[COUNTERS] = {k: after[k] - before[k] for k in after if k in before}
        out.setdefault("tg_streams", {})[str(streams)] = entry

    n = fit_length(w.ttft_prompt, w.ttft_tokens, info.slot_ctx)
    for c in w.concurrency:
        if n is None:
            out["skipped"].append(f"ttft c{c}: a {w.ttft_prompt}-token prompt does not fit the slot context")
            continue
        on_step(f"ttft c{c}")
        samples: list[float] = []
        waves = max(1, -(-w.ttft_requests // c))
        for _ in range(waves):
            res = await asyncio.gather(*(guarded(f"ttft c{c}", lambda: client.first_token(n, w.ttft_tokens))
                                         for _ in range(c)))
            if out["crashed"]:
                return out
            samples += [r[0] for r in res if r is not None]
        out["ttft"][str(c)] = samples

    if w.load_streams:
        await _load(client, w, out, guarded, on_step)
    return out


async def _load(client: Client, w: Workload, out: dict, guarded, on_step) -> None:
    """``w.load_streams`` requests at once, ``w.tg_reps`` times: aggregate and per-request tokens/s."""
    info = client.info
    n = fit_length(w.load_prompt, w.tg_tokens, info.slot_ctx)
    s = w.load_streams
    if n is None:
        out["skipped"].append(f"load x{s}: a {w.load_prompt}-token prompt does not fit the slot context")
        return
    on_step(f"load x{s}")
    runs = []

    async def one() -> tuple[float, dict | None]:
        t0 = time.perf_counter()
        t = await guarded(f"load x{s}", lambda: client.completion(n, w.tg_tokens))
        return time.perf_counter() - t0, t

    for _ in range(w.tg_reps):
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one() for _ in range(s)))
        wall = time.perf_counter() - t0
        if out["crashed"]:
            return
        done = [(dt, t) for dt, t in res if t]
        if len(done) == s:
            tokens = [t["prompt_n"] + t["predicted_n"] for _dt, t in done]
            runs.append({"streams": s, "wall_s": wall, "tokens": sum(tokens), "tps": sum(tokens) / wall,
                         "per_request_s": [dt for dt, _t in done],
                         "per_request_tps": [k / dt for k, (dt, _t) in zip(tokens, done)]})
    out.setdefault("load", {})[str(s)] = {"prompt": n, "tokens": w.tg_tokens, "runs": runs}


def run_measure(url: str | Sequence[str], w: Workload, *, timeout: float, seed: int, on_step: Callable[[str], None] = lambda s: None,
                alive: Callable[[], bool] = lambda: True) -> dict:
    async def main() -> dict:
        async with Client(url, timeout=timeout, rng=random.Random(seed)) as client:
            await client.server_info()
            return await measure(client, w, on_step=on_step, alive=alive)

    return asyncio.run(main())
