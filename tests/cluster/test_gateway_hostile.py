"""The gateway against hostile HTTP, over real sockets: what a client may send is bounded (head size, header
count, URL, body, time, connections, unread answers), a refused request is answered before its body is read, and
what a replica sends back is checked (one answer per request, 1xx skipped, a hung or cut answer reported).

Upstreams are small asyncio servers speaking raw HTTP (they misbehave on purpose); the gateway is the real one."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

import orchestrator.cluster.gateway as G
from orchestrator.cluster.gateway import Gateway, Router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(coro):
    return asyncio.run(coro)


class Raw:
    """An upstream that answers each request with ``answer(n)`` raw bytes (n: requests so far on this server)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.n = 0
        self.connections = 0
        self.port = free_port()

    async def _conn(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                               if ln.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.n += 1
                data = self.answer(self.n)
                if data is None:                 # hang: never answer
                    await asyncio.sleep(3600)
                writer.write(data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        writer.close()

    async def start(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)
        return self

    @property
    def row(self):
        return {"name": "w0", "url": f"http://127.0.0.1:{self.port}", "model": "m", "healthy": True}

    async def stop(self):
        self.server.close()


def ok(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


async def gateway(rows, **kw) -> tuple[Gateway, int]:
    gw = Gateway(Router(), **kw)
    gw.set_replicas(rows)
    port = free_port()
    await gw.start("127.0.0.1", port)
    return gw, port


async def exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` (errors from a server that stops reading are fine), read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError:
            pass
        async with asyncio.timeout(timeout):
            while True:
                try:
                    chunk = await reader.read(65536)
                except ConnectionError:
                    break
                if not chunk:
                    break
                got += chunk
    finally:
        writer.close()
    return got


POST = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


def test_200k_copies_of_one_header_are_refused_at_once_and_others_are_served():
    """3.3 MiB of one repeated header froze every client for 75 s (each copy was joined into a growing string)."""
    async def go():
        up = await Raw(lambda n: ok(b'{"ok": true}')).start()
        gw, port = await gateway([up.row])
        try:
            t = time.monotonic()
            attack = asyncio.ensure_future(exchange(port, b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 200_000
                                                    + b"\r\n"))
            healthy = await exchange(port, b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
            got = await attack
            assert got.startswith(b"HTTP/1.1 431") and healthy.startswith(b"HTTP/1.1 200")
            assert time.monotonic() - t < 2
        finally:
            await gw.stop()
            await up.stop()
    run(go())


@pytest.mark.parametrize("request_bytes,status,why", [
    (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (8 << 20) + b"\r\n\r\n", 431, b"over 64 KiB"),
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n", 431,
     b"more than 100 headers"),
    (b"GET /" + b"a" * (9 << 10) + b" HTTP/1.1\r\nHost: gw\r\n\r\n", 414, b"URL over 8 KiB"),
    (b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\n\r\n", 431, b"over 64 KiB"),
])
def test_head_limits(request_bytes, status, why):
    async def go():
        gw, port = await gateway([])
        try:
            got = await exchange(port, request_bytes)
            assert got.startswith(b"HTTP/1.1 %d" % status) and why in got, got[:200]
            assert b"Connection: close" in got
        finally:
            await gw.stop()
    run(go())


def test_twenty_unfinished_8_mib_headers_hold_little():
    """Heads that never end: the parser is fed at most 64 KiB of each, so 20 of them cannot hold 160 MiB."""
    async def go():
        gw, port = await gateway([])
        try:
            conns = []
            for _ in range(20):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (8 << 20))   # no end of line, no end of head
                conns.append((r, w))
            answers = await asyncio.gather(*[asyncio.wait_for(r.read(4096), 10) for r, _ in conns])
            assert all(a.startswith(b"HTTP/1.1 431") for a in answers)
            for _, w in conns:
                w.close()
        finally:
            await gw.stop()
    run(go())


def test_a_wrong_key_is_answered_before_the_body_and_without_100_continue():
    """Six clients with a wrong key and a 100 MiB body took the gateway from 26 MiB to 1.5 GiB: now the key is
    checked on the head, the answer is 401 at once, no '100 Continue', and the connection is closed unread."""
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway([up.row], api_key="right")
        try:
            for expect in (b"Expect: 100-continue\r\n", b""):
                t = time.monotonic()
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(POST + b"Authorization: Bearer wrong\r\n" + expect + b"Content-Length: 104857600\r\n\r\n")
                got = await asyncio.wait_for(r.read(65536), 5)
                assert got.startswith(b"HTTP/1.1 401") and b"100 Continue" not in got
                assert b"invalid_api_key" in got and time.monotonic() - t < 2
                assert await asyncio.wait_for(r.read(65536), 5) == b""          # closed: the body is never read
                w.close()
            # and with the body on its way (a client that does not wait for 100 Continue): same answer
            got = await exchange(port, POST + b"Content-Length: 4194304\r\n\r\n" + b"x" * (4 << 20))
            assert got.startswith(b"HTTP/1.1 401")
            assert up.n == 0
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_a_body_over_the_cap_is_413_before_it_is_read():
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway([up.row])
        try:
            got = await exchange(port, POST + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (G.MAX_BODY + 1))
            assert got.startswith(b"HTTP/1.1 413") and b"100 Continue" not in got
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b"y" * (1 << 20))
            got = await exchange(port, POST + b"Transfer-Encoding: chunked\r\n\r\n"
                                 + chunk * ((G.MAX_BODY >> 20) + 2), timeout=20)
            assert got.startswith(b"HTTP/1.1 413")
            assert up.n == 0
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_slowloris_heads_bodies_and_idle_connections_are_closed():
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway([up.row], header_timeout_s=1.0, body_timeout_s=1.0, idle_timeout_s=1.0)
        try:
            t = time.monotonic()
            partial = asyncio.ensure_future(exchange(port, b"GET /health HTTP/1.1\r\nX-Slow: a", timeout=10))
            nothing = asyncio.ensure_future(exchange(port, b"", timeout=10))
            body = asyncio.ensure_future(exchange(port, POST + b"Content-Length: 100\r\n\r\n{", timeout=10))
            idle = asyncio.ensure_future(exchange(port, POST + b"Content-Length: 2\r\n\r\n{}", timeout=10))
            got = await asyncio.gather(partial, nothing, body, idle)
            assert got[0].startswith(b"HTTP/1.1 408") and got[1].startswith(b"HTTP/1.1 408")
            assert got[2].startswith(b"HTTP/1.1 408")
            assert got[3].startswith(b"HTTP/1.1 200") and got[3].count(b"HTTP/1.1") == 1   # answered, then closed
            assert time.monotonic() - t < 5
            await asyncio.sleep(0.3)                # the clients' own close reaches the gateway
            assert not gw._clients
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_connections_over_the_cap_get_503_and_the_rest_are_served():
    async def go():
        gw, port = await gateway([], max_connections=5)
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
            await asyncio.sleep(0.1)
            got = await exchange(port, b"GET /health HTTP/1.1\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 503") and b"too many connections" in got
            for _, w in held:
                w.close()
            await asyncio.sleep(0.2)
            got = await exchange(port, b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 200")
        finally:
            await gw.stop()
    run(go())


def test_a_client_that_pipelines_and_never_reads_is_bounded_then_dropped():
    async def go():
        gw, port = await gateway([], send_timeout_s=1.0)
        try:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            req = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
            sent = 0
            t = time.monotonic()
            while time.monotonic() - t < 2:
                try:
                    sent += sock.send(req * 1000)
                except BlockingIOError:
                    await asyncio.sleep(0.01)
                except OSError:
                    break
            conns = list(gw._clients)
            if conns:       # still open: what it holds is bounded: parsed requests, bytes read but not parsed
                c = conns[0]
                assert len(c.queue) <= G.MAX_PIPELINED + G.MAX_HEAD // len(req) + 1
                assert len(c.unparsed) <= 1 << 20 and c.transport.get_write_buffer_size() < 1 << 20
            for _ in range(100):                                 # dropped: it read nothing for send_timeout_s
                if not gw._clients:
                    break
                await asyncio.sleep(0.1)
            assert not gw._clients
            assert sent < 64 << 20          # it could not push requests without end (kernel buffers took the rest)
            sock.close()
        finally:
            await gw.stop()
    run(go())


def test_thousands_of_pipelined_requests_in_one_read_are_all_answered():
    """Reading stops while too many requests wait; what one read held beyond them is parsed later, not lost."""
    async def go():
        gw, port = await gateway([])
        try:
            n = 3000
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"".join(b"GET /v1/models?i=%d HTTP/1.1\r\nHost: gw\r\n\r\n" % i for i in range(n)))
            await writer.drain()
            got, answers = b"", 0
            while answers < n:
                chunk = await asyncio.wait_for(reader.read(1 << 16), 10)
                assert chunk, f"closed after {answers} of {n} answers"
                got += chunk
                answers = got.count(b"HTTP/1.1 200")
            assert answers == n and not got.count(b"HTTP/1.1 4")
            writer.close()
        finally:
            await gw.stop()
    run(go())


def test_two_answers_in_one_upstream_write_never_reach_another_client():
    """A replica that sends two answers to one request: the first goes to its client, the connection is closed
    instead of pooled, and the next request gets its own answer on a fresh connection."""
    async def go():
        up = await Raw(lambda n: ok(b'{"for": %d}' % n) + ok(b'{"stray": %d}' % n)).start()
        gw, port = await gateway([up.row])
        try:
            a = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            b = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            assert a.endswith(b'{"for": 1}') and b.endswith(b'{"for": 2}')
            assert b"stray" not in a + b and up.connections == 2
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_interim_1xx_answers_are_skipped():
    async def go():
        up = await Raw(lambda n: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                       + ok(b'{"real": true}')).start()
        gw, port = await gateway([up.row])
        try:
            for _ in range(2):            # and the connection stays usable
                got = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
                assert got.startswith(b"HTTP/1.1 200") and got.endswith(b'{"real": true}') and b"103" not in got
            assert up.connections == 1
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_a_hung_replica_is_given_up_on():
    async def go():
        up = await Raw(lambda n: None).start()
        gw, port = await gateway([up.row], upstream_idle_s=1.0)
        try:
            t = time.monotonic()
            got = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}", timeout=10)
            assert got.startswith(b"HTTP/1.1 504") and b"no answer for 1s" in got
            assert time.monotonic() - t < 4
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_unknown_model_names_do_not_grow_the_metric_labels():
    async def go():
        a = Raw(lambda n: ok(b"{}"))
        await a.start()
        rows = [a.row, {**a.row, "name": "w1", "model": "other"}]
        gw, port = await gateway(rows)
        try:
            for i in range(60):
                body = json.dumps({"model": f"made-up-{i}" + "x" * 1000}).encode()
                got = await exchange(port, POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                assert got.startswith(b"HTTP/1.1 404")
            assert set(gw.counts) == {("-", "404")} and gw.counts[("-", "404")] == 60
        finally:
            await gw.stop()
            await a.stop()
    run(go())


@pytest.mark.parametrize("smuggle", [
    POST + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    POST + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    POST + b"Content-Length: 2\r\n folded\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\nHost: gw\nContent-Length: 2\n\n{}",
    POST + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n",
])
def test_smuggling_is_400_and_close(smuggle):
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway([up.row])
        try:
            got = await exchange(port, smuggle)
            assert got.startswith(b"HTTP/1.1 400"), got[:100]
            assert up.n == 0
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_the_connection_cap_follows_the_file_descriptor_limit(tmp_path):
    """A gateway process allowed 200 descriptors takes (200 - 128) // 2 = 36 clients and answers the rest 503
    at once, instead of running out of descriptors and calling a healthy replica unreachable."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    port = free_port()

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cluster.gateway", "--port", str(port), "--replica",
                          f"w0=http://127.0.0.1:{free_port()}"], env={**os.environ, "PYTHONPATH": str(repo)},
                         stdout=subprocess.PIPE, text=True, preexec_fn=low_limit)
    try:
        assert "listening" in p.stdout.readline()
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        time.sleep(1.0)
        refused = 0
        for c in conns:
            c.setblocking(False)
            try:
                if c.recv(4096).startswith(b"HTTP/1.1 503"):
                    refused += 1
            except OSError:         # nothing to read: an accepted connection waiting for its request
                pass
        assert refused == 4
        for c in conns:
            c.close()
    finally:
        p.terminate()
        p.wait(10)
