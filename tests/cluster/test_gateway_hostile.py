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


def test_at_the_connection_cap_the_longest_idle_goes_and_when_all_are_answered_503():
    async def go():
        up = await Raw(lambda n: None).start()               # answers nothing: its requests stay in flight
        gw, port = await gateway([up.row], max_connections=5)
        try:
            idle = await asyncio.open_connection("127.0.0.1", port)
            busy = []
            for _ in range(4):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(POST + b"Content-Length: 2\r\n\r\n{}")
                busy.append((r, w))
            await asyncio.sleep(0.2)
            got = await exchange(port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 200")               # served: the idle connection made room
            assert await asyncio.wait_for(idle[0].read(), 2) == b""
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(POST + b"Content-Length: 2\r\n\r\n{}")
            busy.append((r, w))
            await asyncio.sleep(0.2)
            got = await exchange(port, b"GET /health HTTP/1.1\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 503") and b"too many connections" in got
            for _, w in busy:
                w.close()
            await asyncio.sleep(0.2)
            got = await exchange(port, b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 200")
        finally:
            await gw.stop()
            await up.stop()
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
    """A streamed request waits ``upstream_idle_s`` for the answer's head; a non-streamed one, whose answer
    llama-server sends only when the generation ends, the longer ``upstream_answer_s``."""
    async def go():
        up = await Raw(lambda n: None).start()
        gw, port = await gateway([up.row], upstream_idle_s=1.0, upstream_answer_s=2.0)
        try:
            t = time.monotonic()
            body = b'{"stream": true}'
            got = await exchange(port, POST + b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body),
                                 timeout=10)
            assert got.startswith(b"HTTP/1.1 504") and b"no answer for 1s" in got
            assert time.monotonic() - t < 1.8
            got = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}", timeout=10)
            assert got.startswith(b"HTTP/1.1 504") and b"no answer for 2s" in got
            assert time.monotonic() - t < 5
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
    """A gateway process allowed 200 descriptors keeps (200 - 128) // 2 = 36 clients (the longest idle closed for
    a new one), instead of running out of descriptors and calling a healthy replica unreachable."""
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
        closed = 0
        for c in conns:
            c.setblocking(False)
            try:
                if c.recv(4096) == b"":
                    closed += 1
            except BlockingIOError:     # nothing to read: an accepted connection waiting for its request
                pass
            except ConnectionResetError:
                closed += 1
        assert closed == 4          # the longest idle made room for the newest
        for c in conns:
            c.close()
    finally:
        p.terminate()
        p.wait(10)


# --- where the gateway did worse than a maintained server ----------------------------------------------------------
class Bystander:
    """Another client asking ``GET /health`` on fresh connections in a loop, from a thread of its own: the longest
    wait it saw is how long the gateway's event loop was blocked for everyone."""

    def __init__(self, port: int, source: str | None = None) -> None:
        import threading

        self.port, self.worst, self.answers, self.errors = port, 0.0, 0, []
        self.source = (source, 0) if source else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=self.source) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
                    got = b""
                    while chunk := s.recv(4096):
                        got += chunk
                if not got.startswith(b"HTTP/1.1 200"):
                    self.errors.append(got[:80])
                self.answers += 1
            except OSError as e:
                self.errors.append(repr(e))
            self.worst = max(self.worst, time.monotonic() - t)
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)
        self._check()

    async def __aenter__(self):                # with the gateway on this event loop: never block it
        return self.__enter__()

    async def __aexit__(self, *exc):
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 15)
        self._check()

    def _check(self) -> None:
        assert self.answers and not self.errors, self.errors[:3]
        assert self.worst < 1.0, f"another client waited {self.worst:.2f}s"


def two_models(up) -> list[dict]:
    return [up.row, {**up.row, "name": "w1", "model": "other"}]


def test_a_json_body_nested_too_deep_is_400_not_silence():
    """json.loads raises RecursionError on ~100k nested brackets: the client got no answer until the idle
    timeout. Now it is a 400 at once, and the gateway serves on."""
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway(two_models(up))
        try:
            body = b'{"model": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
            t = time.monotonic()
            async with Bystander(port):
                got = await exchange(port, POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
                                     + body, timeout=10)
            assert got.startswith(b"HTTP/1.1 400") and b"not a JSON object" in got
            assert time.monotonic() - t < 3 and up.n == 0
            got = await exchange(port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 200")
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_any_exception_in_a_handler_is_a_500_and_the_gateway_serves_on(monkeypatch):
    """Whatever a handler raises (a bug), its client gets one 500 and the connection is closed."""
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway([up.row])
        try:
            def broken(req):
                raise KeyError("a bug")
            monkeypatch.setattr(gw, "_model_for", broken)
            got = await exchange(port, POST + b"Content-Length: 2\r\n\r\n{}")
            assert got.startswith(b"HTTP/1.1 500") and b"internal error (KeyError)" in got
            assert b"Connection: close" in got
            monkeypatch.undo()
            got = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            assert got.startswith(b"HTTP/1.1 200")
            assert gw.counts[("-", "500")] == 1
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def answers(data: bytes) -> list[tuple[bytes, bytes]]:
    """(head, body) of each answer in ``data``, reading bodies by Content-Length as a client does; HEAD answers
    must be marked by the caller (it cannot be told from the bytes)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, data[:200]
        length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
        out.append((head, rest[:length]))
        data = rest[length:]
    return out


def test_head_gets_the_head_only_and_the_next_answer_stays_in_step():
    """HEAD got a body, which a client reads as the start of the next answer."""
    async def go():
        gw, port = await gateway([{"name": "w0", "url": "http://127.0.0.1:1", "model": "m", "healthy": True}])
        try:
            got = await exchange(port, b"HEAD /health HTTP/1.1\r\nHost: gw\r\n\r\n"
                                       b"HEAD /v1/completions HTTP/1.1\r\nHost: gw\r\n\r\n"
                                       b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
            h1, sep, rest = got.partition(b"\r\n\r\n")
            assert h1.startswith(b"HTTP/1.1 200") and b"Content-Length: " in h1
            h2, sep, rest = rest.partition(b"\r\n\r\n")      # straight after the head: no body in between
            assert h2.startswith(b"HTTP/1.1 405"), h2
            (h3, body3), = answers(rest)
            assert h3.startswith(b"HTTP/1.1 200") and json.loads(body3)["status"] == "ok"
        finally:
            await gw.stop()
    run(go())


@pytest.mark.parametrize("broken,why", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"malformed answer"),
    (b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * (1 << 20), b"head is over 64 KiB"),
])
def test_a_malformed_answer_is_one_502_and_the_replica_stays_in_rotation(broken, why):
    """A replica that answers with a broken head marked itself unreachable: every client got 503 for the next
    seconds. Now that request gets a 502 and the next one is served."""
    async def go():
        up = await Raw(lambda n: broken if n == 1 else ok(b'{"n": %d}' % n)).start()
        gw, port = await gateway([up.row])
        try:
            async with Bystander(port):
                t = time.monotonic()
                got = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
                assert got.startswith(b"HTTP/1.1 502") and why in got, got[:300]
                assert time.monotonic() - t < 2
                got = await exchange(port, POST + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
                assert got.startswith(b"HTTP/1.1 200") and got.endswith(b'{"n": 2}')
                assert gw.router.healthy_count() == 1
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_an_unknown_model_name_is_not_echoed_whole():
    """A 10 MiB model name came back in a 17 MiB 404 (held for clients that do not read)."""
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway(two_models(up))
        try:
            body = json.dumps({"model": "x" * (10 << 20)}).encode()
            async with Bystander(port):
                got = await exchange(port, POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
                                     + body, timeout=20)
            assert got.startswith(b"HTTP/1.1 404") and len(got) < 1024, len(got)
            message = json.loads(got.partition(b"\r\n\r\n")[2])["error"]["message"]
            assert message.startswith("model 'xxxx") and "…" in message and "available: m, other" in message
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_a_body_that_trickles_expires_and_one_address_cannot_keep_every_connection_waiting():
    """A body sent a byte at a time never expired (the deadline moved with each byte), and nothing limited the
    connections of one address, so a few thousand such clients held the connection cap. Now a body has an
    allowance for the whole (body timeout plus its size at MIN_BODY_RATE), and an address's connections that
    are not being answered are capped: a new one closes the one of that address waiting longest."""
    async def go():
        up = await Raw(lambda n: ok(b"{}")).start()
        gw, port = await gateway([up.row], body_timeout_s=2.0, max_connections=8, max_waiting_per_address=3)
        try:
            async def trickle():
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(POST + b"Content-Length: 100\r\n\r\n")
                t = time.monotonic()
                while time.monotonic() - t < 6:
                    try:
                        writer.write(b"{")
                        await writer.drain()
                    except ConnectionError:
                        break
                    try:
                        got = await asyncio.wait_for(reader.read(4096), 0.25)
                    except asyncio.TimeoutError:
                        continue
                    writer.close()
                    return got, time.monotonic() - t
                writer.close()
                return b"", time.monotonic() - t

            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            trickling = asyncio.ensure_future(trickle())
            async with Bystander(port, source="127.0.0.2"):      # another address: served throughout
                await asyncio.sleep(G.WAITING_AFTER_S + 0.2)       # all three count as waiting now
                # a fourth waiting connection from 127.0.0.1 is served: the longest idle one of it is closed
                got = await exchange(port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
                assert got.startswith(b"HTTP/1.1 200")
                assert await asyncio.wait_for(held[0][0].read(), 2) == b""
                r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
                w.write(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
                assert (await asyncio.wait_for(r.read(4096), 5)).startswith(b"HTTP/1.1 200")
                w.close()
                got, took = await trickling
            assert got.startswith(b"HTTP/1.1 408") and b"body not received" in got, got
            assert took < 4, took
            for _, w in held:
                w.close()
            await asyncio.sleep(0.2)
            assert gw._by_address == {} or set(gw._by_address) == {"127.0.0.1"}
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_eight_32_mib_bodies_at_once_do_not_stall_other_clients(tmp_path):
    """Each 32 MiB body was copied about four times on the event loop (tens of ms each): eight at once stalled
    every other client for seconds. The gateway runs as its own process here, so its loop is measured alone."""
    import os
    import subprocess
    import sys
    import threading
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]

    async def serve_upstream(up: Raw, ready: threading.Event, stop: threading.Event):
        await up.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await up.stop()

    up = Raw(lambda n: ok(b'{"ok": true}'))
    ready, stop = threading.Event(), threading.Event()
    upstream = threading.Thread(target=lambda: asyncio.run(serve_upstream(up, ready, stop)), daemon=True)
    upstream.start()
    assert ready.wait(10)
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cluster.gateway", "--port", str(port), "--replica",
                          f"w0=http://127.0.0.1:{up.port}"], env={**os.environ, "PYTHONPATH": str(repo)},
                         stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in p.stdout.readline()
        size = G.MAX_BODY - 1024
        body = b'{"prompt": "' + b"x" * (size - 14) + b'"}'
        results: list[bytes] = []

        def big():
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
                results.append(got)

        with Bystander(port) as who:
            time.sleep(0.3)
            senders = [threading.Thread(target=big) for _ in range(8)]
            [t.start() for t in senders]
            [t.join(120) for t in senders]
        assert len(results) == 8 and all(r.startswith(b"HTTP/1.1 200") for r in results)
        assert up.n == 8
        print(f"worst wait of another client during eight 32 MiB bodies: {who.worst * 1000:.0f} ms")
    finally:
        p.terminate()
        p.wait(10)
        stop.set()
        upstream.join(10)


def test_pipelined_good_bad_good_answers_the_first_then_400():
    """A malformed request after a valid one in the same write: the valid one went unanswered."""
    async def go():
        gw, port = await gateway([])
        try:
            got = await exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
                                       b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nContent-Length: x\r\n\r\n"
                                       b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
            (h1, b1), (h2, b2) = answers(got)
            assert h1.startswith(b"HTTP/1.1 200") and json.loads(b1)["object"] == "list"
            assert h2.startswith(b"HTTP/1.1 400") and b"Connection: close" in h2 and b"malformed" in b2
        finally:
            await gw.stop()
    run(go())


def test_absolute_form_targets_are_served_and_h2c_upgrades_ignored():
    """``POST http://host/v1/...`` (RFC 9112 3.2.2: a server must accept it) was 404, and ``Upgrade: h2c`` on a
    plain request (curl --http2 sends it) 400. Both are served as HTTP/1.1; the replica sees an origin-form
    target and the body."""
    seen: list[bytes] = []

    class Recording(Raw):
        async def _conn(self, reader, writer):
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                                   if ln.lower().startswith(b"content-length:")), 0)
                    seen.append(head.split(b"\r\n", 1)[0] + b" " + await reader.readexactly(length))
                    writer.write(ok(b'{"ok": true}'))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

    async def go():
        up = await Recording(None).start()
        gw, port = await gateway([up.row])
        try:
            got = await exchange(port, b"POST http://gw:8080/v1/completions?x=1 HTTP/1.1\r\nHost: gw\r\n"
                                       b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
            body = b'{"prompt": "h2c"}'
            got = await exchange(port, POST + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                 b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: %d\r\n\r\n" % len(body)
                                 + body + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
            (h1, b1), (h2, _) = answers(got)
            assert h1.startswith(b"HTTP/1.1 200") and b"Upgrade" not in h1 and b1 == b'{"ok": true}'
            assert h2.startswith(b"HTTP/1.1 200")
            assert seen == [b"POST /v1/completions?x=1 HTTP/1.1 {}", b"POST /v1/completions HTTP/1.1 " + body]
        finally:
            await gw.stop()
            await up.stop()
    run(go())


def test_http10_keep_alive_is_said_and_kept():
    """An HTTP/1.0 client asking for keep-alive was kept open without being told, so it waited for a close."""
    async def go():
        gw, port = await gateway([])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):
                writer.write(b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200") and b"Connection: keep-alive" in head
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
            writer.close()
            got = await exchange(port, b"GET /v1/models HTTP/1.0\r\n\r\n")      # no keep-alive: said and closed
            assert got.startswith(b"HTTP/1.1 200") and b"Connection: close" in got
        finally:
            await gw.stop()
    run(go())
