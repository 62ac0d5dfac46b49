"""The OpenAI-compatible gateway: one endpoint in front of every replica.

Every route of llama-server's API that serves a request (chat, completions, responses, Anthropic messages,
embeddings, rerank, infill, tokenize, ...: :data:`POST_ROUTES`, :data:`GET_ROUTES`) is proxied to the healthy
replica of the request's model with the fewest requests in flight; streamed answers (SSE) are passed through event
by event as they arrive. ``/v1/models`` and ``/v1/models/{id}`` answer from the deployment's aliases; ``/health``
is 200 while a replica is healthy. With no healthy replica the answer is 503 with an OpenAI-style JSON error that
says why. A request's fault (a timeout, a malformed answer, a refused connect) is that request's alone: only the
health checks take a replica out, and no request's failure closes connections that carry other requests.

Built on asyncio protocols with httptools (llhttp, the parser behind uvicorn) on both sides: a streamed answer is
written to the client from the upstream connection's callback, without a task switch per token (behind an ASGI
server the same relay costs about 0.13 ms more per event at 16 streams and about 2 ms more on the first token of
16 simultaneous streams, at about twice the CPU per event). What a client may send is bounded the way well-kept
servers bound it (head 64 KiB, 100 headers, URL 8 KiB, body 32 MiB, head/body/idle/unread-answer deadlines,
connection caps that hold with every client behind one address; the API key checked on the head, before any body
or ``100 Continue``), and what a replica sends is checked (one answer per request, 1xx skipped, silence timed out,
a cut stream visibly cut, a malformed answer one 502): see the constants below and ``docs/cluster.md``. Each
answer's latency (time to first token, duration, tokens/s per stream) goes to histograms and to a window of the
last minutes that ``status`` reads. The :class:`Router` is pure and unit-tested; :class:`Gateway` is the HTTP
server; :class:`GatewayActor` runs it inside a Ray actor (the controller creates it on the node where ``up`` runs,
so ``down`` stops it with the rest); ``python -m orchestrator.cluster.gateway`` runs it standalone with a fixed
replica list (benchmarks, debugging).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import hmac
import itertools
import json
import re
import socket
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit

import httptools

from orchestrator.cluster.latency import RATE_BUCKETS, SECONDS_BUCKETS, RecentWindow, quantile

# llama-server's routes (tools/server/server.cpp of the pinned build) passed on to a replica of the request's model
POST_ROUTES = frozenset({
    "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion",
    "/v1/responses", "/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/chat/completions/input_tokens", "/chat/completions/input_tokens", "/v1/responses/input_tokens",
    "/responses/input_tokens", "/v1/embeddings", "/embeddings", "/embedding", "/v1/rerank", "/v1/reranking",
    "/rerank", "/reranking", "/infill", "/tokenize", "/detokenize", "/apply-template", "/v1/audio/transcriptions",
    "/audio/transcriptions"})
GET_ROUTES = frozenset({"/props"})
MODEL_ROUTES = ("/v1/models", "/models")      # answered by the gateway: the deployment's aliases
OPEN_ROUTES = ("/health", "/v1/health")       # answered by the gateway, without the key (probes)
# one worker's own state or settings, which an address in front of several workers cannot stand for
PER_WORKER = frozenset({"/metrics", "/slots", "/lora-adapters", "/v1/chat/completions/control", "/v1/stream",
                        "/v1/streams/lookup", "/router-trace", "/tools", "/cors-proxy", "/models/load",
                        "/models/unload", "/models/sse"})
# headers that describe one hop, not the message (RFC 9110 7.6.1), and the ones the gateway sets itself
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
                  "trailer", "transfer-encoding", "upgrade", "content-length", "http2-settings"})
# not passed to a replica: the client's key (the replica gets the deployment's own), what the gateway decides
# (compression would hide the SSE events it relays; CORS is its policy, not the replica's), the target's host
_NOT_UPSTREAM = _HOP | {"host", "expect", "authorization", "x-api-key", "accept-encoding", "origin",
                        "access-control-request-method", "access-control-request-headers"}
# not passed back: content-type is set from the answer's own, CORS is the gateway's, server names the replica
_NOT_BACK = _HOP | {"content-type", "server", "access-control-allow-origin", "access-control-allow-credentials",
                    "access-control-allow-methods", "access-control-allow-headers", "access-control-expose-headers",
                    "access-control-max-age", "vary"}
CORS_MAX_AGE_S = 600
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
# llama-server (cpp-httplib) closes a kept-alive connection after 5 s idle; the pool lets go of idle connections
# sooner, so a request is not sent down a connection the server has just closed
UPSTREAM_KEEPALIVE_S = 4.0
STALE_RETRIES = 2   # requests retried on a fresh connection after the server closed a pooled one
# Limits on what a client may send (what well-kept servers set: h11, uvicorn, aiohttp); each answer is one line.
MAX_BODY = 32 * 2**20        # a request body (a 1M-token prompt is about 4 MiB of JSON)
MAX_HEAD = 64 * 2**10        # request line and headers together
MAX_HEADERS = 100
MAX_URL = 8 * 2**10
# Connections per gateway process: at least MIN_CONNECTIONS, and CONNECTIONS_PER_SLOT for each slot of the
# deployment (requests beyond the slots wait in llama-server's queue: clients of a busy deployment, not attackers),
# within what the file descriptors allow. At the cap the connection idle longest between requests is closed for the
# new one; when every connection is being answered the new one gets 503.
MIN_CONNECTIONS = 2048
CONNECTIONS_PER_SLOT = 64
DEFAULT_SLOTS = 4            # a replica whose row does not give its slots counts as this many
# Connections of one address that have waited WAITING_AFTER_S or longer without being answered (sending a head or
# a body slowly, idle between requests): at most this many; a new one closes the one of that address waiting
# longest. Connections being answered (a stream, a long generation) are not limited per address, since every local
# client, and every client behind a reverse proxy, has the same address; nor are those that just connected (a
# burst of clients connects before any has sent its request).
MAX_WAITING_PER_ADDRESS = 256
WAITING_AFTER_S = 1.0
MAX_PIPELINED = 16           # parsed requests waiting on one connection before it is read no further
HEADER_TIMEOUT_S = 10.0      # from the first byte of a request (or the connection) to the end of its headers
BODY_TIMEOUT_S = 30.0        # longest pause while a request body arrives, and the allowance for the whole body
MIN_BODY_RATE = 64 * 2**10   # bytes/s a body must average beyond that allowance (a byte every few seconds expires)
IDLE_TIMEOUT_S = 30.0        # a kept-alive connection with no request
SEND_TIMEOUT_S = 60.0        # a client that reads nothing of its answer for this long is dropped
UPSTREAM_IDLE_S = 600.0      # a streamed answer: longest wait for its head, and for each piece after it
UPSTREAM_ANSWER_S = 3600.0   # a non-streamed answer: longest wait for it (llama-server sends none of it until the
                             # generation ends, so a long generation is silence, not a fault of the replica)
LINGER_S = 2.0               # after a close, what the client still sends is read and dropped this long
MAX_UPSTREAM_HEAD = 64 * 2**10   # the head of a replica's answer (llama-server's are a few hundred bytes)
SMALL_BODY = 256 * 2**10     # a body up to this size goes upstream in one write with its head (copying it is cheap)
MAX_HELD_EVENT = 1 * 2**20   # a streamed answer's unfinished SSE event kept back (one event is a token's JSON)
MAX_SHOWN_NAME = 64          # characters of a client's unknown model name repeated in the error
_REASONS = {s.value: s.phrase for s in HTTPStatus}


@dataclass
class Replica:
    name: str
    url: str
    model: str
    healthy: bool
    detail: str = ""
    inflight: int = 0
    pid: int | None = None
    epoch: int = 0          # bumped when the process behind the URL changed or died: its pooled connections go


class Router:
    """Which replica serves the next request. Pure."""

    def __init__(self) -> None:
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
        """Only the health checks (the routing table) take a replica out: a request that failed on one (timed
        out, a malformed answer, a refused connect) excludes it for that request alone."""
        cands = [r for r in self.replicas.values() if r.model == model and r.healthy and r.name not in exclude]
        if not cands:
            return None
        low = min(r.inflight for r in cands)
        best = [r for r in cands if r.inflight == low]
        return best[next(self._rr) % len(best)]

    def healthy_count(self, model: str | None = None) -> int:
        return sum(1 for r in self.replicas.values() if r.healthy and (model is None or r.model == model))

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


class _Disconnected(Exception):
    """The upstream connection closed before the head of an answer arrived."""


class _Request:
    """A parsed request. ``body`` is the list of pieces as they arrived: a 32 MiB body is passed to the replica
    piece by piece, never joined (each copy of it blocked the event loop for tens of milliseconds)."""

    __slots__ = ("method", "url", "path", "headers", "body", "size", "keep_alive", "reject", "http10", "received")

    def __init__(self, method: str, url: bytes, headers: dict[str, str], body: list[bytes], keep_alive: bool,
                 reject: tuple[int, bytes] | None, http10: bool = False, received: float = 0.0) -> None:
        self.method, self.url, self.headers, self.body = method, url, headers, body
        self.size = sum(len(b) for b in body)
        self.path = url.split(b"?", 1)[0].decode("latin-1")
        self.keep_alive, self.reject, self.http10, self.received = keep_alive, reject, http10, received

    def body_bytes(self) -> bytes:
        return self.body[0] if len(self.body) == 1 else b"".join(self.body)


def origin_form(target: bytes) -> bytes | None:
    """The path and query of a request target: itself in origin form (``/v1/...``); from the absolute form
    (``http://host/v1/...``, which RFC 9112 3.2.2 says a server must accept); None when it is neither."""
    if target.startswith(b"/"):
        return target
    if target[:8].lower().startswith((b"http://", b"https://")):
        try:
            u = httptools.parse_url(target)
        except httptools.HttpParserInvalidURLError:
            return None
        return (u.path or b"/") + (b"?" + u.query if u.query else b"")
    return None


def shown_name(name: Any) -> str:
    """A client's model name as an error repeats it: cut short (a 10 MiB name must not come back whole)."""
    if not isinstance(name, str):
        return "a JSON " + ("null" if name is None else type(name).__name__)
    return repr(name if len(name) <= MAX_SHOWN_NAME else name[:MAX_SHOWN_NAME] + "…")


def asks_to_stream(body: list[bytes]) -> bool:
    """Whether a JSON body says ``"stream": true``, without parsing it (a 32 MiB body is not parsed for one key). A
    key of that name nested deeper also counts: it only gives the answer the streamed bound on silence."""
    return any(_STREAM_TRUE.search(piece) for piece in body)


def origin_is_localhost(origin: str) -> bool:
    host = urlsplit(origin).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.endswith(".localhost")


def _unauthorized() -> tuple[int, bytes]:
    return 401, error_body("invalid or missing API key", "invalid_request_error", "invalid_api_key")


def _connection_room() -> int:
    """How many client connections this process's file descriptors allow: each may hold one to a replica too,
    and the pools, the event loop and Ray keep some (a client over the cap gets 503, not a replica marked
    unreachable because connecting to it failed for want of descriptors)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, (soft - 128) // 2)


def _response(status: int, body: bytes, ctype: str, connection: str | None, head_only: bool = False,
              extra: str = "") -> bytes:
    """A whole answer; ``connection``: the Connection header's value, if one is needed; ``head_only``: the answer
    to HEAD, whose head says how long the body would be and which has none (RFC 9110 9.3.2); ``extra``: more
    header lines, each ending in CRLF."""
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n" + (f"Connection: {connection}\r\n" if connection else "") + extra
            + "\r\n")
    return head.encode("latin-1") + (b"" if head_only else body)


def _nodelay(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass


class _ClientConn(asyncio.Protocol):
    """One client connection: requests are parsed (httptools) and served in order, one at a time.

    Limits: the request line and headers are fed to the parser at most :data:`MAX_HEAD` bytes at a time, so a
    head that does not end within that many bytes is refused (431) before the parser buffers more; at most
    :data:`MAX_HEADERS` headers and a URL of :data:`MAX_URL` bytes. The API key and the body size are checked as
    soon as the headers are complete: a request that will be refused gets its answer then, without its body
    being read and without ``100 Continue``. Deadlines (head, body, keep-alive idle, a client that stops reading)
    are enforced by the gateway's housekeeping. A request the parser refuses is answered 400 after the answers
    to the requests before it on the connection, in order."""

    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw
        self.transport = None
        self.address: str | None = None            # in gw._by_address while open
        self.waiting_since = 0.0                   # when it last began to wait for a request (loop time)
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[_Request] = collections.deque()
        self.task: asyncio.Task | None = None
        self.exchange: _Exchange | None = None     # the upstream answer being relayed to this connection
        self.current: _Request | None = None       # the request being answered (its method and version shape it)
        self.answered = False                      # something of the current answer was written
        self.stream_open = False                   # a streamed answer was started and not ended
        self.closed = False
        self.reading_paused = False
        self.unparsed: list[bytes] = []            # read but not yet parsed: the client pipelines faster than served
        self.in_head = True                        # between requests or inside a request's head
        self.head_bytes = 0
        self.deadline: float | None = None         # enforced by Gateway._housekeeping
        self.why_deadline = ""
        self.writable = asyncio.Event()
        self.writable.set()
        self.write_stalled_since: float | None = None
        self.discard = False                       # refused: the rest of what the client sends is not read
        self.linger_until: float | None = None
        self._replay: bytes | None = None          # an Upgrade request's head, to parse again without the Upgrade
        self.cors = ""                             # CORS header lines for the answer being written
        self.continue_owed = False                 # the request being read asked for 100 Continue while answers
                                                   # to earlier ones were still going out: sent after them
        self._reset()

    def _reset(self) -> None:
        self._url = bytearray()
        self._target = b"/"
        self._headers: dict[str, list[str]] = {}
        self._nheaders = 0
        self._body: list[bytes] = []
        self._size = 0
        self._body_started = 0.0
        self._reject: tuple[int, bytes] | None = None
        self._head_done: dict[str, str] = {}

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _set_deadline(self, seconds: float | None, why: str = "") -> None:
        self.deadline = None if seconds is None else self._now() + seconds
        self.why_deadline = why

    # --- asyncio ---------------------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        _nodelay(transport)
        self.waiting_since = self._now()
        if len(self.gw._clients) >= self.gw.max_connections and not self.gw._close_longest_idle():
            self.closed = True
            transport.write(_response(503, error_body("too many connections", "service_unavailable", 503),
                                      "application/json", "close"))
            transport.close()
            return
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) and peer else None
        peers = self.gw._by_address.setdefault(address, set())
        if address is not None and len(peers) >= self.gw.max_waiting_per_address:
            since = self.waiting_since - WAITING_AFTER_S
            waiting = [c for c in peers if c.waiting and c.waiting_since <= since]
            if len(waiting) >= self.gw.max_waiting_per_address:
                min(waiting, key=lambda c: c.waiting_since).evict(f"too many unanswered connections from "
                                                                  f"{address}")
        self.address = address
        peers.add(self)
        self.gw._clients.add(self)
        self._set_deadline(self.gw.header_timeout_s, "header")

    @property
    def waiting(self) -> bool:
        """Open and not being answered: new, sending a request, or idle between requests."""
        return self.task is None and not self.closed

    def evict(self, why: str) -> None:
        """Closes a waiting connection to make room: a request half sent gets 503 saying why; an idle one is
        just closed (at once: its descriptor is wanted), as a kept-alive connection may be at any time."""
        if self.in_head and self.head_bytes == 0:
            self.closed = True
            self.transport.abort()
        else:
            self.respond(503, error_body(why, "service_unavailable", 503), close=True)

    def data_received(self, data: bytes) -> None:
        if self.closed or self.discard:
            return
        view = memoryview(data)        # slices of it are not copies
        while view:
            if self.reading_paused:
                # too many requests wait already: one read can hold thousands of small pipelined ones, so
                # the rest of it is kept as bytes and parsed once the queue has room again
                self.unparsed.append(bytes(view))
                return
            if self.in_head:
                # feed at most what is left of the head's allowance: the parser never holds more than that
                room = MAX_HEAD - self.head_bytes
                if room <= 0:
                    return self._refuse_now(431, f"request line and headers over {MAX_HEAD >> 10} KiB")
                piece, view = view[:room], view[room:]
                self.head_bytes += len(piece)
            else:
                piece, view = view[:MAX_HEAD], view[MAX_HEAD:]
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade as e:
                if self.discard or self.closed:
                    return
                if self._replay is None:           # CONNECT, refused on its head: nothing to parse again
                    return self._refuse_now(400, "protocol upgrades are not supported")
                # RFC 9110 7.8: a server may ignore Upgrade (curl --http2 sends `Upgrade: h2c` on plain requests).
                # llhttp stops parsing at such a head, so the request is parsed again by a new parser, from the
                # same head without the Upgrade, followed by what came after it
                replay, self._replay = self._replay, None
                self.parser = httptools.HttpRequestParser(self)
                self.in_head, self.head_bytes = True, 0
                view = memoryview(replay + bytes(piece[e.args[0]:]) + bytes(view))
                continue
            except httptools.HttpParserError:
                return self._refuse_now(400, "malformed HTTP request")
            if self.closed or self.discard:
                return

    def _refuse_now(self, status: int, why: str) -> None:
        self._refuse(status, error_body(why, "invalid_request_error", status))

    def _refuse(self, status: int, body: bytes) -> None:
        """Answer ``status`` and close: at once when nothing is being answered, else right after the answers to
        the requests before it (answers go out in order); nothing more is read from this connection either way."""
        self.discard = True
        if self.task is None and not self.queue:
            self.respond(status, body, close=True)
        else:
            self.transport.pause_reading()
            self.reading_paused = True
            self.queue.append(_Request("GET", b"/", {}, [], False, (status, body)))

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self in self.gw._clients:
            self.gw._clients.discard(self)
            peers = self.gw._by_address.get(self.address)
            if peers is not None:
                peers.discard(self)
                if not peers:
                    del self.gw._by_address[self.address]
        self.writable.set()
        if self.exchange is not None:
            self.exchange.abort()          # the answer has nobody to go to: drop the upstream connection
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:       # the client reads slower than the replica writes
        self.writable.clear()
        self.write_stalled_since = self._now()
        if self.exchange is not None:
            self.exchange.pause()

    def resume_writing(self) -> None:
        self.writable.set()
        self.write_stalled_since = None
        if self.exchange is not None:
            self.exchange.resume()

    # --- httptools callbacks ---------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset()
        self.continue_owed = False
        self._set_deadline(self.gw.header_timeout_s, "header")

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL and self._reject is None:
            self._reject = (414, error_body(f"URL over {MAX_URL >> 10} KiB", "invalid_request_error", 414))
            self._url = bytearray(b"/")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._nheaders += 1
        if self._nheaders > MAX_HEADERS:
            if self._reject is None:
                self._reject = (431, error_body(f"more than {MAX_HEADERS} headers", "invalid_request_error", 431))
            return
        # repeated headers are kept as a list and joined once (joining as they come copied a growing string)
        self._headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_bytes = 0
        headers = self._head_done = {k: ", ".join(v) for k, v in self._headers.items()}
        self._headers = {}
        if self._reject is None:
            target = origin_form(bytes(self._url))
            if self.parser.get_method() == b"CONNECT":
                self._reject = (405, error_body("CONNECT is not supported", "invalid_request_error", 405))
            elif target is None:
                self._reject = (400, error_body("the request target is neither a path nor an absolute URL",
                                                "invalid_request_error", 400))
            else:
                self._target = target
        if self._reject is None:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                length = 0
            path = self._target.split(b"?", 1)[0].decode("latin-1")
            if (self.gw.api_key and path not in OPEN_ROUTES and self.parser.get_method() != b"OPTIONS"
                    and not self.gw._authorized(headers)):
                self._reject = _unauthorized()
                self.gw._count("-", 401)
            elif length > MAX_BODY:
                self._reject = (413, error_body(f"request body over {MAX_BODY >> 20} MiB", "invalid_request_error",
                                                413))
                self.gw._count("-", 413)
        if self._reject is not None:
            # refused before its body: answered now (or right after the answer in progress) and the connection
            # closed, so the body is never read
            self._refuse(*self._reject)
            return
        self._body_started = self._now()
        self._set_deadline(self.gw.body_timeout_s, "body")
        if headers.get("expect", "").lower() == "100-continue":
            if self.task is None and not self.queue:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:
                # an interim answer goes right before the answer it belongs to: written now it would land in the
                # middle of the answer (a running stream) to a request pipelined before this one
                self.continue_owed = True

    def on_body(self, body: bytes) -> None:
        if self._reject is not None:
            return
        self._size += len(body)
        if self._size > MAX_BODY:          # chunked: no length up front
            self._body = []
            self._reject = (413, b"")
            self.gw._count("-", 413)
            self._refuse_now(413, f"request body over {MAX_BODY >> 20} MiB")
            return
        self._body.append(body)
        # a pause of body_timeout_s ends it, and so does a body slower on the whole than its allowance: the
        # deadline is not pushed back by each byte (a byte every few seconds would hold the connection forever)
        now = self._now()
        allowance = self._body_started + self.gw.body_timeout_s + self._size / self.gw.min_body_rate
        self.deadline, self.why_deadline = min(now + self.gw.body_timeout_s, allowance), "body"

    def on_message_complete(self) -> None:
        self.continue_owed = False                 # the body came without it (the client stopped waiting)
        if self._reject is not None or self.closed:
            return
        if self.parser.should_upgrade():
            # not served as it is: feed_data raises HttpParserUpgrade right after, and data_received parses it
            # again from this head without the Upgrade (CONNECT was refused on its head)
            self._replay = self._head_without_upgrade()
            return
        self.in_head = True
        self.head_bytes = 0
        self._set_deadline(None)
        req = _Request(self.parser.get_method().decode("latin-1"), self._target, self._head_done, self._body,
                       self.parser.should_keep_alive(), None, self.parser.get_http_version() == "1.0",
                       self.gw.clock())
        self._reset()
        self.queue.append(req)
        if len(self.queue) > MAX_PIPELINED and not self.reading_paused:   # pipelining without reading
            self.reading_paused = True
            self.transport.pause_reading()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    def _head_without_upgrade(self) -> bytes:
        """The current request's head again, without ``Upgrade`` (nor ``HTTP2-Settings``, nor ``Expect``: its
        ``100 Continue`` went out already)."""
        lines = [b"%s %s HTTP/%s" % (self.parser.get_method(), bytes(self._url),
                                     self.parser.get_http_version().encode("latin-1"))]
        for name, value in self._head_done.items():
            if name in ("upgrade", "http2-settings", "expect"):
                continue
            if name == "connection":
                tokens = [t.strip() for t in value.split(",")]
                value = ", ".join(t for t in tokens if t and t.lower() not in ("upgrade", "http2-settings"))
                if not value:
                    continue
            lines.append(f"{name}: {value}".encode("latin-1"))
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                # an answer waits until the client has read the previous one (pipelining without reading)
                await self.writable.wait()
                if self.closed:
                    break
                req = self.queue.popleft()
                self.current, self.answered, self.stream_open = req, False, False
                if req.reject is not None:
                    self.respond(*req.reject, close=True)
                    break
                try:
                    keep = await self.gw._handle(self, req)
                except asyncio.CancelledError:
                    raise
                except Exception as e:    # a bug: this client gets an answer, the gateway serves on
                    self.gw._count("-", 500)
                    self._failed(e)
                    break
                finally:
                    self.current, self.cors = None, ""
                if not keep or self.closed:
                    self.close()
                    break
                if self.reading_paused and len(self.queue) <= MAX_PIPELINED:
                    self.reading_paused = False
                    unparsed, self.unparsed = b"".join(self.unparsed), []
                    if unparsed:
                        self.data_received(unparsed)       # may fill the queue and pause again
                    if not self.reading_paused and not self.closed:
                        self.transport.resume_reading()
        except asyncio.CancelledError:
            pass
        finally:
            self.task = None
            self.waiting_since = self._now()
            if self.continue_owed and not self.closed and not self.discard:
                self.continue_owed = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if not self.closed and not self.queue and self.in_head and self.head_bytes == 0:
                self._set_deadline(self.gw.idle_timeout_s, "idle")

    def _failed(self, e: Exception) -> None:
        """What the client of a request whose handler raised gets: a 500 when nothing of the answer went out, a
        visibly cut stream when one had started, and the connection closed either way."""
        if self.stream_open:
            self.abort()
        elif self.answered:
            self.close()
        else:
            why = f"internal error ({type(e).__name__}); the gateway serves on"
            self.respond(500, error_body(why, "server_error", 500), close=True)

    # --- writing ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Closes after what was written has gone out. The client may still be sending (a body that was refused
        unread, pipelined requests): closing a socket with unread data sends a reset that can destroy the answer
        in flight, so the write side is shut first and what arrives is discarded for up to LINGER_S."""
        if not self.closed:
            self.closed = True
            self.discard = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.linger_until = self._now() + LINGER_S
                self.transport.resume_reading()
            else:
                self.transport.close()

    def eof_received(self) -> bool:
        return False                       # the client finished sending: close (a half-open client is not kept)

    def abort(self) -> None:
        """Ends the connection at once (an unfinished chunked answer stays visibly unfinished)."""
        if not self.closed:
            self.closed = True
            self.transport.abort()

    def _connection_header(self, close: bool) -> str | None:
        """``close`` when this answer is the connection's last; ``keep-alive`` to an HTTP/1.0 client that asked
        for it (without it such a client takes the answer as the connection's last and waits for the close)."""
        req = self.current
        if close or (req is not None and not req.keep_alive):
            return "close"
        return "keep-alive" if req is not None and req.http10 else None

    def respond(self, status: int, body: bytes, ctype: str = "application/json", close: bool = False,
                extra: str = "") -> None:
        if self.closed:
            return
        connection = self._connection_header(close)
        self.answered = True
        head_only = self.current is not None and self.current.method == "HEAD"
        self.transport.write(_response(status, body, ctype, connection, head_only, extra + self.cors))
        if connection == "close":
            self.close()

    def start_stream(self, status: int, ctype: str, extra: str = "") -> None:
        """The head of a streamed answer; ``extra``: the replica's own headers to pass on."""
        if self.closed:
            return
        self.answered = self.stream_open = True
        req = self.current
        if req is not None and req.http10:
            framing = "Connection: close\r\n"        # no chunked encoding in HTTP/1.0: the close ends it
        else:
            framing = "Transfer-Encoding: chunked\r\n" + ("Connection: close\r\n" if req is not None and
                                                          not req.keep_alive else "")
        cache = "" if "cache-control:" in extra.lower() else "Cache-Control: no-cache\r\n"
        self.transport.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\nContent-Type: {ctype}\r\n"
                             f"{cache}{extra}{self.cors}{framing}\r\n".encode("latin-1"))

    @property
    def http10(self) -> bool:
        return self.current is not None and self.current.http10

    def write_chunk(self, data: bytes) -> None:
        if data and not self.closed:
            self.transport.write(data if self.http10 else b"%x\r\n%b\r\n" % (len(data), data))

    def end_stream(self) -> bool:
        """Ends a streamed answer; False when the connection cannot carry another request."""
        self.stream_open = False
        if self.closed:
            return False
        if self.http10:
            self.close()
            return False
        self.transport.write(b"0\r\n\r\n")
        return True


class _UpstreamConn(asyncio.Protocol):
    """A connection to a replica, kept in its pool between requests."""

    def __init__(self, pool: "_Pool") -> None:
        self.pool = pool
        self.transport = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:                     # nothing was asked: not a server we understand
            self.closed = True
            self.transport.abort()
            return
        ex.got_bytes = True
        ex.last_rx = asyncio.get_running_loop().time()
        try:
            if not ex.head.done():
                # the head of the answer is bounded like a client's: an endless one fails this request
                room = MAX_UPSTREAM_HEAD - ex.head_bytes
                ex.head_bytes += len(data)
                if len(data) > room:
                    ex.parser.feed_data(data[:room])
                    if not ex.head.done():
                        raise httptools.HttpParserError(f"its head is over {MAX_UPSTREAM_HEAD >> 10} KiB")
                    data = data[room:]
            ex.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if not ex.finished:
                ex.fail(f"malformed answer ({e})")
            self.closed = True
            self.transport.abort()
            return
        if ex.finished:
            # one answer per request: bytes after it (a second answer) mean the connection cannot be trusted
            # with another request, so it is closed, never pooled
            self.exchange = None
            self.pool.gw_release(self, ex.keep and not ex.extra)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool.conns.discard(self)
        if self.exchange is not None:
            self.exchange.lost()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()


class _Pool:
    """The kept-alive connections to one replica's process (one pool per replica and epoch)."""

    def __init__(self, url: str, epoch: int, release=None) -> None:
        self.gw_release = release
        u = urlsplit(url)
        self.host, self.port, self.epoch = u.hostname or "127.0.0.1", u.port or 80, epoch
        self.host_header = f"{u.hostname}:{self.port}".encode("latin-1")
        self.idle: collections.deque[_UpstreamConn] = collections.deque()
        self.conns: set[_UpstreamConn] = set()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.idle.clear()
        for c in list(self.conns):
            c.close()
        self.conns.clear()

    def sweep(self, now: float) -> None:
        """Closes connections idle longer than the replica would keep them."""
        while self.idle and now - self.idle[0].idle_since > UPSTREAM_KEEPALIVE_S:
            self.idle.popleft().close()


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body (llama-server's too), else the body's start."""
    try:
        msg = json.loads(body)["error"]["message"]
        if isinstance(msg, str):
            return msg[:200]
    except (ValueError, KeyError, TypeError):
        pass
    return body[:200].decode("utf-8", "replace") or "no body"


class _Exchange:
    """One request on an upstream connection and its answer: a streamed answer (SSE) is written to the client as
    each piece arrives, from the protocol callback (no task switch per token); any other answer is collected."""

    def __init__(self, gw: "Gateway", client: _ClientConn, up: _UpstreamConn) -> None:
        loop = asyncio.get_running_loop()
        self.gw, self.client, self.up = gw, client, up
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()    # True: complete; False: cut short
        self.got_bytes = False
        self.last_rx = loop.time()
        self.status = 0
        self.ctype = "application/json"
        self.passed = []           # the replica's header lines passed back to the client
        self.sent_at = 0.0         # when the request was written to the replica (loop time)
        self.streaming = False
        self.body: list[bytes] = []
        self.error = ""
        self.paused = False
        self.interim = False       # a 1xx answer is being skipped
        self.finished = False      # the one answer to this request is complete
        self.extra = False         # the replica sent more than that one answer
        self.keep = False
        self.hung = False          # given up on: nothing arrived for upstream_idle_s
        self.head_bytes = 0
        self.first_at: float | None = None     # when the first piece of a streamed body came (loop time)
        self.last_at = 0.0
        self.events = 0            # SSE events relayed ("data: ..."), about one per token
        self.saw_done = False      # the last piece was the "data: [DONE]" that ends an OpenAI stream
        self.held = b""            # the start of an SSE event whose end has not arrived: relayed with its end, and
                                   # dropped if the answer is cut, so an error event never lands inside it

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.finished:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.finished or self.interim:
            return
        key = name.decode("latin-1").lower()
        if key == "content-type":
            self.ctype = value.decode("latin-1")
        elif key not in _NOT_BACK:
            self.passed.append(f"{name.decode('latin-1')}: {value.decode('latin-1')}\r\n")

    def on_headers_complete(self) -> None:
        if self.finished:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:              # a protocol switch nobody asked for
                self.fail("the replica switched protocols")
                self.up.closed = True
                self.up.transport.abort()
                return
            self.interim = True            # 100 Continue, 103 Early Hints: the real answer follows
            self.ctype = "application/json"
            self.passed = []
            return
        self.status = status
        self.streaming = self.ctype.startswith("text/event-stream")
        self.passed.append(self.server_timing())
        if self.streaming:
            self.client.start_stream(self.status, self.ctype, "".join(self.passed))
        if not self.head.done():
            self.head.set_result(None)

    def server_timing(self) -> str:
        """Where the time to this answer's head went (W3C Server-Timing, in ms): ``gateway`` from the end of the
        request to its last byte written to the replica; ``replica`` from then to the answer's head, which
        llama-server sends with a stream's first token (after waiting for a slot and the prompt) and with a whole
        answer at its end."""
        now = self.gw.clock()
        req = self.client.current
        received = req.received if req is not None else self.sent_at
        return (f"Server-Timing: gateway;dur={(self.sent_at - received) * 1e3:.2f}, "
                f"replica;dur={(now - self.sent_at) * 1e3:.2f}\r\n")

    def on_body(self, data: bytes) -> None:
        if self.finished or self.interim:
            return
        if self.streaming:
            now = self.gw.clock()
            if self.first_at is None:
                self.first_at = now
            self.last_at = now
            if self.held:
                data, self.held = self.held + data, b""
            if not data.endswith(b"\n\n"):
                # relay whole events only (llama-server writes one or more whole events per piece, so this is
                # rare): an event ends at a blank line, "\n\n" or "\r\n\r\n"
                lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
                end = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
                if len(data) - end <= MAX_HELD_EVENT:
                    data, self.held = data[:end], data[end:]
                if not data:
                    return
            self.events += data.count(b"data: ")
            self.saw_done = data.endswith(b"data: [DONE]\n\n")
            self.client.write_chunk(data)
        else:
            self.body.append(data)

    def on_message_complete(self) -> None:
        if self.finished:
            self.extra = True
            return
        if self.interim:
            self.interim = False
            return
        if self.done.done():               # failed already (cut short): not an answer
            return
        if self.held:                      # the answer ended without a blank line after its last event
            self.client.write_chunk(self.held)
            self.held = b""
        self.keep = self.parser.should_keep_alive()
        self.finished = True               # released by the connection once this read is parsed to its end
        self.done.set_result(True)

    # connection events
    def lost(self) -> None:
        if not self.head.done():
            self.head.set_exception(_Disconnected() if not self.got_bytes else
                                    _Disconnected("closed in the middle of the answer's head"))
            self.head.exception()          # retrieved: nobody awaits it when the client went away first
        if not self.done.done():
            self.error = self.error or "ServerDisconnectedError"
            self.done.set_result(False)

    def fail(self, why: str) -> None:
        self.error = why
        self.lost()

    def abort(self) -> None:
        self.up.exchange = None
        self.up.closed = True
        self.up.transport.abort()
        if not self.finished:
            self.lost()

    def pause(self) -> None:
        if not self.paused and not self.up.closed and not self.finished:
            self.paused = True
            self.up.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.up.closed and not self.finished:
            self.paused = False
            self.up.transport.resume_reading()


class Gateway:
    """The HTTP server around a :class:`Router`: asyncio protocols with httptools (llhttp) parsing on both sides.

    A streamed answer is relayed from the upstream connection's callback straight to the client's transport, so a
    token costs one read and one write, not a task switch; a request costs one task. Connections to each replica
    are kept alive in a pool and closed when the process behind the replica changes."""

    def __init__(self, router: Router | None = None, api_key: str | None = None, sink: Any = None,
                 connect_timeout_s: float = 5.0, *, upstream_key: str | None = None,
                 max_connections: int | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 send_timeout_s: float = SEND_TIMEOUT_S, upstream_idle_s: float = UPSTREAM_IDLE_S,
                 max_waiting_per_address: int = MAX_WAITING_PER_ADDRESS, min_body_rate: float = MIN_BODY_RATE,
                 upstream_answer_s: float = UPSTREAM_ANSWER_S, cors_origins: str | None = "localhost") -> None:
        self.router = router or Router()
        self.api_key = api_key or None
        self.upstream_key = upstream_key or None     # llama-server's own key: added upstream, never shown
        self.sink = sink
        self.connect_timeout_s = connect_timeout_s
        self.fixed_max_connections = max_connections   # None: sized from the slots (set_replicas)
        self.max_connections = max_connections or MIN_CONNECTIONS
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.idle_timeout_s, self.send_timeout_s = idle_timeout_s, send_timeout_s
        self.upstream_idle_s, self.upstream_answer_s = upstream_idle_s, upstream_answer_s
        self.cors_origins = cors_origins or ""    # "*", "localhost" or "origin, origin"; "" answers no origin
        self.max_waiting_per_address, self.min_body_rate = max_waiting_per_address, min_body_rate
        self.counts: dict[tuple[str, str], int] = {}
        self.recent: dict[tuple[str, str], RecentWindow] = {}      # (metric, replica) -> the last minutes
        self._observed: list[tuple[str, float, dict[str, str]]] = []   # histogram observations not yet flushed
        self._by_address: dict[str | None, set[_ClientConn]] = {}
        # the clock of latencies: time.monotonic, not the event loop's (uvloop's is cached per loop iteration and
        # counts whole milliseconds, too coarse for a gateway that adds a fraction of one)
        self.clock: Callable[[], float] = time.monotonic
        self._flushed: dict[tuple[str, str], int] = {}
        self._server: asyncio.AbstractServer | None = None
        self._pools: dict[str, _Pool] = {}          # replica -> its pool (of the replica's current epoch)
        self._clients: set[_ClientConn] = set()
        self.slots = 0
        self._house_task: asyncio.Task | None = None
        self.url = ""

    # --- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self, host: str, port: int, reuse_port: bool = False) -> str:
        """Listen on ``host:port``; ``reuse_port``: share the port with the deployment's other gateway processes
        (SO_REUSEPORT: the kernel spreads new connections over them)."""
        self._size_connections()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientConn(self), host, port, reuse_address=True,
                                                reuse_port=reuse_port or None, backlog=1024)
        self.url = f"http://{host}:{port}"
        self._house_task = asyncio.ensure_future(self._housekeeping())
        return self.url

    async def stop(self) -> None:
        if self._house_task is not None:
            self._house_task.cancel()
            self._house_task = None
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for c in list(self._clients):
            if c.transport is not None:
                c.transport.abort()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if server is not None:
            try:
                await asyncio.wait_for(server.wait_closed(), 5.0)
            except asyncio.TimeoutError:
                pass
        await asyncio.sleep(0)             # let the aborted transports report connection_lost

    async def _housekeeping(self, every_s: float = 0.5) -> None:
        n = 0
        while True:
            await asyncio.sleep(every_s)
            now = asyncio.get_running_loop().time()
            for pool in list(self._pools.values()):
                pool.sweep(now)
            self._enforce_deadlines(now)
            n += 1
            if self.sink is not None and n % 4 == 0:
                try:
                    self.flush_metrics()
                except Exception:
                    pass

    def _enforce_deadlines(self, now: float) -> None:
        """Closes connections past their head, body or keep-alive deadline, and clients that read nothing of
        their answer for ``send_timeout_s`` (slowloris, a pipelining client that never reads)."""
        for c in list(self._clients):
            if c.transport is None:
                continue
            if c.linger_until is not None:
                if now > c.linger_until:
                    c.transport.abort()
                continue
            if c.closed:
                continue
            if c.deadline is not None and now > c.deadline and c.task is None:
                if c.why_deadline == "idle":
                    c.close()
                else:
                    c.respond(408, error_body(f"request {c.why_deadline} not received within the time allowed",
                                              "invalid_request_error", 408), close=True)
            elif c.write_stalled_since is not None and now - c.write_stalled_since > self.send_timeout_s:
                c.transport.abort()

    # --- upstream connections ------------------------------------------------------------------------------------
    # One pool of kept-alive connections per replica. When the process behind a replica changes or dies, its pool
    # is closed at once: kept-alive connections to a dead server would hold the server's port in FIN-WAIT-2 and
    # stop its replacement from binding it.
    def _pool_for(self, rep: Replica) -> _Pool:
        pool = self._pools.get(rep.name)
        if pool is None or pool.epoch != rep.epoch:
            if pool is not None:
                pool.close()
            pool = self._pools[rep.name] = _Pool(rep.url, rep.epoch, self._release)
        return pool

    async def _acquire(self, rep: Replica) -> _UpstreamConn:
        pool = self._pool_for(rep)
        loop = asyncio.get_running_loop()
        now = loop.time()
        while pool.idle:
            up = pool.idle.pop()                    # the most recently used: the least likely to be closed
            if up.closed:
                continue
            if now - up.idle_since > UPSTREAM_KEEPALIVE_S:
                up.close()
                continue
            return up
        _, up = await asyncio.wait_for(loop.create_connection(lambda: _UpstreamConn(pool), pool.host, pool.port),
                                       self.connect_timeout_s)
        if pool.closed:                              # the replica changed while we connected
            up.close()
            raise ConnectionResetError("the replica changed while connecting")
        pool.conns.add(up)
        return up

    def _release(self, up: _UpstreamConn, keep: bool) -> None:
        pool = up.pool
        if keep and not up.closed and not pool.closed:
            up.idle_since = asyncio.get_running_loop().time()
            pool.idle.append(up)
        else:
            pool.conns.discard(up)
            up.close()

    def prune_sessions(self) -> None:
        """Close the pools of replicas that are gone or whose process changed (call after a table update)."""
        for name, pool in list(self._pools.items()):
            r = self.router.replicas.get(name)
            if r is None or r.epoch != pool.epoch:
                del self._pools[name]
                pool.close()

    def set_replicas(self, table: Iterable[Mapping[str, Any]]) -> int:
        table = list(table)
        self.router.set_replicas(table)
        self.slots = sum(int(row.get("slots") or DEFAULT_SLOTS) for row in table)
        self._size_connections()
        self.prune_sessions()
        return self.router.version

    def _size_connections(self) -> None:
        """The connection cap: as given, else from the deployment's slots; within the file descriptors."""
        cap = self.fixed_max_connections or max(MIN_CONNECTIONS, CONNECTIONS_PER_SLOT * self.slots)
        self.max_connections = min(cap, _connection_room())

    def _close_longest_idle(self) -> bool:
        """At the connection cap: closes the connection idle longest between requests (a client keeping a
        connection alive reconnects when it is closed); False when every one is in a request."""
        idle = [c for c in self._clients if c.waiting and c.in_head and c.head_bytes == 0]
        if not idle:
            return False
        min(idle, key=lambda c: c.waiting_since).evict("too many connections")
        return True

    # --- handlers ------------------------------------------------------------------------------------------------
    def _authorized(self, headers: Mapping[str, str]) -> bool:
        if not self.api_key:
            return True
        auth = headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode("latin-1"), self.api_key.encode("latin-1", "replace"))

    def _count(self, model: str, code: int) -> None:
        key = (model, str(code))
        self.counts[key] = self.counts.get(key, 0) + 1

    async def _handle(self, conn: _ClientConn, req: _Request) -> bool:
        """Serves one request; True when the connection stays open for the next."""
        path, method = req.path, req.method
        conn.cors = self._cors(req.headers)
        if method == "OPTIONS":
            self._preflight(conn, req)
        elif path in POST_ROUTES:
            if method != "POST":
                conn.respond(405, error_body(f"{path} takes POST", "invalid_request_error", 405),
                             extra="Allow: POST\r\n")
            else:
                await self._proxy(conn, req)
        elif path in GET_ROUTES and method == "GET":
            await self._proxy(conn, req)
        elif path in GET_ROUTES and method == "POST":
            conn.respond(405, error_body(f"{method} {path} would change one worker's settings: send it to the worker "
                                         "(`orchestrator status` shows their addresses); through the gateway "
                                         f"{path} takes GET", "invalid_request_error", 405), extra="Allow: GET\r\n")
        elif (path in MODEL_ROUTES or path.startswith("/v1/models/")) and method in ("GET", "HEAD"):
            self._models(conn, req)
        elif path in OPEN_ROUTES and method in ("GET", "HEAD"):
            n = self.router.healthy_count()
            if n:
                conn.respond(200, json.dumps({"status": "ok", "healthy_replicas": n}).encode())
            else:
                conn.respond(503, error_body("no healthy replica", "service_unavailable", 503))
        elif path in GET_ROUTES or path in MODEL_ROUTES or path in OPEN_ROUTES or path.startswith("/v1/models/"):
            conn.respond(405, error_body(f"{path} takes GET", "invalid_request_error", 405),
                         extra="Allow: GET, HEAD\r\n")
        elif path in PER_WORKER or path.startswith("/slots/"):
            conn.respond(404, error_body(f"{path} is one worker's own state, not served through the gateway: send it "
                                         "to the worker (`orchestrator status` shows their addresses)",
                                         "invalid_request_error", 404))
        else:
            conn.respond(404, error_body(f"no route {path}", "invalid_request_error", 404))
        return req.keep_alive and not conn.closed

    # --- CORS and the models list --------------------------------------------------------------------------------
    def _cors(self, headers: Mapping[str, str]) -> str:
        """The CORS header lines for an answer to a request from ``Origin`` (none when the policy does not allow
        it, and then a browser withholds the answer from the page): ``*`` allows any origin, ``localhost`` the
        pages of this machine, else a comma-separated list of origins. The origin is echoed, never ``*``, so an
        answer to a request with credentials is usable too (as llama-server does)."""
        origin = headers.get("origin")
        if not origin or not self.cors_origins:
            return ""
        policy = self.cors_origins.strip()
        if policy == "*" or (policy == "localhost" and origin_is_localhost(origin)) or \
                origin in {o.strip() for o in policy.split(",")}:
            return f"Access-Control-Allow-Origin: {origin}\r\nVary: Origin\r\n"
        return ""

    def _preflight(self, conn: _ClientConn, req: _Request) -> None:
        """A CORS preflight (``OPTIONS``), answered without the key: browsers never send credentials with it."""
        extra = "Allow: GET, HEAD, POST, OPTIONS\r\n"
        if conn.cors:
            asked = req.headers.get("access-control-request-headers", "")
            extra += ("Access-Control-Allow-Methods: GET, HEAD, POST, OPTIONS\r\n"
                      f"Access-Control-Allow-Headers: {asked or 'Authorization, Content-Type, X-Api-Key'}\r\n"
                      f"Access-Control-Allow-Credentials: true\r\nAccess-Control-Max-Age: {CORS_MAX_AGE_S}\r\n")
        conn.respond(204, b"", extra=extra)

    def _models(self, conn: _ClientConn, req: _Request) -> None:
        """``/v1/models`` (and llama-server's ``/models``): the deployment's aliases; ``/v1/models/{id}``: one."""
        entry = lambda m: {"id": m, "object": "model", "created": 0, "owned_by": "orchestrator"}  # noqa: E731
        if req.path in MODEL_ROUTES:
            return conn.respond(200, json.dumps({"object": "list",
                                                 "data": [entry(m) for m in self.router.models()]}).encode())
        from urllib.parse import unquote

        wanted = unquote(req.path[len("/v1/models/"):])
        if wanted in self.router.models():
            return conn.respond(200, json.dumps(entry(wanted)).encode())
        conn.respond(404, error_body(f"model {shown_name(wanted)} not found; available: "
                                     f"{', '.join(self.router.models())}", "invalid_request_error", "model_not_found"))

    # --- proxying ------------------------------------------------------------------------------------------------
    def _model_for(self, req: _Request) -> tuple[str | None, bool, tuple[int, bytes] | None]:
        """The alias a request goes to, whether it asks for a stream, or the error it gets. With one alias every
        request goes to it and the body is not parsed; with several, ``model`` in the JSON body picks (or the
        ``model`` query parameter, for a body that is not JSON and for GET)."""
        models = self.router.models()
        if len(models) <= 1:
            return (models[0] if models else None), req.method == "POST" and asks_to_stream(req.body), None
        doc: Any = None
        ctype = req.headers.get("content-type", "application/json").lower()
        if req.method == "POST" and ("json" in ctype or not ctype):
            try:
                doc = json.loads(req.body_bytes())
            except (ValueError, RecursionError):       # RecursionError: JSON nested too deep
                doc = None
            if not isinstance(doc, dict):
                return None, False, (400, error_body("request body is not a JSON object", "invalid_request_error",
                                                     400))
        requested = doc.get("model") if doc is not None and "model" in doc else self._query_model(req)
        stream = doc is not None and doc.get("stream") is True
        if requested is None:
            return None, stream, (400, error_body(
                f"{req.method} {req.path} does not say which model: this gateway serves {', '.join(models)}; give "
                "\"model\" in the body (or ?model= in the URL)", "invalid_request_error", "model_not_given"))
        model = self.router.resolve_model(requested)
        if model is None:
            return None, stream, (404, error_body(f"model {shown_name(requested)} not found; available: "
                                                  f"{', '.join(models)}", "invalid_request_error", "model_not_found"))
        return model, stream, None

    @staticmethod
    def _query_model(req: _Request) -> str | None:
        from urllib.parse import parse_qs

        _, _, query = req.url.partition(b"?")
        values = parse_qs(query.decode("latin-1")).get("model") if query else None
        return values[0] if values else None

    def _upstream_head(self, req: _Request, host: bytes) -> bytes:
        """The request line and headers for the replica: the client's end-to-end headers, not its key."""
        skip = _NOT_UPSTREAM
        if "connection" in req.headers:          # headers the client names in Connection are for this hop only
            skip = skip | {t.strip().lower() for t in req.headers["connection"].split(",")}
        lines = [f"{name}: {value}\r\n" for name, value in req.headers.items() if name not in skip]
        if req.method == "POST":
            if "content-type" not in req.headers:
                lines.append("content-type: application/json\r\n")
            lines.append(f"Content-Length: {req.size}\r\n")
        if self.upstream_key:
            lines.append(f"Authorization: Bearer {self.upstream_key}\r\n")
        return (req.method.encode("latin-1") + b" " + req.url + b" HTTP/1.1\r\nHost: " + host + b"\r\n"
                + "".join(lines).encode("latin-1") + b"\r\n")

    async def _proxy(self, conn: _ClientConn, req: _Request) -> None:
        if not self._authorized(req.headers):      # checked at the head already; kept as the last word
            self._count("-", 401)
            return conn.respond(*_unauthorized())
        model, stream, refusal = self._model_for(req)
        if refusal is not None:
            self._count("-", refusal[0])   # never the requested name: a label per made-up name grows forever
            return conn.respond(*refusal)
        if model is None:
            self._count("-", 503)
            return conn.respond(503, error_body("no replica serves any model yet", "service_unavailable", 503))
        # a streamed answer's head comes when its first token is ready; a non-streamed answer's only when the
        # whole generation is done, so silence until then is no fault of the replica
        head_wait = self.upstream_idle_s if stream else max(self.upstream_idle_s, self.upstream_answer_s)
        tried: set[str] = set()
        failures: list[str] = []
        stale = 0
        while True:
            rep = self.router.pick(model, tried)
            if rep is None:
                self._count(model, 503)
                why = (f"no replica of model {model!r} could take the request: {'; '.join(failures)}" if failures
                       else self.router.why_unavailable(model))
                return conn.respond(503, error_body(why, "service_unavailable", 503))
            tried.add(rep.name)
            rep.inflight += 1
            try:
                try:
                    up = await self._acquire(rep)
                except (OSError, asyncio.TimeoutError) as e:
                    if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                                              errno.ENOMEM):
                        # out of file descriptors here, not a sick replica
                        self._count(model, 503)
                        return conn.respond(503, error_body("the gateway is overloaded (out of file descriptors)",
                                                            "service_unavailable", 503), close=True)
                    # refused / reset / no answer to connect: nothing reached the client, so another replica may
                    # take it. Only this request learns of it: the health checks decide whether the replica is
                    # out, and its open connections (other requests' streams) are left alone
                    failures.append(f"{rep.name} unreachable ({type(e).__name__})")
                    continue
                ex = _Exchange(self, conn, up)
                up.exchange = ex
                conn.exchange = ex
                if conn.closed:
                    ex.abort()
                    return
                head = self._upstream_head(req, up.pool.host_header)
                if req.size <= SMALL_BODY:
                    # one write, one segment: the replica wakes once for the whole request
                    up.transport.write(head + req.body_bytes())
                else:
                    up.transport.write(head)
                    for piece in req.body:         # as it arrived: a big body is not copied into one
                        up.transport.write(piece)
                ex.sent_at = self.clock()
                try:
                    await self._progress(ex, ex.head, head_wait)
                except _Disconnected:
                    if conn.closed:
                        return
                    if ex.hung:                     # it took the request and went silent: this request's 504
                        self._count(model, 504)
                        return conn.respond(504, error_body(f"replica {rep.name}: {ex.error}", "gateway_timeout",
                                                            504))
                    if ex.got_bytes:
                        # it answered, badly (a broken or endless head): this request fails, and only it
                        self._count(model, 502)
                        return conn.respond(502, error_body(f"replica {rep.name} sent a malformed answer: "
                                                            f"{ex.error or 'closed in the middle of its head'}",
                                                            "bad_gateway", 502))
                    # closed before any answer: most often a pooled connection the server had just closed (idle
                    # timeout, its keep-alive limit), not a dead server: a fresh connection is tried first
                    if stale < STALE_RETRIES:
                        stale += 1
                        tried.discard(rep.name)
                        continue
                    failures.append(f"{rep.name} unreachable (closed the connection without an answer)")
                    continue
                complete = await self._progress(ex, ex.done, self.upstream_idle_s)
                if complete and not ex.streaming and ex.status == 503:
                    # the replica is up but serves nothing yet (llama-server answers 503 while it loads its
                    # model, as after a restart): nothing reached the client, so another replica may take it
                    failures.append(f"{rep.name} unavailable ({_error_message(b''.join(ex.body))})")
                    continue
                if complete:
                    self._observe(model, rep.name, req, ex)
                if not ex.streaming:
                    if not complete:
                        self._count(model, 502)
                        return conn.respond(502, error_body(f"replica {rep.name} failed mid-answer: {ex.error}",
                                                            "bad_gateway", 502))
                    self._count(model, ex.status)
                    return conn.respond(ex.status, b"".join(ex.body), ex.ctype, extra="".join(ex.passed))
                self._count(model, ex.status)
                if not complete:
                    # cut short (the replica died, hung or broke the framing): an error event (after the last
                    # whole event: an unfinished one was held back), then the connection ends without the last
                    # chunk, so any HTTP client sees an incomplete answer
                    self._count(model, 502)
                    conn.write_chunk(b"data: " + error_body(f"replica {rep.name} failed mid-stream: {ex.error}",
                                                            "bad_gateway", 502) + b"\n\n")
                    conn.abort()
                    return
                if not conn.end_stream():
                    conn.close()
                return
            finally:
                rep.inflight -= 1
                conn.exchange = None

    async def _progress(self, ex: "_Exchange", fut: asyncio.Future, limit: float):
        """``await fut``, giving up on a replica that sends nothing for ``limit`` seconds (one timer per request,
        nothing per token). Giving up ends this request's connection to the replica, nothing else."""
        loop = asyncio.get_running_loop()
        while not fut.done():
            quiet = loop.time() - ex.last_rx
            if quiet >= limit:
                ex.hung = True
                ex.fail(f"no answer for {limit:g}s")
                ex.up.transport.abort()
                break
            await asyncio.wait({fut}, timeout=limit - quiet)
        return await fut

    # --- metrics -------------------------------------------------------------------------------------------------
    def _observe(self, model: str, replica: str, req: _Request, ex: "_Exchange") -> None:
        """The latency of one complete 2xx answer: its duration; for a stream also the time to its first body
        byte and its tokens per second after the first (events after the first over the time between them)."""
        if not 200 <= ex.status < 300:
            return
        now = self.clock()
        tags = {"model": model, "replica": replica}
        out = [("orchestrator_gateway_request_duration_seconds", now - req.received)]
        if ex.streaming and ex.first_at is not None:
            ttft = ex.first_at - req.received
            out.append(("orchestrator_gateway_time_to_first_token_seconds", ttft))
            self._recent("orchestrator_gateway_recent_time_to_first_token", replica, SECONDS_BUCKETS).observe(ttft,
                                                                                                             now)
            tokens = ex.events - (1 if ex.saw_done else 0)
            if tokens >= 2 and ex.last_at > ex.first_at:
                tps = (tokens - 1) / (ex.last_at - ex.first_at)
                out.append(("orchestrator_gateway_stream_tokens_per_second", tps))
                self._recent("orchestrator_gateway_recent_stream_tokens_per_second", replica,
                             RATE_BUCKETS).observe(tps, now)
        if self.sink is not None and len(self._observed) < 100_000:   # bounded if flushing stops
            self._observed.extend((name, value, tags) for name, value in out)

    def _recent(self, name: str, replica: str, bounds) -> RecentWindow:
        w = self.recent.get((name, replica))
        if w is None:
            w = self.recent[(name, replica)] = RecentWindow(bounds)
        return w

    def recent_latency(self) -> dict[str, dict[str, float | int | None]]:
        """Per replica over the last minutes: streams, p50/p95 time to first token (s), p50 tokens/s."""
        now = self.clock()
        out: dict[str, dict[str, float | int | None]] = {}
        for (name, replica), w in self.recent.items():
            cum = w.cumulative(now)
            row = out.setdefault(replica, {})
            if name.endswith("time_to_first_token"):
                row["streams"] = cum["+Inf"]
                row["ttft_p50_s"], row["ttft_p95_s"] = quantile(0.5, cum), quantile(0.95, cum)
            else:
                row["tokens_per_s_p50"] = quantile(0.5, cum)
        return out

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
        now = self.clock()
        for (name, replica), w in list(self.recent.items()):
            for le, n in w.cumulative(now).items():
                self.sink.set(name, n, {"replica": replica, "le": le})
        observed, self._observed = self._observed, []
        for name, value, tags in observed:
            self.sink.observe(name, value, tags)

    def stats(self) -> dict:
        return {"url": self.url, "version": self.router.version,
                "replicas": [{"name": r.name, "url": r.url, "model": r.model, "healthy": r.healthy,
                              "inflight": r.inflight, "detail": r.detail} for r in self.router.replicas.values()],
                "requests": {f"{m}:{c}": n for (m, c), n in self.counts.items()},
                "recent": self.recent_latency()}


class GatewayActor:
    """The gateway inside a Ray (async) actor: the server runs on the actor's event loop."""

    def __init__(self) -> None:
        self.gw: Gateway | None = None

    async def start(self, host: str, port: int, api_key: str | None, table: list[dict],
                    reuse_port: bool = False, upstream_key: str | None = None,
                    cors_origins: str | None = "localhost") -> str:
        from orchestrator.cluster.ray_api import RayApi

        if self.gw is not None:
            return self.gw.url
        gw = Gateway(Router(), api_key=api_key, sink=RayApi().metrics_sink(), upstream_key=upstream_key,
                     cors_origins=cors_origins)
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
