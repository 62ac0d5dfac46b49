"""Real HTTP servers on 127.0.0.1 for the remote-model tests: a file server (range-capable or not, able to drop
a connection mid-body, counting the bytes it sends) and a stand-in of the Hugging Face Hub's API and /resolve/
endpoint that huggingface_hub is pointed at with HF_ENDPOINT (its LFS files redirect to a file server, as the
Hub's do to its CDN)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Blob:
    """A file's bytes: a local file (sparse ones read as zeros) or ``head`` followed by zeros up to ``size``."""

    def __init__(self, path: str | os.PathLike | None = None, *, head: bytes = b"", size: int | None = None,
                 etag: str | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.head = head
        self.size = self.path.stat().st_size if self.path is not None else (len(head) if size is None else size)
        self.etag = etag or f'"{hashlib.md5(f"{path}{len(head)}{self.size}".encode()).hexdigest()}"'

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        if self.path is not None:
            with open(self.path, "rb") as f:
                f.seek(offset)
                return f.read(n)
        out = self.head[offset:offset + n]
        return out + b"\0" * (n - len(out))

    def sha256(self) -> str:
        h = hashlib.sha256()
        pos = 0
        while pos < self.size:
            chunk = self.read(pos, 1 << 22)
            h.update(chunk)
            pos += len(chunk)
        return h.hexdigest()


@dataclass
class Stats:
    sent: int = 0                       # body bytes written
    requests: list = field(default_factory=list)   # (method, path, Range header, Authorization header)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.sent += n

    def gets(self) -> list:
        return [r for r in self.requests if r[0] == "GET"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class FileServer:
    """Serves ``files`` (URL path -> Blob). ``ranges=False`` answers every GET with 200 and the whole body.
    ``drop_after``: close the connection after this many body bytes, for the next ``drops`` responses.
    ``status``: URL path -> status code answered instead (401, 403, ...). ``pace_s``: a pause after each 64 KiB
    of body (a slow link)."""

    def __init__(self, files: dict[str, Blob] | None = None, *, ranges: bool = True) -> None:
        self.files: dict[str, Blob] = dict(files or {})
        self.ranges = ranges
        self.drop_after: int | None = None
        self.drops = 0
        self.pace_s = 0.0
        self.status: dict[str, int] = {}
        self.stats = Stats()
        self.httpd = _Server(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def __enter__(self) -> "FileServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _take_drop(self) -> int | None:
        with self.stats.lock:
            if self.drop_after is not None and self.drops > 0:
                self.drops -= 1
                return self.drop_after
        return None

    def extra_headers(self, path: str, blob: Blob) -> dict[str, str]:
        return {}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                server.stats.requests.append((self.command, path, self.headers.get("Range"),
                                              self.headers.get("Authorization")))
                if server.route(self, path, body):
                    return
                if path in server.status:
                    return self._empty(server.status[path])
                blob = server.files.get(path)
                if blob is None:
                    return self._empty(404)
                start, end, code = 0, blob.size - 1, 200
                rng = self.headers.get("Range")
                if_range = self.headers.get("If-Range")
                if rng and server.ranges and (if_range is None or if_range == blob.etag):
                    m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
                    if not m or int(m.group(1)) >= blob.size:
                        return self._empty(416, {"Content-Range": f"bytes */{blob.size}"})
                    start = int(m.group(1))
                    end = min(int(m.group(2)), blob.size - 1) if m.group(2) else blob.size - 1
                    code = 206
                self.send_response(code)
                self.send_header("Content-Length", str(end - start + 1))
                self.send_header("ETag", blob.etag)
                if server.ranges:
                    self.send_header("Accept-Ranges", "bytes")
                if code == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{blob.size}")
                for k, v in server.extra_headers(path, blob).items():
                    self.send_header(k, v)
                self.end_headers()
                if not body:
                    return
                limit = server._take_drop()
                pos = start
                try:
                    while pos <= end:
                        n = min(1 << 16, end + 1 - pos)
                        if limit is not None:
                            n = min(n, start + limit - pos)
                            if n <= 0:
                                self.close_connection = True
                                self.connection.shutdown(2)
                                return
                        data = blob.read(pos, n)
                        # counted before the write: the client can hold the last byte before this thread runs on
                        server.stats.add(len(data))
                        try:
                            self.wfile.write(data)
                        except OSError:
                            server.stats.add(-len(data))
                            raise
                        pos += n
                        if server.pace_s:
                            time.sleep(server.pace_s)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _empty(self, code: int, headers: dict | None = None, body: bytes = b"") -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

        return Handler

    def route(self, handler, path: str, body: bool) -> bool:
        """Subclasses answer their own paths here (returns True when answered)."""
        return False


class HubServer(FileServer):
    """A stand-in of the Hub: ``GET /api/models/ORG/REPO[/revision/REV]`` lists the repository's files with
    their sizes and LFS hashes; ``HEAD|GET /ORG/REPO/resolve/REV/FILE`` redirects to ``cdn`` (another server, so
    huggingface_hub stops at the redirect and reads X-Linked-ETag / X-Linked-Size from it, as on the real Hub).
    ``gated``: repositories that need ``Authorization: Bearer TOKEN``; ``bad_sha``: files whose published hash is
    wrong."""

    def __init__(self, cdn: FileServer, token: str = "") -> None:
        super().__init__()
        self.cdn = cdn
        self.repos: dict[str, dict[str, Blob]] = {}
        self.gated: set[str] = set()
        self.token = token
        self.bad_sha: set[str] = set()
        self._sha: dict[tuple[str, str], str] = {}

    def add_repo(self, repo: str, files: dict[str, Blob]) -> None:
        self.repos[repo] = files
        for name, blob in files.items():
            self.cdn.files[f"/cdn/{repo}/{name}"] = blob

    def sha(self, repo: str, name: str) -> str:
        """The file's SHA-256; a file over 1 GiB (a sparse full-size model, only ever planned from, never
        pulled) gets a made-up one instead of hashing its zeros."""
        key = (repo, name)
        if key not in self._sha:
            blob = self.repos[repo][name]
            self._sha[key] = (blob.sha256() if blob.size <= 1 << 30
                              else hashlib.sha256(blob.etag.encode()).hexdigest())
        return self._sha[key]

    def route(self, h, path: str, body: bool) -> bool:
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        r = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m and not r:
            return False
        repo = (m or r).group(1)
        if repo not in self.repos:
            h._empty(401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            return True
        if repo in self.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            h._empty(403 if h.headers.get("Authorization") else 401,
                     {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted"})
            return True
        files = self.repos[repo]
        if m:
            siblings = [{"rfilename": n, "size": b.size, "lfs": {"sha256": self.sha(repo, n), "size": b.size,
                                                                           "pointerSize": 134}}
                        for n, b in files.items()]
            doc = json.dumps({"id": repo, "modelId": repo, "sha": "0" * 40, "private": False,
                              "siblings": siblings}).encode()
            h._empty(200, {"Content-Type": "application/json"}, doc)
            return True
        name = r.group(3)
        if name not in files:
            h._empty(404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"})
            return True
        sha = self.sha(repo, name)
        if name in self.bad_sha:
            sha = hashlib.sha256(sha.encode()).hexdigest()
        h._empty(302, {"Location": self.cdn.url(f"/cdn/{repo}/{name}"), "X-Repo-Commit": "0" * 40,
                       "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(files[name].size),
                       "ETag": f'"{sha}"'})
        return True
