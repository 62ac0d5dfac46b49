"""The gateway: the pure router, and the HTTP server over real sockets against small upstream servers.

The upstreams here are aiohttp servers that answer like llama-server (JSON and SSE); the end-to-end tests against
real llama-server processes are in tests/integration/test_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web

import orchestrator.cluster.gateway as gateway_mod
from orchestrator.cluster.gateway import Gateway, Router
from orchestrator.cluster.metrics import DictSink


def table(*rows):
    return [{"name": n, "url": f"http://127.0.0.1:{9000 + i}", "model": m, "healthy": h, "detail": ""}
            for i, (n, m, h) in enumerate(rows)]


# --- router ---------------------------------------------------------------------------------------------------
def test_router_picks_fewest_in_flight_and_rotates_ties():
    r = Router()
    r.set_replicas(table(("a", "m", True), ("b", "m", True), ("c", "m", True)))
    r.replicas["a"].inflight = 2
    r.replicas["b"].inflight = 1
    r.replicas["c"].inflight = 1
    picks = {r.pick("m").name for _ in range(6)}
    assert picks == {"b", "c"}
    r.replicas["c"].inflight = 0
    assert all(r.pick("m").name == "c" for _ in range(3))


def test_router_skips_unhealthy_and_excluded_and_only_the_table_takes_a_replica_out():
    r = Router()
    r.set_replicas(table(("a", "m", True), ("b", "m", False), ("c", "m", True)))
    assert r.pick("m", exclude={"a"}).name == "c"
    assert r.pick("m", exclude={"a", "c"}) is None
    r.set_replicas(table(("a", "m", True), ("b", "m", False), ("c", "m", False)))
    assert r.pick("m", exclude={"a"}) is None and r.healthy_count("m") == 1


def test_router_keeps_in_flight_counts_across_table_updates():
    r = Router()
    r.set_replicas(table(("a", "m", True)))
    r.replicas["a"].inflight = 3
    r.set_replicas(table(("a", "m", False)))
    assert r.replicas["a"].inflight == 3 and not r.replicas["a"].healthy


def test_router_model_resolution():
    r = Router()
    r.set_replicas(table(("a", "m", True)))
    assert r.resolve_model("gpt-4o") == "m"        # one alias: any name goes there
    r.set_replicas(table(("a", "m", True), ("b", "n", True)))
    assert r.resolve_model("n") == "n" and r.resolve_model("x") is None and r.resolve_model(None) is None


def test_router_explains_why_nothing_is_healthy():
    r = Router()
    r.set_replicas([{"name": "w0", "url": "u", "model": "m", "healthy": False, "detail": "backoff (killed by SIGKILL)"},
                    {"name": "w1", "url": "u", "model": "m", "healthy": False, "detail": "starting"}])
    msg = r.why_unavailable("m")
    assert "no healthy replica for model 'm'" in msg and "w0: backoff (killed by SIGKILL)" in msg and "w1: starting" in msg


# --- the app over HTTP -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Upstream:
    """A llama-server look-alike: JSON completions, SSE streams, a request log."""

    def __init__(self, name: str, delay: float = 0.0) -> None:
        self.name, self.delay = name, delay
        self.seen: list[dict] = []
        self.headers: list[dict] = []
        self.runner = None
        self.port = free_port()

    async def handle(self, request):
        body = await request.json()
        self.seen.append(body)
        self.headers.append(dict(request.headers))
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'replica': self.name, 'i': i})}\n\n".encode())
                await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.json_response({"replica": self.name, "path": request.path})

    async def start(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def stop(self):
        await self.runner.cleanup()


async def with_gateway(rows, fn, api_key=None, sink=None):
    gw = Gateway(Router(), api_key=api_key, sink=sink)
    gw.set_replicas(rows)
    port = free_port()
    await gw.start("127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as s:
            return await fn(s, f"http://127.0.0.1:{port}", gw)
    finally:
        await gw.stop()


def run(coro):
    return asyncio.run(coro)


def test_completion_and_chat_are_proxied():
    async def go():
        up = await Upstream("u0").start()
        try:
            async def fn(s, base, gw):
                async with s.post(base + "/v1/completions", json={"prompt": "hi", "model": "x"},
                                  headers={"Authorization": "Bearer client-secret"}) as r:
                    assert r.status == 200
                    assert (await r.json()) == {"replica": "u0", "path": "/v1/completions"}
                async with s.post(base + "/v1/chat/completions", json={"messages": []}) as r:
                    assert (await r.json())["path"] == "/v1/chat/completions"
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
            assert up.seen[0] == {"prompt": "hi", "model": "x"}
            assert "Authorization" not in up.headers[0]        # the client's key is not passed on
        finally:
            await up.stop()
    run(go())


def test_stream_is_passed_through_as_it_arrives():
    async def go():
        up = await Upstream("u0").start()
        try:
            async def fn(s, base, gw):
                loop = asyncio.get_running_loop()
                async with s.post(base + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                    times, events = [], []
                    async for line in r.content:
                        line = line.decode().strip()
                        if line.startswith("data:"):
                            events.append(line[5:].strip())
                            times.append(loop.time())
                assert events[-1] == "[DONE]" and [json.loads(e)["i"] for e in events[:-1]] == [0, 1, 2]
                # chunks arrive spread out (the upstream sleeps 50 ms between them), not all at the end
                assert times[2] - times[0] > 0.07
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
        finally:
            await up.stop()
    run(go())


def test_least_in_flight_spreads_concurrent_requests():
    async def go():
        a, b = await Upstream("a", delay=0.3).start(), await Upstream("b", delay=0.3).start()
        try:
            async def fn(s, base, gw):
                async def one():
                    async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                        return (await r.json())["replica"]
                got = await asyncio.gather(*[one() for _ in range(8)])
                assert sorted(got).count("a") == 4 and sorted(got).count("b") == 4
                assert all(r.inflight == 0 for r in gw.router.replicas.values())
            await with_gateway([{"name": "a", "url": a.url, "model": "m", "healthy": True},
                                {"name": "b", "url": b.url, "model": "m", "healthy": True}], fn)
        finally:
            await a.stop()
            await b.stop()
    run(go())


def test_refused_replica_is_skipped_and_the_request_succeeds_elsewhere():
    async def go():
        b = await Upstream("b").start()
        dead = f"http://127.0.0.1:{free_port()}"            # nothing listens there (a killed llama-server)
        try:
            async def fn(s, base, gw):
                for _ in range(4):
                    async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                        assert r.status == 200 and (await r.json())["replica"] == "b"
                # only the health checks (the routing table) take a replica out, not one refused connect
                assert gw.router.replicas["dead"].healthy and gw.router.healthy_count("m") == 2
            await with_gateway([{"name": "dead", "url": dead, "model": "m", "healthy": True},
                                {"name": "b", "url": b.url, "model": "m", "healthy": True}], fn)
        finally:
            await b.stop()
    run(go())


class OneRequestPerConnection:
    """An upstream that answers the first request on each connection (keep-alive) and closes the connection without
    an answer when a second request arrives on it, as a server does that closed an idle kept-alive connection just
    as the client reused it."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self.port = free_port()
        self.server = None

    async def _conn(self, reader, writer):
        self.connections += 1
        try:
            for n in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                               if ln.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if n == 1:
                    break                      # the second request on this connection: close, no answer
                body = json.dumps({"replica": "one"}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def start(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)
        return self

    async def stop(self):
        self.server.close()
        await self.server.wait_closed()


def test_a_pooled_connection_closed_by_the_server_is_retried_not_quarantined():
    """One replica; every request after the first goes down a kept-alive connection that the server closes: the
    gateway retries on a fresh connection, the client sees only 200s, and the replica stays healthy."""
    async def go():
        up = await OneRequestPerConnection().start()
        try:
            async def fn(s, base, gw):
                for _ in range(4):
                    async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                        assert r.status == 200, await r.text()
                        assert (await r.json())["replica"] == "one"
                assert gw.router.healthy_count() == 1 and not gw.router.replicas["one"].detail.startswith("unre")
            await with_gateway([{"name": "one", "url": f"http://127.0.0.1:{up.port}", "model": "m",
                                 "healthy": True}], fn)
            assert up.answered == 4 and up.connections >= 4
        finally:
            await up.stop()
    run(go())


def test_503_with_json_reason_when_no_replica_is_healthy():
    async def fn(s, base, gw):
        async with s.post(base + "/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 503 and r.headers["Content-Type"].startswith("application/json")
            err = (await r.json())["error"]
            assert err["type"] == "service_unavailable" and "w0: backoff (killed by SIGKILL)" in err["message"]
        async with s.get(base + "/health") as r:
            assert r.status == 503
    run(with_gateway([{"name": "w0", "url": "http://127.0.0.1:1", "model": "m", "healthy": False,
                       "detail": "backoff (killed by SIGKILL)"}], fn))


def test_api_key_required_when_configured():
    async def go():
        up = await Upstream("u0").start()
        try:
            async def fn(s, base, gw):
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
                async with s.post(base + "/v1/completions", json={"prompt": "x"},
                                  headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401
                async with s.get(base + "/v1/models") as r:
                    assert r.status == 401
                async with s.post(base + "/v1/completions", json={"prompt": "x"},
                                  headers={"Authorization": "Bearer s3cret"}) as r:
                    assert r.status == 200
                async with s.get(base + "/health") as r:    # health needs no key
                    assert r.status == 200
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn, api_key="s3cret")
            assert len(up.seen) == 1
        finally:
            await up.stop()
    run(go())


def test_the_replicas_key_is_added_upstream_and_the_clients_never_goes_there():
    async def go():
        up = await Upstream("u0").start()
        try:
            gw = Gateway(Router(), api_key="client-key", upstream_key="server-key")
            gw.set_replicas([{"name": "w0", "url": up.url, "model": "m", "healthy": True}])
            port = free_port()
            await gw.start("127.0.0.1", port)
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"},
                                      headers={"Authorization": "Bearer client-key"}) as r:
                        assert r.status == 200 and "server-key" not in await r.text()
                        assert not any("server-key" in v for v in r.headers.values())
            finally:
                await gw.stop()
            assert up.headers[0]["Authorization"] == "Bearer server-key"
            assert "client-key" not in json.dumps(up.headers[0])
        finally:
            await up.stop()
    run(go())


def test_models_lists_aliases_and_unknown_model_is_404_with_several():
    async def go():
        a, b = await Upstream("a").start(), await Upstream("b").start()
        try:
            async def fn(s, base, gw):
                async with s.get(base + "/v1/models") as r:
                    data = (await r.json())["data"]
                    assert [d["id"] for d in data] == ["big", "small"] and data[0]["object"] == "model"
                async with s.post(base + "/v1/completions", json={"model": "small", "prompt": "x"}) as r:
                    assert (await r.json())["replica"] == "b"
                async with s.post(base + "/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
                    assert r.status == 404 and "available: big, small" in (await r.json())["error"]["message"]
            await with_gateway([{"name": "a", "url": a.url, "model": "big", "healthy": True},
                                {"name": "b", "url": b.url, "model": "small", "healthy": True}], fn)
        finally:
            await a.stop()
            await b.stop()
    run(go())


def test_metrics_are_flushed_to_the_sink():
    async def go():
        up = await Upstream("u0").start()
        sink = DictSink()
        try:
            async def fn(s, base, gw):
                for _ in range(3):
                    async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                        await r.read()
                gw.flush_metrics()
                gw.flush_metrics()                       # counters are not double counted
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn, sink=sink)
        finally:
            await up.stop()
        assert sink.get("orchestrator_gateway_requests", model="m", code="200") == 3.0
        assert sink.get("orchestrator_gateway_healthy_replicas", model="m") == 1.0
        assert sink.get("orchestrator_gateway_requests_in_flight", replica="w0") == 0.0
    run(go())


def test_start_on_a_taken_port_raises_oserror():
    async def go():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            gw = Gateway(Router())
            with pytest.raises(OSError):
                await gw.start("127.0.0.1", s.getsockname()[1])
    run(go())


def test_pooled_connections_of_a_replaced_process_are_closed():
    """A dead llama-server's port stays in FIN-WAIT-2 while the gateway keeps its kept-alive connections open,
    and its replacement cannot bind it: the gateway closes a replica's pool when its process changes."""
    async def go():
        up = await Upstream("u0").start()
        try:
            async def fn(s, base, gw):
                row = {"name": "w0", "url": up.url, "model": "m", "healthy": True, "pid": 100}
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                    await r.read()
                server = up.runner.server
                assert len(server.connections) == 1                    # kept alive by the gateway's pool
                gw.set_replicas([row])                                 # same process: the pool stays
                await asyncio.sleep(0.2)
                assert len(server.connections) == 1
                gw.set_replicas([{**row, "healthy": False, "pid": None}])   # the process died
                for _ in range(20):
                    await asyncio.sleep(0.05)
                    if not server.connections:
                        break
                assert server.connections == []
                gw.set_replicas([{**row, "pid": 101}])                  # the new one is served on a new pool
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True, "pid": 100}], fn)
        finally:
            await up.stop()
    run(go())


# --- the HTTP layer itself: framing, clients that go away, replicas that die, connection reuse ----------------------

class SlowStream:
    """An upstream that streams one SSE event every ``every`` seconds until told to stop, and records when its
    client (the gateway) went away; ``die_after``: drop the connection after that many events."""

    def __init__(self, every: float = 0.05, die_after: int | None = None, events: int = 1000,
                 lead: float = 0.0) -> None:
        self.every, self.die_after, self.events, self.lead = every, die_after, events, lead
        self.port = free_port()
        self.server = None
        self.connections = 0
        self.gone = asyncio.Event()

    async def _conn(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                               if ln.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length))
                if not body.get("stream"):
                    out = json.dumps({"big": "x" * body.get("size", 10)}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                 + str(len(out)).encode() + b"\r\n\r\n" + out)
                    await writer.drain()
                    continue
                await asyncio.sleep(self.lead)           # "prompt processing" before the first event
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for i in range(self.events):
                    if self.die_after is not None and i == self.die_after:
                        writer.transport.abort()
                        return
                    ev = f"data: {json.dumps({'i': i})}\n\n".encode()
                    writer.write(b"%x\r\n%b\r\n" % (len(ev), ev))
                    await writer.drain()
                    await asyncio.sleep(self.every)
                ev = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(ev), ev))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.gone.set()
        writer.close()

    async def start(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def stop(self):
        self.server.close()


async def raw_exchange(port: int, request: bytes, until: bytes | None = None, timeout: float = 5.0) -> bytes:
    """Sends raw bytes to the gateway and reads until ``until`` appears or the connection closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while until is None or until not in data:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                data += chunk
    finally:
        writer.close()
    return data


async def with_gateway_port(rows, fn):
    gw = Gateway(Router())
    gw.set_replicas(rows)
    port = free_port()
    await gw.start("127.0.0.1", port)
    try:
        return await fn(port, gw)
    finally:
        await gw.stop()


def test_expect_100_continue_gets_its_interim_answer():
    """curl sends ``Expect: 100-continue`` for bodies over 1 KiB and waits a second for the interim answer."""
    async def go():
        up = await Upstream("u0").start()
        try:
            async def fn(port, gw):
                body = json.dumps({"prompt": "x" * 4000}).encode()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                             b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
                interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
                assert interim.startswith(b"HTTP/1.1 100 Continue")
                writer.write(body)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200 OK")
                writer.close()
            await with_gateway_port([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
            assert up.seen[0]["prompt"] == "x" * 4000
        finally:
            await up.stop()
    run(go())


def test_http10_client_gets_a_close_delimited_stream_and_bad_requests_get_4xx():
    async def go():
        up = await SlowStream(every=0.01, events=3).start()
        try:
            async def fn(port, gw):
                body = b'{"stream": true}'
                got = await raw_exchange(port, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                head, _, rest = got.partition(b"\r\n\r\n")
                assert b"Transfer-Encoding" not in head and b"Connection: close" in head
                assert rest.count(b"data:") == 4 and rest.endswith(b"data: [DONE]\n\n")   # raw events, no chunk sizes
                got = await raw_exchange(port, b"GET /nope HTTP/1.1\r\nHost: gw\r\n\r\n", until=b"}}")
                assert got.startswith(b"HTTP/1.1 404") and b"no route /nope" in got
                got = await raw_exchange(port, b"GET /v1/completions HTTP/1.1\r\nHost: gw\r\n\r\n", until=b"}}")
                assert got.startswith(b"HTTP/1.1 405")
                got = await raw_exchange(port, b"BLAH\r\n\r\n")
                assert got.startswith(b"HTTP/1.1 400") and b"malformed" in got
                # an Upgrade is ignored (RFC 9110 7.8): the request is served as HTTP/1.1, no 101
                got = await raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\n"
                                         b"Upgrade: websocket\r\n\r\n", until=b"]}")
                assert got.startswith(b"HTTP/1.1 200") and b'"id": "m"' in got
                got = await raw_exchange(port, b"CONNECT gw:443 HTTP/1.1\r\nHost: gw:443\r\n\r\n")
                assert got.startswith(b"HTTP/1.1 405") and b"CONNECT is not supported" in got
            await with_gateway_port([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
        finally:
            await up.stop()
    run(go())


def test_a_client_that_goes_away_mid_stream_closes_the_upstream_connection():
    """So llama-server notices and stops generating for nobody; the replica's in-flight count returns to 0."""
    async def go():
        up = await SlowStream(every=0.02).start()
        try:
            async def fn(port, gw):
                body = b'{"stream": true}'
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                data = b""
                while data.count(b"data:") < 3:
                    data += await asyncio.wait_for(reader.read(4096), 5)
                assert gw.router.replicas["w0"].inflight == 1
                writer.transport.abort()
                await asyncio.wait_for(up.gone.wait(), 5)
                for _ in range(50):
                    if gw.router.replicas["w0"].inflight == 0:
                        break
                    await asyncio.sleep(0.02)
                assert gw.router.replicas["w0"].inflight == 0
            await with_gateway_port([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
        finally:
            await up.stop()
    run(go())


def test_a_replica_dying_mid_stream_is_a_visibly_cut_stream_and_mid_answer_is_502():
    """A stream cut short by its replica: an error event, then the connection ends without the last chunk, so
    the client's HTTP library reports an incomplete answer (it used to end like a complete one)."""
    async def go():
        up = await SlowStream(every=0.01, die_after=3).start()
        try:
            async def fn(s, base, gw):
                events = []
                with pytest.raises(aiohttp.ClientPayloadError):
                    async with s.post(base + "/v1/completions", json={"stream": True}) as r:
                        assert r.status == 200
                        async for ln in r.content:
                            if ln.startswith(b"data:"):
                                events.append(ln)
                assert len(events) == 4 and b"[DONE]" not in events[2]
                err = json.loads(events[3][5:])["error"]
                assert err["code"] == 502 and "failed mid-stream" in err["message"]
                async with s.post(base + "/v1/completions", json={"stream": True}) as r:   # and it serves again
                    assert r.status == 200
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
        finally:
            await up.stop()

        class HalfAnswer(OneRequestPerConnection):
            async def _conn(self, reader, writer):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                              if ln.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
                await writer.drain()
                writer.transport.abort()

        half = await HalfAnswer().start()
        try:
            async def fn2(s, base, gw):
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 502 and "failed mid-answer" in (await r.json())["error"]["message"]
            await with_gateway([{"name": "h", "url": f"http://127.0.0.1:{half.port}", "model": "m",
                                 "healthy": True}], fn2)
        finally:
            await half.stop()
    run(go())


def test_large_bodies_both_ways_and_one_kept_alive_upstream_connection():
    async def go():
        up = await SlowStream().start()
        try:
            async def fn(s, base, gw):
                for size in (10, 3_000_000, 10):
                    async with s.post(base + "/v1/completions", json={"size": size, "pad": "y" * 2_000_000}) as r:
                        assert r.status == 200 and len((await r.json())["big"]) == size
                assert up.connections == 1          # sequential requests reuse the pooled connection
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
        finally:
            await up.stop()
    run(go())


def test_idle_upstream_connections_are_closed_before_the_server_would(monkeypatch):
    """llama-server closes a kept-alive connection after 5 s idle; the gateway lets go of it sooner."""
    monkeypatch.setattr(gateway_mod, "UPSTREAM_KEEPALIVE_S", 0.3)

    async def go():
        up = await Upstream("u0").start()
        try:
            async def fn(s, base, gw):
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:
                    await r.read()
                server = up.runner.server
                assert len(server.connections) == 1
                for _ in range(40):                  # the housekeeping pass runs every second
                    await asyncio.sleep(0.1)
                    if not server.connections:
                        break
                assert server.connections == []
                async with s.post(base + "/v1/completions", json={"prompt": "x"}) as r:   # a fresh one
                    assert r.status == 200
            await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn)
        finally:
            await up.stop()
    run(go())


def test_latency_of_streams_is_measured_per_model_and_replica():
    """Time to first token, request duration and tokens/s per stream go to histograms (through the sink) and to
    the window of the last minutes that ``status`` reads; an upstream that waits 0.3 s before its first event and
    then sends one every 50 ms shows as such."""
    from orchestrator.cluster.metrics import BUCKETS, METRICS, TAG_KEYS

    async def go():
        up = await SlowStream(every=0.05, events=6, lead=0.3).start()
        sink = DictSink()
        try:
            async def fn(s, base, gw):
                for _ in range(2):
                    async with s.post(base + "/v1/completions", json={"stream": True}) as r:
                        assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
                async with s.post(base + "/v1/completions", json={"size": 5}) as r:   # not streamed
                    assert r.status == 200
                gw.flush_metrics()
                return gw.stats()["recent"]
            recent = await with_gateway([{"name": "w0", "url": up.url, "model": "m", "healthy": True}], fn, sink=sink)
        finally:
            await up.stop()
        tags = {"model": "m", "replica": "w0"}
        ttft = sink.observations("orchestrator_gateway_time_to_first_token_seconds", **tags)
        tps = sink.observations("orchestrator_gateway_stream_tokens_per_second", **tags)
        dur = sink.observations("orchestrator_gateway_request_duration_seconds", **tags)
        assert len(ttft) == 2 and all(0.28 < t < 0.6 for t in ttft), ttft           # only the streams
        assert len(tps) == 2 and all(10 < x < 21 for x in tps), tps                  # 5 gaps of >= 50 ms
        assert len(dur) == 3 and all(d > 0.55 for d in sorted(dur)[1:]), dur         # 0.3 s + 6 x 50 ms
        row = recent["w0"]
        assert row["streams"] == 2 and 0.2 < row["ttft_p50_s"] <= row["ttft_p95_s"] < 0.75
        assert 7.5 <= row["tokens_per_s_p50"] <= 20
        le = sink.get("orchestrator_gateway_recent_time_to_first_token", replica="w0", le="+Inf")
        assert le == 2.0 and sink.get("orchestrator_gateway_recent_time_to_first_token", replica="w0",
                                      le="0.2") == 0.0
        # everything the gateway writes is declared, with its tag keys (and bounds for histograms)
        for name, tagset in list(sink.values) + list(sink.observed):
            assert name in METRICS and tuple(sorted(TAG_KEYS[name])) == tuple(sorted(k for k, _ in tagset))
        assert {n for n, _ in sink.observed} <= set(BUCKETS)
    run(go())
