"""llama-server's whole API through the gateway, over real sockets: every route a worker serves is proxied with the
same key, limits and metrics; ``/v1/models/{id}``; model routing for requests without a ``model``; the replica's
own headers passed back (not hop-by-hop ones); CORS preflight without the key. First against a small aiohttp
upstream that records what reached it, then against a real llama-server with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from orchestrator.cluster.gateway import GET_ROUTES, POST_ROUTES, Gateway, Router
from cluster_support import free_port


def run(coro):
    return asyncio.run(coro)


class Echo:
    """An upstream answering every route with what it got: path, method, query, headers, body."""

    def __init__(self, name: str) -> None:
        self.name, self.port, self.runner = name, free_port(), None

    async def handle(self, request):
        body = await request.read()
        return web.json_response({"replica": self.name, "path": request.path, "method": request.method,
                                  "query": request.query_string,
                                  "headers": {k.lower(): v for k, v in request.headers.items()},
                                  "body": body.decode()},
                                 headers={"X-Request-Id": "r-1", "Server": "llama.cpp",
                                          "Access-Control-Allow-Origin": "*", "Keep-Alive": "timeout=5"})

    async def start(self):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    def row(self, model: str = "m"):
        return {"name": self.name, "url": f"http://127.0.0.1:{self.port}", "model": model, "healthy": True}

    async def stop(self):
        await self.runner.cleanup()


async def with_gateway(rows, fn, **kw):
    gw = Gateway(Router(), **kw)
    gw.set_replicas(rows)
    port = free_port()
    await gw.start("127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as s:
            return await fn(s, f"http://127.0.0.1:{port}", gw)
    finally:
        await gw.stop()


def test_every_route_a_worker_serves_is_proxied_with_the_key_and_counted():
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize",
            "/apply-template", "/v1/rerank", "/v1/embeddings", "/infill"} <= POST_ROUTES

    async def go():
        up = await Echo("w0").start()
        try:
            async def fn(s, base, gw):
                for path in sorted(POST_ROUTES):
                    async with s.post(base + path, json={"x": 1}) as r:
                        assert r.status == 401, path          # the same key as the chat route
                    async with s.post(base + path + "?a=1", json={"x": 1},
                                      headers={"Authorization": "Bearer k", "Anthropic-Version": "2023-06-01"}) as r:
                        assert r.status == 200, (path, await r.text())
                        got = await r.json()
                    assert (got["path"], got["method"], got["query"], got["body"]) == (path, "POST", "a=1",
                                                                                        '{"x": 1}')
                    assert got["headers"]["anthropic-version"] == "2023-06-01"   # end-to-end headers go on
                    assert "authorization" not in got["headers"]                  # the client's key does not
                async with s.get(base + "/props", headers={"Authorization": "Bearer k"}) as r:
                    assert r.status == 200 and (await r.json())["path"] == "/props"
                async with s.post(base + "/props", json={}, headers={"Authorization": "Bearer k"}) as r:
                    assert r.status == 405 and "send it to the worker" in (await r.json())["error"]["message"]
                async with s.get(base + "/slots", headers={"Authorization": "Bearer k"}) as r:
                    assert r.status == 404 and "one worker's own state" in (await r.json())["error"]["message"]
                assert gw.counts[("m", "200")] == len(POST_ROUTES) + len(GET_ROUTES)
                assert gw.counts[("-", "401")] == len(POST_ROUTES)
            await with_gateway([up.row()], fn, api_key="k")
        finally:
            await up.stop()
    run(go())


def test_models_retrieve_and_routing_of_requests_that_name_no_model():
    async def go():
        a, b = await Echo("a").start(), await Echo("b").start()
        try:
            async def one(s, base, gw):
                async with s.get(base + "/v1/models/m") as r:
                    assert r.status == 200 and (await r.json())["id"] == "m"
                async with s.post(base + "/tokenize", json={"content": "hi"}) as r:   # one model: that one
                    assert r.status == 200 and (await r.json())["replica"] == "a"
            await with_gateway([a.row("m")], one)

            async def several(s, base, gw):
                async with s.get(base + "/v1/models/n") as r:
                    assert r.status == 200 and (await r.json()) == {"id": "n", "object": "model", "created": 0,
                                                                   "owned_by": "orchestrator"}
                async with s.get(base + "/v1/models/zz") as r:
                    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
                async with s.post(base + "/tokenize", json={"content": "hi"}) as r:
                    body = await r.json()
                    assert r.status == 400 and body["error"]["code"] == "model_not_given"
                    assert "serves m, n" in body["error"]["message"]
                async with s.post(base + "/tokenize", json={"content": "hi", "model": "n"}) as r:
                    assert (await r.json())["replica"] == "b"
                async with s.get(base + "/props?model=n") as r:
                    assert (await r.json())["replica"] == "b"
            await with_gateway([a.row("m"), b.row("n")], several)
        finally:
            await a.stop()
            await b.stop()
    run(go())


def test_the_replicas_headers_come_back_but_not_hop_by_hop_ones_nor_its_cors():
    async def go():
        up = await Echo("w0").start()
        try:
            async def fn(s, base, gw):
                async with s.post(base + "/v1/completions", json={}, headers={"Origin": "http://evil.example"}) as r:
                    assert r.status == 200 and r.headers["X-Request-Id"] == "r-1"
                    # where the time to the head went: the gateway's part and the replica's
                    assert re.fullmatch(r"gateway;dur=\d+\.\d\d, replica;dur=\d+\.\d\d", r.headers["Server-Timing"])
                    for hop in ("Keep-Alive", "Server", "Access-Control-Allow-Origin"):
                        assert hop not in r.headers, hop
                    assert "origin" not in (await r.json())["headers"]
                async with s.post(base + "/v1/completions", json={}, headers={"Origin": "http://localhost:3000"}) as r:
                    assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
            await with_gateway([up.row()], fn)
        finally:
            await up.stop()
    run(go())


@pytest.mark.parametrize("policy,origin,allowed", [("localhost", "http://localhost:5173", True),
                                                   ("localhost", "https://app.example", False),
                                                   ("https://app.example", "https://app.example", True),
                                                   ("*", "https://any.example", True),
                                                   ("", "http://localhost:5173", False)])
def test_a_cors_preflight_is_answered_per_the_policy_without_the_key(policy, origin, allowed):
    async def go():
        async def fn(s, base, gw):
            async with s.options(base + "/v1/chat/completions",
                                 headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization, content-type"}) as r:
                assert r.status == 204
                if allowed:
                    assert r.headers["Access-Control-Allow-Origin"] == origin
                    assert "POST" in r.headers["Access-Control-Allow-Methods"]
                    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
                else:
                    assert "Access-Control-Allow-Origin" not in r.headers
        await with_gateway([], fn, api_key="k", cors_origins=policy)
    run(go())


# --- against a real llama-server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory, llama_server_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_llama import write_tiny_llama

    tmp = tmp_path_factory.mktemp("gw-llama")
    model = write_tiny_llama(tmp / "tiny.gguf")
    port = free_port()
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([llama_server_path, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "-c", "512", "-np", "2", "-t", "1", "--no-warmup"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "llama-server not healthy in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


@pytest.mark.integration
def test_the_openai_client_and_an_anthropic_call_through_the_gateway_to_llama_server(llama):
    openai = pytest.importorskip("openai")

    async def go():
        async def fn(s, base, gw):
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            model = await client.models.retrieve("tiny")
            assert model.id == "tiny"
            resp = await client.responses.create(model="tiny", input="Hello", max_output_tokens=4)
            assert resp.object == "response" and resp.status == "completed" and resp.usage.output_tokens >= 1
            chunks = await client.chat.completions.create(model="tiny", stream=True, max_tokens=6,
                                                          messages=[{"role": "user", "content": "Hello"}])
            pieces = [c async for c in chunks]
            assert pieces and any(c.choices and c.choices[0].finish_reason for c in pieces)
            await client.close()
            # an Anthropic client's call: its key header and version header, /v1/messages and its token count
            headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
            msg = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
            async with s.post(base + "/v1/messages", json=msg, headers=headers) as r:
                body = await r.json()
                assert r.status == 200 and body["type"] == "message" and body["content"][0]["type"] == "text"
            async with s.post(base + "/v1/messages/count_tokens", json=msg, headers=headers) as r:
                assert r.status == 200 and (await r.json())["input_tokens"] > 0
            async with s.post(base + "/v1/messages", json={**msg, "stream": True}, headers=headers) as r:
                text = (await r.read()).decode()
                assert r.status == 200 and "event: message_stop" in text
            assert gw.counts[("tiny", "200")] == 5        # models.retrieve is the gateway's own answer
        await with_gateway([{"name": "w0", "url": llama, "model": "tiny", "healthy": True}], fn, api_key="k")
    run(go())
