"""The OpenAI-compatible gateway: one endpoint in front of every replica.

``/v1/chat/completions``, ``/v1/completions`` (and ``/v1/embeddings``) are proxied to the healthy replica of the
requested model with the fewest requests in flight; streamed answers (SSE) are passed through chunk by chunk as
they arrive. ``/v1/models`` lists the deployment's model aliases; ``/health`` is 200 while a replica is healthy.
With no healthy replica the answer is 503 with an OpenAI-style JSON error that says why. A replica that refuses
the connection is skipped for a moment and the request goes to another one (nothing was sent to the client yet).

Built on aiohttp (server and client, already a dependency of Ray's dashboard). The :class:`Router` is pure and
unit-tested; :class:`Gateway` is the aiohttp app; :class:`GatewayActor` runs it inside a Ray actor (the
controller creates it on the node where ``up`` runs, so ``down`` stops it with the rest); ``python -m
orchestrator.cluster.gateway`` runs it standalone with a fixed replica list (benchmarks, debugging).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
QUARANTINE_S = 2.0
# llama-server (cpp-httplib) closes a kept-alive connection after 5 s idle; the pool lets go of idle connections
# sooner, so a request is not sent down a connection the server has just closed
UPSTREAM_KEEPALIVE_S = 4.0
STALE_RETRIES = 2   # requests retried on a fresh connection after the server closed a pooled one


@dataclass
class Replica:
    name: str
    url: str
    model: str
    healthy: bool
    detail: str = ""
    inflight: int = 0
    quarantined_until: float = 0.0
    pid: int | None = None
    epoch: int = 0          # bumped when the process behind the URL changed or died: its pooled connections go


class Router:
    """Which replica serves the next request. Pure; the clock is injected."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self._rr = itertools.count()
        self.version = 0

    def set_replicas(self, table: Iterable[Mapping[str, Any]]) -> None:
        """Replace the table (``name, url, model, healthy, detail``); in-flight counts of known replicas stay."""
        new: dict[str, Replica] = {}
        for row in table:
            r = self.replicas.get(row["name"]) or Replica(row["name"], row["url"], row["model"], False,
                                                          pid=row.get("pid"))
            if r.url != row["url"] or r.pid != row.get("pid"):
                r.epoch += 1            # another process (or none) behind it now
            r.url, r.model, r.healthy, r.detail = row["url"], row["model"], bool(row["healthy"]), row.get("detail", "")
            r.pid = row.get("pid")
            new[r.name] = r
        self.replicas = new
        self.version += 1

    def models(self) -> list[str]:
        return list(dict.fromkeys(r.model for r in self.replicas.values()))

    def resolve_model(self, requested: str | None) -> str | None:
        """The alias a request goes to: its own when known; the only one when there is a single alias (clients
        send all sorts of names); None when it names an unknown model among several."""
        models = self.models()
        if requested in models:
            return requested
        if len(models) == 1:
            return models[0]
        return None

    def pick(self, model: str, exclude: set[str] = frozenset()) -> Replica | None:
        now = self.clock()
        cands = [r for r in self.replicas.values()
                 if r.model == model and r.healthy and r.name not in exclude and r.quarantined_until <= now]
        if not cands:
            return None
        low = min(r.inflight for r in cands)
        best = [r for r in cands if r.inflight == low]
        return best[next(self._rr) % len(best)]

    def mark_failed(self, name: str, detail: str) -> None:
        r = self.replicas.get(name)
        if r is not None:
            r.quarantined_until = self.clock() + QUARANTINE_S
            r.detail = detail
            r.epoch += 1

    def healthy_count(self, model: str | None = None) -> int:
        now = self.clock()
        return sum(1 for r in self.replicas.values()
                   if r.healthy and r.quarantined_until <= now and (model is None or r.model == model))

    def why_unavailable(self, model: str) -> str:
        rs = [r for r in self.replicas.values() if r.model == model]
        if not rs:
            return f"no replica serves model {model!r}"
        parts = []
        for r in rs:
            d = r.detail or ("healthy" if r.healthy else "not ready")
            parts.append(f"{r.name}: {d}")
        return f"no healthy replica for model {model!r} ({'; '.join(parts)})"


def error_body(message: str, type_: str, code: int | str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode()


class Gateway:
    """The aiohttp application around a :class:`Router`."""

    def __init__(self, router: Router | None = None, api_key: str | None = None, sink: Any = None,
                 connect_timeout_s: float = 5.0) -> None:
        self.router = router or Router()
        self.api_key = api_key or None
        self.sink = sink
        self.connect_timeout_s = connect_timeout_s
        self.counts: dict[tuple[str, str], int] = {}
        self._flushed: dict[tuple[str, str], int] = {}
        self._runner = None
        self._sessions: dict[str, tuple[int, Any]] = {}     # replica -> (epoch, aiohttp.ClientSession)
        self._closing: set[asyncio.Task] = set()
        self._flush_task: asyncio.Task | None = None
        self.url = ""

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=256 * 2**20)
        for path in PROXIED:
            app.router.add_post(path, self._proxy)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def start(self, host: str, port: int, reuse_port: bool = False) -> str:
        """Listen on ``host:port``; ``reuse_port``: share the port with the deployment's other gateway processes
        (SO_REUSEPORT: the kernel spreads new connections over them)."""
        from aiohttp import web

        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True, reuse_port=reuse_port or None,
                           backlog=1024)
        try:
            await site.start()
        except OSError:
            await self.stop()
            raise
        self.url = f"http://{host}:{port}"
        if self.sink is not None:
            self._flush_task = asyncio.ensure_future(self._flush_loop())
        return self.url

    async def stop(self) -> None:
        if self._flush_task is not None:
            self._flush_task.cancel()
            self._flush_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        sessions = [sess for _, sess in self._sessions.values()]
        self._sessions.clear()
        for sess in sessions:
            await sess.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # --- upstream connections ------------------------------------------------------------------------------------
    # One client session (connection pool) per replica. When the process behind a replica changes or dies, its
    # pool is closed at once: kept-alive connections to a dead server would hold the server's port in FIN-WAIT-2
    # and stop its replacement from binding it.
    def _new_session(self):
        import aiohttp

        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                          sock_connect=self.connect_timeout_s),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar())

    def _session_for(self, rep: Replica):
        cur = self._sessions.get(rep.name)
        if cur is not None and cur[0] == rep.epoch:
            return cur[1]
        if cur is not None:
            self._close_later(cur[1])
        sess = self._new_session()
        self._sessions[rep.name] = (rep.epoch, sess)
        return sess

    def _close_later(self, sess) -> None:
        task = asyncio.ensure_future(sess.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def prune_sessions(self) -> None:
        """Close the pools of replicas that are gone or whose process changed (call after a table update)."""
        for name, (epoch, sess) in list(self._sessions.items()):
            r = self.router.replicas.get(name)
            if r is None or r.epoch != epoch:
                del self._sessions[name]
                self._close_later(sess)

    def set_replicas(self, table: Iterable[Mapping[str, Any]]) -> int:
        self.router.set_replicas(table)
        self.prune_sessions()
        return self.router.version

    # --- handlers ------------------------------------------------------------------------------------------------
    def _json(self, status: int, body: bytes):
        from aiohttp import web

        return web.Response(status=status, body=body, content_type="application/json")

    def _authorized(self, request) -> bool:
        if not self.api_key:
            return True
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    def _count(self, model: str, code: int) -> None:
        key = (model, str(code))
        self.counts[key] = self.counts.get(key, 0) + 1

    async def _health(self, request):
        n = self.router.healthy_count()
        if n:
            return self._json(200, json.dumps({"status": "ok", "healthy_replicas": n}).encode())
        return self._json(503, error_body("no healthy replica", "service_unavailable", 503))

    async def _models(self, request):
        if not self._authorized(request):
            return self._json(401, error_body("invalid or missing API key", "invalid_request_error", "invalid_api_key"))
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "orchestrator"} for m in self.router.models()]
        return self._json(200, json.dumps({"object": "list", "data": data}).encode())

    async def _proxy(self, request):
        import aiohttp
        from aiohttp import web

        if not self._authorized(request):
            self._count("-", 401)
            return self._json(401, error_body("invalid or missing API key", "invalid_request_error", "invalid_api_key"))
        body = await request.read()
        requested = None
        if len(self.router.models()) > 1:
            try:
                requested = json.loads(body).get("model")
            except (ValueError, AttributeError):
                self._count("-", 400)
                return self._json(400, error_body("request body is not a JSON object", "invalid_request_error", 400))
        model = self.router.resolve_model(requested)
        if model is None:
            self._count(str(requested), 404)
            return self._json(404, error_body(f"model {requested!r} not found; available: "
                                              f"{', '.join(self.router.models())}", "invalid_request_error",
                                              "model_not_found"))
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        if "Accept" in request.headers:
            headers["Accept"] = request.headers["Accept"]
        tried: set[str] = set()
        stale = 0
        while True:
            rep = self.router.pick(model, tried)
            if rep is None:
                self._count(model, 503)
                return self._json(503, error_body(self.router.why_unavailable(model), "service_unavailable", 503))
            tried.add(rep.name)
            rep.inflight += 1
            try:
                try:
                    upstream = await self._session_for(rep).post(rep.url + request.path_qs, data=body,
                                                                 headers=headers)
                except aiohttp.ServerDisconnectedError as e:
                    # closed before any answer: most often a pooled connection the server had just closed (idle
                    # timeout, its keep-alive limit), not a dead server: pick again (a fresh connection) before
                    # calling the replica unreachable
                    if stale < STALE_RETRIES:
                        stale += 1
                        tried.discard(rep.name)
                        continue
                    self.router.mark_failed(rep.name, f"unreachable ({type(e).__name__})")
                    self.prune_sessions()
                    continue
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                    # refused / reset before an answer: nothing reached the client, try another replica
                    self.router.mark_failed(rep.name, f"unreachable ({type(e).__name__})")
                    self.prune_sessions()
                    continue
                async with upstream:
                    ctype = upstream.headers.get("Content-Type", "application/json")
                    if not ctype.startswith("text/event-stream"):
                        try:
                            data = await upstream.read()
                        except aiohttp.ClientError as e:
                            self._count(model, 502)
                            return self._json(502, error_body(f"replica {rep.name} failed mid-answer: "
                                                              f"{type(e).__name__}", "bad_gateway", 502))
                        self._count(model, upstream.status)
                        return web.Response(status=upstream.status, body=data, headers={"Content-Type": ctype})
                    resp = web.StreamResponse(status=upstream.status,
                                              headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
                    await resp.prepare(request)
                    try:
                        async for chunk in upstream.content.iter_any():
                            await resp.write(chunk)
                    except aiohttp.ClientError:
                        pass  # the replica died mid-stream: end the stream, the client sees no [DONE]
                    self._count(model, upstream.status)
                    await resp.write_eof()
                    return resp
            finally:
                rep.inflight -= 1

    # --- metrics -------------------------------------------------------------------------------------------------
    async def _flush_loop(self, every_s: float = 2.0) -> None:
        while True:
            try:
                self.flush_metrics()
            except Exception:
                pass
            await asyncio.sleep(every_s)

    def flush_metrics(self) -> None:
        if self.sink is None:
            return
        for key, n in list(self.counts.items()):
            d = n - self._flushed.get(key, 0)
            if d:
                self.sink.inc("orchestrator_gateway_requests", d, {"model": key[0], "code": key[1]})
                self._flushed[key] = n
        for r in self.router.replicas.values():
            self.sink.set("orchestrator_gateway_requests_in_flight", r.inflight, {"replica": r.name})
        for m in self.router.models():
            self.sink.set("orchestrator_gateway_healthy_replicas", self.router.healthy_count(m), {"model": m})

    def stats(self) -> dict:
        return {"url": self.url, "version": self.router.version,
                "replicas": [{"name": r.name, "url": r.url, "model": r.model, "healthy": r.healthy,
                              "inflight": r.inflight, "detail": r.detail} for r in self.router.replicas.values()],
                "requests": {f"{m}:{c}": n for (m, c), n in self.counts.items()}}


class GatewayActor:
    """The gateway inside a Ray (async) actor: the server runs on the actor's event loop."""

    def __init__(self) -> None:
        self.gw: Gateway | None = None

    async def start(self, host: str, port: int, api_key: str | None, table: list[dict],
                    reuse_port: bool = False) -> str:
        from orchestrator.cluster.ray_api import RayApi

        if self.gw is not None:
            return self.gw.url
        gw = Gateway(Router(), api_key=api_key, sink=RayApi().metrics_sink())
        gw.set_replicas(table)
        await gw.start(host, port, reuse_port)
        self.gw = gw
        return gw.url

    async def set_replicas(self, table: list[dict]) -> int:
        if self.gw is None:
            return -1
        return self.gw.set_replicas(table)

    async def stats(self) -> dict:
        return self.gw.stats() if self.gw else {}

    async def stop(self) -> None:
        if self.gw is not None:
            await self.gw.stop()
            self.gw = None

    async def ping(self) -> str:
        return self.gw.url if self.gw else ""


def main(argv: list[str] | None = None) -> int:
    """Standalone: ``python -m orchestrator.cluster.gateway --port 8080 --replica w0=http://127.0.0.1:8081``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m orchestrator.cluster.gateway", description=main.__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--model", default="model", help="alias the replicas serve")
    ap.add_argument("--replica", action="append", required=True, metavar="NAME=URL")
    ap.add_argument("--api-key-env", default=None)
    a = ap.parse_args(argv)
    import os

    table = []
    for item in a.replica:
        name, _, url = item.partition("=")
        table.append({"name": name, "url": url.rstrip("/"), "model": a.model, "healthy": True})
    key = os.environ.get(a.api_key_env) if a.api_key_env else None

    async def run() -> None:
        import signal

        gw = Gateway(Router(), api_key=key)
        gw.set_replicas(table)
        url = await gw.start(a.host, a.port)
        print(f"gateway listening on {url}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):   # also when started with SIGINT ignored (a background job)
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await gw.stop()

    try:
        try:
            import uvloop  # as Ray's async actors do: uvloop when it is installed

            uvloop.run(run())
        except ImportError:
            asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
