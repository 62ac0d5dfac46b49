"""One request's fault stays that request's: over real sockets, a request that times out, gets a malformed answer
or cannot connect fails alone; other streams on the same replica run to their end and the replica stays in the
rotation. Also the framing around such faults: an error after a partial SSE event, and ``100 Continue`` for a
pipelined request while a stream runs. Connection limits hold without refusing many clients behind one address.

The upstream is a small asyncio server scripted by the request body; the gateway is the real one."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

import orchestrator.cluster.gateway as G
from orchestrator.cluster.gateway import Gateway, Router
from cluster_support import free_port


def run(coro):
    return asyncio.run(coro)


class Scripted:
    """An upstream that does what each request's JSON body says: ``{"stream": true, "events": n, "every": s}``
    streams n SSE events; ``{"hang": true}`` never answers; ``{"malformed": true}`` answers a broken head; ``{"delay": s}`` answers JSON after s seconds;
    ``{"partial": true, "stream": true}`` sends one event and half of the next, then drops the connection."""

    def __init__(self, name: str = "w0") -> None:
        self.port = free_port()
        self.server = None
        self.requests = 0
        self.name = name
        self.loading = False      # answer every request as llama-server does while it loads its model

    async def _conn(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                               if ln.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length) or b"{}")
                self.requests += 1
                if self.loading:
                    out = json.dumps({"error": {"message": "Loading model", "type": "unavailable_error",
                                                "code": 503}}).encode()
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(out)).encode() + b"\r\n\r\n" + out)
                    await writer.drain()
                    continue
                if body.get("hang"):
                    await asyncio.sleep(3600)
                if body.get("malformed"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n{}")
                    await writer.drain()
                    continue
                if body.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                    if body.get("partial"):
                        for ev in (b'data: {"id": "a", "choices": []}\n\n', b'data: {"id"'):
                            writer.write(b"%x\r\n%b\r\n" % (len(ev), ev))
                            await writer.drain()
                            await asyncio.sleep(0.05)
                        writer.transport.abort()
                        return
                    for i in range(body.get("events", 3)):
                        ev = f"data: {json.dumps({'i': i})}\n\n".encode()
                        writer.write(b"%x\r\n%b\r\n" % (len(ev), ev))
                        await writer.drain()
                        await asyncio.sleep(body.get("every", 0.01))
                    ev = b"data: [DONE]\n\n"
                    writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(ev), ev))
                    await writer.drain()
                    continue
                await asyncio.sleep(body.get("delay", 0))
                out = json.dumps({"ok": True}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(out)).encode() + b"\r\n\r\n" + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        writer.close()

    async def start(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)
        return self

    def stop_listening(self) -> None:
        """No new connections (connect is refused); the ones open stay and go on streaming."""
        self.server.close()

    @property
    def row(self):
        return {"name": self.name, "url": f"http://127.0.0.1:{self.port}", "model": "m", "healthy": True}


async def gateway(rows, **kw) -> tuple[Gateway, str]:
    gw = Gateway(Router(), **kw)
    gw.set_replicas(rows)
    port = free_port()
    await gw.start("127.0.0.1", port)
    return gw, f"http://127.0.0.1:{port}"


async def stream(s: aiohttp.ClientSession, url: str, events: int, every: float) -> list[bytes]:
    """A whole streamed answer's SSE events; raises when the stream is cut."""
    async with s.post(url + "/v1/completions", json={"stream": True, "events": events, "every": every}) as r:
        assert r.status == 200
        data = await r.read()
    return [e for e in data.split(b"\n\n") if e]


# --- fault isolation ------------------------------------------------------------------------------------------------
def test_a_request_that_times_out_cuts_no_other_stream_and_takes_no_replica_out():
    """A streamed request whose replica sent nothing for the upstream timeout got 504, marked the replica
    failed (503 for everyone for 2 s) and the next request closed the replica's connection pool, cutting the
    healthy streams on it. Now: 504 for that request only (and 502 for a malformed answer); the others stream to
    their end, new requests are served at once, and a non-streamed answer slower than that timeout (a long
    generation) is waited for."""
    async def go():
        up = await Scripted().start()
        gw, url = await gateway([up.row], upstream_idle_s=0.5)
        try:
            async with aiohttp.ClientSession() as s:
                running = [asyncio.ensure_future(stream(s, url, 30, 0.05)) for _ in range(3)]
                await asyncio.sleep(0.1)
                async with s.post(url + "/v1/completions", json={"stream": True, "hang": True}) as r:
                    assert r.status == 504
                async with s.post(url + "/v1/completions", json={"malformed": True}) as r:
                    assert r.status == 502
                async with s.post(url + "/v1/completions", json={"delay": 0}) as r:
                    assert r.status == 200, await r.text()         # not 503: the replica is in the rotation
                for events in await asyncio.gather(*running):      # none cut
                    assert len(events) == 31 and events[-1] == b"data: [DONE]"
                async with s.post(url + "/v1/completions", json={"delay": 1.2}) as r:
                    assert r.status == 200 and (await r.json()) == {"ok": True}
        finally:
            await gw.stop()
            up.stop_listening()
    run(go())


def test_a_failed_connect_cuts_no_stream_on_the_same_replica():
    """A connect that failed marked the replica failed and closed its pool, cutting the streams it carried."""
    async def go():
        up = await Scripted().start()
        gw, url = await gateway([up.row])
        try:
            async with aiohttp.ClientSession() as s:
                running = [asyncio.ensure_future(stream(s, url, 30, 0.05)) for _ in range(2)]
                await asyncio.sleep(0.2)
                up.stop_listening()
                async with aiohttp.ClientSession() as fresh:       # its own connection to the gateway
                    async with fresh.post(url + "/v1/completions", json={}) as r:
                        assert r.status == 503 and "unreachable" in (await r.json())["error"]["message"]
                for events in await asyncio.gather(*running):
                    assert len(events) == 31 and events[-1] == b"data: [DONE]"
                await up.start()                                   # listening again: served at once
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.post(url + "/v1/completions", json={}) as r:
                        assert r.status == 200
        finally:
            await gw.stop()
            up.stop_listening()
    run(go())


# --- SSE framing of an error after a partial event ------------------------------------------------------------------
def test_an_error_after_a_partial_event_starts_at_an_event_boundary():
    """The gateway's error event was written right after ``data: {"id"`` (half an event), so every SSE client
    read one broken event. Now the partial event is dropped and the error is an event of its own."""
    async def go():
        up = await Scripted().start()
        gw, url = await gateway([up.row])
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", json={"stream": True, "partial": True}) as r:
                    data = b""
                    with pytest.raises(aiohttp.ClientPayloadError):
                        async for chunk in r.content.iter_any():
                            data += chunk
            events = [e for e in data.split(b"\n\n") if e]
            assert data.endswith(b"\n\n"), data
            assert [json.loads(e.removeprefix(b"data: ")) for e in events][0] == {"id": "a", "choices": []}
            err = json.loads(events[-1].removeprefix(b"data: "))
            assert err["error"]["code"] == 502 and "failed mid-stream" in err["error"]["message"]
        finally:
            await gw.stop()
            up.stop_listening()
    run(go())


def test_the_openai_client_raises_its_api_error_on_a_stream_cut_mid_event():
    openai = pytest.importorskip("openai")

    async def go():
        up = await Scripted().start()
        gw, url = await gateway([up.row])
        try:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            got = await client.chat.completions.create(model="m", messages=[], stream=True,
                                                       extra_body={"partial": True})
            with pytest.raises(openai.APIError) as e:
                async for _ in got:
                    pass
            assert "failed mid-stream" in str(e.value)
            await client.close()
        finally:
            await gw.stop()
            up.stop_listening()
    run(go())


# --- 100 Continue never inside a running stream ---------------------------------------------------------------------
def test_100_continue_for_a_pipelined_request_waits_for_the_stream_before_it():
    """The interim answer to a pipelined request's ``Expect: 100-continue`` was written as soon as its head was
    read, into the middle of the chunked stream answering the request before it."""
    async def go():
        up = await Scripted().start()
        gw, url = await gateway([up.row])
        try:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            first = json.dumps({"stream": True, "events": 10, "every": 0.05}).encode()
            second = json.dumps({"delay": 0}).encode()
            post = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            writer.write(post + b"Content-Length: %d\r\n\r\n%b" % (len(first), first)
                         + post + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(second))
            data = b""
            async with asyncio.timeout(5):
                while b"100 Continue" not in data:
                    chunk = await reader.read(65536)
                    assert chunk, data
                    data += chunk
            stream_end = data.find(b"\r\n0\r\n\r\n")
            assert 0 < stream_end < data.find(b"HTTP/1.1 100 Continue"), data
            writer.write(second)
            async with asyncio.timeout(5):
                while not data.endswith(b'{"ok": true}'):
                    chunk = await reader.read(65536)
                    assert chunk, data
                    data += chunk
            assert data.count(b"HTTP/1.1 200 OK") == 2
            writer.close()
        finally:
            await gw.stop()
            up.stop_listening()
    run(go())


# --- connection limits that hold with many clients behind one address -----------------------------------------------
def test_many_streams_from_one_address_are_all_served():
    """Every local client, and every client behind a reverse proxy, has one address: the per-address cap on all
    connections refused streams beyond it (600 from one address: 88 refused). Connections being answered are
    not capped per address now, only those waiting."""
    async def go():
        up = await Scripted().start()
        gw, url = await gateway([up.row], max_waiting_per_address=8)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                got = await asyncio.gather(*(stream(s, url, 10, 0.05) for _ in range(48)))
            assert all(len(events) == 11 and events[-1] == b"data: [DONE]" for events in got)
        finally:
            await gw.stop()
            up.stop_listening()
    run(go())


def test_slow_bodies_from_one_address_do_not_hold_off_its_other_clients():
    """Clients sending their bodies slowly held every connection their address was allowed, and the other
    clients of that address were refused until the bodies expired. Now a new connection is served, and when
    its address has as many connections waiting for WAITING_AFTER_S as allowed, the one waiting longest is
    closed (503 saying why)."""
    async def go():
        up = await Scripted().start()
        gw, url = await gateway([up.row], max_waiting_per_address=3)
        port = int(url.rsplit(":", 1)[1])
        try:
            slow = []
            for _ in range(3):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{")
                slow.append((r, w))
                await asyncio.sleep(0.05)
            await asyncio.sleep(G.WAITING_AFTER_S)
            t = time.monotonic()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                for _ in range(5):
                    async with s.post(url + "/v1/completions", json={}) as r:
                        assert r.status == 200
            assert time.monotonic() - t < 2
            got = await asyncio.wait_for(slow[0][0].read(), 2)
            assert got.startswith(b"HTTP/1.1 503") and b"too many unanswered connections from 127.0.0.1" in got
            assert sum(1 for c in gw._by_address["127.0.0.1"] if c.waiting) == 2     # the cap holds
            for _, w in slow:
                w.close()
        finally:
            await gw.stop()
            up.stop_listening()
    run(go())


def test_the_connection_cap_is_sized_from_the_deployments_slots():
    gw = Gateway(Router())
    gw.set_replicas([{"name": f"w{i}", "url": "http://127.0.0.1:1", "model": "m", "healthy": True, "slots": 32}
                     for i in range(4)])
    room = G._connection_room()
    assert gw.max_connections == min(room, max(G.MIN_CONNECTIONS, 4 * 32 * G.CONNECTIONS_PER_SLOT))
    gw.set_replicas([{"name": "w0", "url": "http://127.0.0.1:1", "model": "m", "healthy": True}])
    assert gw.max_connections == min(room, max(G.MIN_CONNECTIONS, G.DEFAULT_SLOTS * G.CONNECTIONS_PER_SLOT))
    assert Gateway(Router(), max_connections=5).max_connections == 5


def test_the_docs_state_the_limits_the_code_has():
    """docs/cluster.md's gateway section names each limit; the numbers there are the constants here."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    section = doc[doc.index("## The gateway"):doc.index("## Metrics")]
    text = " ".join(section.split())
    expect = [
        f"at least {G.MIN_CONNECTIONS} connections per gateway process",
        f"{G.CONNECTIONS_PER_SLOT} per slot",
        f"counting a replica whose slots the table does not give as {G.DEFAULT_SLOTS}",
        f"at most {G.MAX_WAITING_PER_ADDRESS} waiting connections per client address",
        f"request line + headers {G.MAX_HEAD >> 10} KiB", f"{G.MAX_HEADERS} headers", f"URL {G.MAX_URL >> 10} KiB",
        f"body {G.MAX_BODY >> 20} MiB", f"{G.HEADER_TIMEOUT_S:g} s from a request's first byte",
        f"{G.BODY_TIMEOUT_S:g} s of silence", f"{G.MIN_BODY_RATE >> 10} KiB/s",
        f"{G.IDLE_TIMEOUT_S:g} s keep-alive idle",
        f"{G.SEND_TIMEOUT_S:g} s of a client reading nothing", f"{G.MAX_PIPELINED} requests wait",
        f"sends nothing for {G.UPSTREAM_IDLE_S:g} s", f"up to {G.UPSTREAM_ANSWER_S / 3600:g} h",
        f"once it has waited {G.WAITING_AFTER_S:g} s", f"up to {G.MAX_HELD_EVENT >> 20} MiB",
        f"max age of {G.CORS_MAX_AGE_S} s",
    ]
    missing = [e for e in expect if e not in text]
    assert not missing, missing
    # and no number the code no longer has
    assert "512 from one client address" not in text and "skipped for 2 s" not in text


def test_a_replica_still_loading_its_model_hands_the_request_to_another():
    """A restarted llama-server listens before its model is loaded and answers 503 "Loading model"; while the
    health checks still count it in, requests sent to it went back to the client as that 503. Now the gateway
    tries another replica (nothing reached the client yet), and says why when none could take it."""
    async def go():
        loading, ready = await Scripted("w0").start(), await Scripted("w1").start()
        loading.loading = True
        gw, url = await gateway([loading.row, ready.row])
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(8):
                    async with s.post(url + "/v1/completions", json={}) as r:
                        assert r.status == 200 and (await r.json()) == {"ok": True}
                async with s.post(url + "/v1/completions", json={"stream": True, "events": 2}) as r:
                    assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            assert loading.requests >= 1 and ready.requests >= 9
            gw.set_replicas([loading.row])
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={}) as r:
                    msg = (await r.json())["error"]["message"]
                    assert r.status == 503 and "w0 unavailable (Loading model)" in msg, msg
        finally:
            await gw.stop()
            loading.stop_listening()
            ready.stop_listening()
    run(go())
