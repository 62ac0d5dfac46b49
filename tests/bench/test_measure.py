"""Measurements through a real llama-server (tiny model, CPU): prompt processing, generation at depth, time to
first token, and that llama-server's prompt cache never serves a measured request."""

from __future__ import annotations

import asyncio
import random

import pytest

from orchestrator.bench.measure import Client, MeasureError, Workload, fit_length, run_measure
from orchestrator.bench.server import free_port

pytestmark = pytest.mark.integration


def test_fit_length():
    assert fit_length(100, 1, 512) == 100
    assert fit_length(512, 1, 512) == 510                 # prompt + 1 generated < 512, shortened < 5%
    assert fit_length(4096, 128, 4096) == 3967            # sweep-bench depth 4096 in a 4096 slot: 3.1% shorter
    assert fit_length(600, 1, 512) is None                # 15% short: skipped, not faked
    assert fit_length(511, 0, 512) == 511


def test_pp_reps_shrink_for_long_prompts():
    from orchestrator.bench.measure import pp_reps

    assert [pp_reps(3, n) for n in (8, 512, 1024, 2048, 4096, 16384)] == [3, 3, 3, 2, 1, 1]
    assert pp_reps(1, 8) == 1


def test_workload_on_a_real_server(tiny_server):
    w = Workload(pp=(8, 64, 512, 700), pp_reps=2, tg_depths=(0, 300), tg_tokens=16, concurrency=(1, 3),
                 ttft_prompt=32, ttft_tokens=2, ttft_requests=3)
    steps = []
    out = run_measure(tiny_server, w, timeout=60, seed=1, on_step=steps.append)
    assert out["errors"] == [] and out["crashed"] is False
    assert out["slot_ctx"] == 512 and out["n_vocab"] == 512
    by_n = {}
    for s in out["pp"]:
        by_n.setdefault(s["n"], []).append(s)
        assert s["tps"] > 0 and s["prompt_ms"] > 0
    assert sorted(by_n) == [8, 64, 512] and all(len(v) == 2 for v in by_n.values())
    assert {s["prompt_n"] for s in by_n[8]} == {8} and {s["prompt_n"] for s in by_n[64]} == {64}
    assert {s["prompt_n"] for s in by_n[512]} == {510}    # shortened to fit, and recorded as such
    assert out["skipped"] == ["pp700: does not fit the slot context of 512 tokens"]
    assert [(t["depth"], t["predicted_n"], t["prompt_n"]) for t in out["tg"]] == [(0, 16, 1), (300, 16, 300)]
    assert all(t["tps"] > 0 for t in out["tg"])
    assert {k: len(v) for k, v in out["ttft"].items()} == {"1": 3, "3": 3}
    assert all(0 < x < 30 for v in out["ttft"].values() for x in v)
    assert steps == ["warm-up", "pp8", "pp64", "pp512", "tg16@0", "tg16@300", "ttft c1", "ttft c3"]


def test_streams_generate_together_and_their_aggregate_is_recorded(tiny_server):
    """Two streams on the server's two slots: each run records both streams' decode, and the aggregate is their
    tokens over the longer decode (at least the slower stream's speed, at most the sum of both; how much the two
    decodes overlap is the machine's to say)."""
    w = Workload(pp=(), tg_depths=(), tg_tokens=24, tg_reps=2, tg_streams=(1, 2), concurrency=(), warmup=False)
    steps = []
    out = run_measure(tiny_server, w, timeout=60, seed=3, on_step=steps.append)
    assert out["errors"] == [] and steps == ["tg24 x1", "tg24 x2"]
    one, two = out["tg_streams"]["1"]["runs"], out["tg_streams"]["2"]["runs"]
    assert len(one) == 2 and len(two) == 2
    for run in two:
        assert run["streams"] == 2 and run["predicted_n"] == 48 and len(run["per_stream_tps"]) == 2
        assert run["slots"] == [0, 1]         # stream i on slot i: busy slots without a gap between them
        assert min(run["per_stream_tps"]) <= run["tps"] <= sum(run["per_stream_tps"]) * 1.0001
    assert all(r["tps"] == pytest.approx(r["per_stream_tps"][0]) for r in one)
    assert "moe_cache" not in out["tg_streams"]["2"]          # no expert cache on this server


def test_same_prompt_twice_is_processed_twice(tiny_server):
    """cache_prompt false: even an identical prompt on the same slot is computed again."""
    async def main():
        async with Client(tiny_server, timeout=30, rng=random.Random(0)) as c:
            await c.server_info()
            fixed = c.tokens(200)
            c.tokens = lambda n: list(fixed[:n])
            a = await c.completion(200, 1)
            b = await c.completion(200, 1)
            return a, b

    a, b = asyncio.run(main())
    assert a["prompt_n"] == b["prompt_n"] == 200 and b["cache_n"] == 0


def test_errors_are_measure_errors(tiny_server):
    async def too_long():
        async with Client(tiny_server, timeout=30, rng=random.Random(0)) as c:
            await c.server_info()
            await c.completion(600, 1)

    with pytest.raises(MeasureError, match="HTTP 400.*context"):
        asyncio.run(too_long())
    with pytest.raises(MeasureError, match="GET /v1/models"):
        run_measure(f"http://127.0.0.1:{free_port()}", Workload(), timeout=5, seed=0)


class FlakyClient:
    """A client whose requests fail as scripted (seam for the retry logic; the real path is tested above)."""

    def __init__(self, fail_every: int | None = None, always_fail: str | None = None):
        from orchestrator.bench.measure import ServerInfo

        self.info = ServerInfo(n_vocab=100, slot_ctx=4096)
        self.calls = 0
        self.fail_every, self.always_fail = fail_every, always_fail

    async def _maybe_fail(self, kind):
        self.calls += 1
        if kind == self.always_fail or (self.fail_every and self.calls % self.fail_every == 1):
            raise MeasureError("ServerDisconnectedError")

    async def completion(self, n, n_predict, slot=None):
        await self._maybe_fail("pp" if n_predict == 1 else "other")
        return {"prompt_n": n, "prompt_ms": 1.0, "predicted_n": n_predict, "predicted_ms": 2.0}

    async def first_token(self, n, n_predict):
        await self._maybe_fail("ttft")
        return 0.01, 0.02, None

    async def expert_cache_counters(self):
        return None


def test_a_dropped_request_is_retried_once_and_a_persistent_failure_recorded():
    from orchestrator.bench.measure import measure

    w = Workload(pp=(8, 32), pp_reps=2, tg_depths=(0,), tg_tokens=4, concurrency=(1,), ttft_requests=2)
    out = asyncio.run(measure(FlakyClient(fail_every=2), w))
    assert out["errors"] == [] and out["retried"] > 0
    assert len(out["pp"]) == 4 and len(out["tg"]) == 1 and len(out["ttft"]["1"]) == 2

    out = asyncio.run(measure(FlakyClient(always_fail="pp"), w))
    assert out["pp"] == [] and len(out["errors"]) == 4 and out["crashed"] is False
    assert len(out["tg"]) == 1                           # the rest is still measured

    out = asyncio.run(measure(FlakyClient(always_fail="pp"), w, alive=lambda: False))
    assert out["crashed"] is True and len(out["errors"]) == 1 and out["tg"] == []


def test_requests_sample_with_a_seed_each():
    """Greedy decoding of a random-weight model loops (and fakes an expert cache's locality): every request
    samples, each with its own seed from the seeded generator, with llama-server's own top_k/top_p (top_k 0
    would make top_p sort the whole vocabulary for every token, a cost that is not the model's)."""
    import random

    from orchestrator.bench.measure import Client, ServerInfo

    def bodies(seed):
        c = Client("http://127.0.0.1:1", timeout=1, rng=random.Random(seed))
        c.info = ServerInfo(n_vocab=1000, slot_ctx=4096)
        return [c._body(8, 16) for _ in range(3)]

    a, b = bodies(1), bodies(1)
    assert all(x["temperature"] == 1.0 for x in a)
    assert not any({"top_k", "top_p", "min_p"} & x.keys() for x in a)
    assert [x["seed"] for x in a] == [x["seed"] for x in b] and len({x["seed"] for x in a}) == 3


def test_expert_cache_counters_are_read_from_the_metrics_page():
    from orchestrator.bench.measure import parse_expert_cache_counters

    page = ("# HELP llamacpp:moe_cache_hits_total hits\n# TYPE llamacpp:moe_cache_hits_total counter\n"
            "llamacpp:moe_cache_hits_total 750\nllamacpp:moe_cache_lookups_total 1000\n"
            "llamacpp:moe_cache_misses_total 250\nllamacpp:moe_cache_cpu_misses_total 40\n"
            "llamacpp:moe_cache_uploaded_bytes_total 1.5e+09\nllamacpp:prompt_tokens_total 5\n")
    assert parse_expert_cache_counters(page) == {"hits": 750.0, "lookups": 1000.0, "misses": 250.0, "cpu_misses": 40.0,
                                              "uploaded_bytes": 1.5e9}
    assert parse_expert_cache_counters("llamacpp:prompt_tokens_total 5\n") is None


class CountingClient(FlakyClient):
    """A server whose expert cache reads 3 of every 4 expert bytes of a prompt from its slots (seam: the counters
    of a real patched server are checked by the RPC tests)."""

    def __init__(self):
        super().__init__()
        self.counters = {"hits": 0.0, "lookups": 0.0, "prefill_saved_bytes": 0.0, "prefill_copied_bytes": 0.0}

    async def completion(self, n, n_predict, slot=None):
        if n_predict == 1:
            self.counters["prefill_saved_bytes"] += 3.0 * n
            self.counters["prefill_copied_bytes"] += 1.0 * n
        else:
            self.counters["hits"] += n_predict
            self.counters["lookups"] += 2 * n_predict
        return await super().completion(n, n_predict, slot)

    async def expert_cache_counters(self):
        return dict(self.counters)


def test_what_prompts_read_from_the_slots_is_recorded_per_prompt_length():
    from orchestrator.bench.measure import measure
    from orchestrator.bench.report import render_text
    from orchestrator.bench.summary import run_metrics, summarize

    w = Workload(pp=(8, 32), pp_reps=2, tg_depths=(0,), tg_tokens=4, concurrency=(1,), ttft_requests=1,
                 warmup=False)
    out = asyncio.run(measure(CountingClient(), w))
    assert out["moe_cache_pp"]["8"]["prefill_saved_bytes"] == 48.0          # two prompts of 8, nothing else
    assert out["moe_cache_pp"]["32"]["prefill_copied_bytes"] == 64.0
    assert out["moe_cache"]["prefill_saved_bytes"] == 0.0                   # generation read nothing
    m = run_metrics({"loaded": True, "samples": out})
    assert m["expert_cache_read_pp8"] == [0.75] and m["expert_cache_read_pp32"] == [0.75]
    summary = summarize([{"name": "plan", "group": "plan", "params": {}}], [{"config": "plan", "loaded": True,
                                                                         "samples": out}])
    text = render_text({"summary": summary, "ratios": []})
    assert "slots read pp8" in text and "75.0%" in text
