"""The expert cache on a GPU: same greedy tokens and logits with the cache as without it, and counters that add up.

Needs an NVIDIA GPU and a CUDA llama-server built with our patch series ($LLAMA_SERVER, else the suite's). On the
device it runs without the suite's conftest (`pytest --noconftest -m gpu tests/backend/test_expert_cache_gpu.py`);
in CI it is skipped (no GPU). Its result is recorded in docs/benchmarks.md.

Three servers, all with every routed expert in host memory (`-ngl 999 --cpu-moe`), on one generated W1-shaped model:
- cache: 24 slots per expert tensor (of 128 experts), so decoding evicts all the time; the prompt takes the
  offload path (GGML_OP_OFFLOAD_MIN_BATCH=1), as in the next run;
- offload: no cache, GGML_OP_OFFLOAD_MIN_BATCH=1: every batch copies its experts to the GPU and computes there.
  The same CUDA kernels read the same expert bytes, only from another place: tokens and probabilities must match
  exactly;
- cpu: no cache, llama.cpp's default: decode computes the experts on the CPU. Other kernels: probabilities must
  agree within the backends' usual tolerance until the first greedy divergence.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from orchestrator.model import synth
from tests.backend.expert_cache_support import PROMPT, agreement, probs, serve_in_turn, server_path

pytestmark = pytest.mark.gpu

N_PREDICT = 256


def _run_in_turn(server: str, model: Path, log: Path, extra: list[str], env: dict[str, str],
                 bodies: list[dict], experts: tuple[str, ...] = ("--cpu-moe",)) -> tuple[list[tuple[dict, dict]], str]:
    """Every routed expert in host memory (``-ngl 999 --cpu-moe``, or ``experts``): ``bodies`` answered one after
    another."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-np", "1",
            "-ngl", "999", *experts, "-fa", "on", "--metrics", "--no-warmup", "-t", "8", *extra]
    return serve_in_turn(argv, log, f"http://127.0.0.1:{port}", bodies, env)


def _run(server: str, model: Path, log: Path, extra: list[str], env: dict[str, str]) -> tuple[dict, dict, str]:
    ((out, metrics),), text = _run_in_turn(server, model, log, extra, env, [{"n_predict": N_PREDICT}])
    return out, metrics, text


def _expert_tensors(model: Path) -> tuple[int, int]:
    """(bytes of one expert of one routed expert tensor, how many such tensors) of ``model``."""
    from orchestrator.model.reader import read_gguf

    experts = [t for t in read_gguf(model).tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps", t.name)]
    return experts[0].nbytes // experts[0].shape[-1], len(experts)


def _mib_for_slots(slots: int, expert_bytes: int, n_tensors: int) -> int:
    """--moe-cache-mib that gives every tensor ``slots`` slots, not one more."""
    return -(-slots * expert_bytes * n_tensors // 2**20)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("w1") / "w1-small.gguf"
    return synth.write_model(path, "qwen3-30b-a3b", scale=0.25, quant="q4_0", seed=21).path


def test_cache_gives_the_tokens_and_logits_of_the_uncached_gpu_path(model, tmp_path):
    server = server_path()
    from orchestrator.model.reader import read_gguf

    info = read_gguf(model)
    experts = [t for t in info.tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps", t.name)]
    assert len({t.nbytes for t in experts}) == 1      # one slot size for every tensor
    expert_bytes = experts[0].nbytes // experts[0].shape[-1]
    n_tensors = len(experts)
    slots = 24
    mib = -(-slots * expert_bytes * n_tensors // 2**20)     # enough for 24 slots per tensor, not 25
    # the prompt (16 tokens, above the cache's batches) takes the offload path in both GPU runs, so that both
    # decode from the same KV cache
    cache, m_cache, log_cache = _run(server, model, tmp_path / "cache.log",
                                     ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4"],
                                     {"GGML_OP_OFFLOAD_MIN_BATCH": "1"})
    offload, _m, _l = _run(server, model, tmp_path / "offload.log", [], {"GGML_OP_OFFLOAD_MIN_BATCH": "1"})
    cpu, _m2, _l2 = _run(server, model, tmp_path / "cpu.log", [], {})

    assert m_cache.get("moe_cache_active") == 1, log_cache[-3000:]
    assert m_cache["moe_cache_slots"] == slots
    assert m_cache["moe_cache_tensors"] == n_tensors

    # exactly the GPU path without the cache
    assert cache["tokens"] == offload["tokens"]
    assert probs(cache) == probs(offload)

    # counters: every decode step looks up 8 experts in each of the tensors; the misses upload whole experts
    lookups, hits, misses = m_cache["moe_cache_lookups_total"], m_cache["moe_cache_hits_total"], m_cache["moe_cache_misses_total"]
    assert lookups == hits + misses
    assert lookups >= (N_PREDICT - 1) * 8 * n_tensors
    assert misses > slots * n_tensors          # more misses than the slots: evictions happened
    assert hits > 0
    # (the page prints 6 significant digits)
    assert m_cache["moe_cache_uploaded_bytes_total"] == pytest.approx(misses * expert_bytes, rel=1e-5)

    # the CPU computes the experts with other kernels: the same distribution within tolerance until greedy diverges
    same, worst = agreement(cache, cpu)
    assert worst < 0.02, (same, worst)
    print(f"cache vs offload: {len(cache['tokens'])} identical tokens; cache vs cpu: {same} identical tokens, "
          f"max |dp| {worst:.2e} before divergence; hit rate {hits / lookups:.3f}")


def test_misses_computed_on_the_cpu_agree_with_the_gpu_path(model, tmp_path):
    """--moe-cache-cpu-misses on a real GPU: rarely used experts are computed by the CPU kernels
    and written over the GPU's rows. Other kernels for those rows: the probabilities agree within the backends'
    usual tolerance until the first greedy divergence; fewer bytes are uploaded than misses."""
    server = server_path()
    expert_bytes, n_tensors = _expert_tensors(model)
    mib = _mib_for_slots(24, expert_bytes, n_tensors)
    env = {"GGML_OP_OFFLOAD_MIN_BATCH": "1"}
    cpu, m, log = _run(server, model, tmp_path / "cpu-misses.log",
                       ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4", "--moe-cache-cpu-misses"], env)
    offload, _m, _l = _run(server, model, tmp_path / "offload.log", [], env)
    assert m.get("moe_cache_active") == 1, log[-3000:]
    lookups, hits, misses, on_cpu = (m["moe_cache_lookups_total"], m["moe_cache_hits_total"],
                                     m["moe_cache_misses_total"], m["moe_cache_cpu_misses_total"])
    assert lookups == hits + misses and 0 < on_cpu < misses and hits > 0
    assert m["moe_cache_uploaded_bytes_total"] == pytest.approx((misses - on_cpu) * expert_bytes, rel=1e-5)
    same, worst = agreement(cpu, offload)
    assert worst < 0.02, (same, worst)
    print(f"cpu misses vs offload: {same} identical tokens, max |dp| {worst:.2e} before divergence; "
          f"{on_cpu:.0f} of {misses:.0f} misses on the CPU, hit rate {hits / lookups:.3f}")


def test_prompts_reading_the_slots_give_the_tokens_and_logits_of_the_uncached_gpu_path(model, tmp_path):
    """Two greedy completions in turn; the second prompt (16 tokens, through op offload) finds experts in the
    slots. In every --moe-cache-prefill mode: exactly the tokens and probabilities of the offload path without a
    cache (the same CUDA kernels on the same bytes, copied from another place); reading copies only the experts
    the slots did not hold; refreshing admits the first prompt's last experts."""
    server = server_path()
    expert_bytes, n_tensors = _expert_tensors(model)
    mib = _mib_for_slots(24, expert_bytes, n_tensors)
    # every batch on the GPU (decode too, without the cache): the same CUDA kernels in every run
    env = {"GGML_OP_OFFLOAD_MIN_BATCH": "1"}
    bodies = [{"n_predict": 64}, {"n_predict": 64, "prompt": PROMPT[::-1]}]

    def run(name: str, extra: list[str], more_env: dict[str, str] | None = None):
        return _run_in_turn(server, model, tmp_path / f"{name}.log", extra, {**env, **(more_env or {})}, bodies)

    plain, _log = run("offload", [])
    cache = ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4", "--moe-cache-prefill"]
    runs = {mode: run(mode, cache + [mode]) for mode in ("off", "read", "refresh")}
    # the slots' experts moved one copy each (0), the default's one device call per tensor, the host's experts
    # read by that call too (2) or copied by it in one batch (3): the same bytes in the same places
    for moves in ("0", "2", "3"):
        runs[f"refresh-moves{moves}"] = run(f"refresh-moves{moves}", cache + ["refresh"],
                                            {"LLAMA_MOE_CACHE_PREFILL_MOVES": moves})
    for mode, (answers, log) in runs.items():
        assert answers[-1][1].get("moe_cache_active") == 1, log[-3000:]
        for (got, _m), (want, _w) in zip(answers, plain):
            assert got["tokens"] == want["tokens"], mode
            assert probs(got) == probs(want), mode
    off, read, fresh = (runs[m][0][-1][1] for m in ("off", "read", "refresh"))
    assert off["moe_cache_prefill_hits_total"] == 0 < read["moe_cache_prefill_hits_total"]
    assert (read["moe_cache_prefill_copied_bytes_total"] + read["moe_cache_prefill_saved_bytes_total"]
            == pytest.approx(read["moe_cache_prefill_lookups_total"] * expert_bytes, rel=2e-5))   # 6 digits printed
    assert read["moe_cache_prefill_copied_bytes_total"] < off["moe_cache_prefill_copied_bytes_total"]
    assert fresh["moe_cache_prefill_admitted_total"] > 0
    for moves in ("0", "2", "3"):
        other = runs[f"refresh-moves{moves}"][0][-1][1]
        for k in ("prefill_hits", "prefill_admitted", "hits", "misses"):
            assert other[f"moe_cache_{k}_total"] == fresh[f"moe_cache_{k}_total"], (moves, k)
    print(f"second prompt read {read['moe_cache_prefill_hits_total']:.0f} of "
          f"{read['moe_cache_prefill_lookups_total']:.0f} expert copies from the slots; refresh admitted "
          f"{fresh['moe_cache_prefill_admitted_total']:.0f}; tokens identical to the uncached offload path, "
          "with the experts moved one copy each, in one call per tensor, read from host memory by the device, and "
          "copied from it in one batch")


def test_staged_prompts_give_the_tokens_and_logits_of_the_uncached_gpu_path(model, tmp_path):
    """Prompts of 256 tokens (every expert used by a batch) with their uncached experts copied ahead on a second
    stream into staging buffers (--moe-cache-prefill-ahead 1, 2, 3), with the slots read and refreshed or not:
    exactly the tokens and probabilities of the offload path without a cache. A buffer overwritten while a split
    reads it, a split reading before its copies land, or an expert missing from the staged copy changes them; the
    staged runs report their buffers and staged tensors on /metrics, the others none. With a minimum micro-batch
    above the prompts' length nothing is staged (the buffers are kept), at their length as without one."""
    server = server_path()
    expert_bytes, n_tensors = _expert_tensors(model)
    mib = _mib_for_slots(24, expert_bytes, n_tensors)
    env = {"GGML_OP_OFFLOAD_MIN_BATCH": "1"}
    long_prompt = (PROMPT * 16)[:256]
    bodies = [{"n_predict": 48, "prompt": long_prompt}, {"n_predict": 48, "prompt": long_prompt[::-1]},
              {"n_predict": 48, "prompt": long_prompt[3:] + PROMPT}]

    def run(name: str, extra: list[str], more_env: dict[str, str] | None = None):
        return _run_in_turn(server, model, tmp_path / f"{name}.log", extra, {**env, **(more_env or {})}, bodies)

    plain, _log = run("offload", [])
    cache = ["--moe-cache-mib", str(mib + 3 * -(-expert_bytes * 128 // 2**20)), "--moe-cache-max-batch", "4"]
    runs = {}
    for mode in ("refresh", "off"):
        runs[mode] = run(mode, cache + ["--moe-cache-prefill", mode])
        for ahead in ("1", "2", "3"):
            runs[f"{mode}-ahead{ahead}"] = run(f"{mode}-ahead{ahead}", cache + ["--moe-cache-prefill", mode,
                                                                               "--moe-cache-prefill-ahead", ahead])
    # a minimum micro-batch above the prompts' (--moe-cache-prefill-ahead-min-batch): the buffers are there, no
    # prompt is staged; at or below it, as without a minimum
    for least in ("8192", "32"):
        runs[f"min{least}"] = run(f"min{least}", cache + ["--moe-cache-prefill-ahead", "2",
                                                          "--moe-cache-prefill-ahead-min-batch", least])
    for name, (answers, log) in runs.items():
        assert answers[-1][1].get("moe_cache_active") == 1, log[-3000:]
        buffers = int(name[-1]) if name.endswith(("ahead1", "ahead2", "ahead3")) else 2 if name.startswith("min") \
            else 0
        staged = buffers > 0 and name != "min8192"
        metrics = answers[-1][1]
        assert metrics["moe_cache_prefill_stage_buffers"] == buffers, (name, log[-3000:])
        assert (metrics["moe_cache_prefill_staged_total"] > 0) == staged, name
        for (got, _m), (want, _w) in zip(answers, plain):
            assert got["tokens"] == want["tokens"], name
            assert probs(got) == probs(want), name
    # the same slots (the staging buffers are taken from the budget, so the unstaged runs are given the same
    # number of slots only approximately): the prompts read from the slots and admitted what the refresh says
    fresh = runs["refresh-ahead2"][0][-1][1]
    assert fresh["moe_cache_prefill_hits_total"] > 0 and fresh["moe_cache_prefill_admitted_total"] > 0
    off = runs["off-ahead2"][0][-1][1]
    assert off["moe_cache_prefill_hits_total"] == 0
    assert fresh["moe_cache_prefill_copied_bytes_total"] < off["moe_cache_prefill_copied_bytes_total"]
    print(f"staged prompts: read {fresh['moe_cache_prefill_hits_total']:.0f} of "
          f"{fresh['moe_cache_prefill_lookups_total']:.0f} expert copies from the slots, copied "
          f"{fresh['moe_cache_prefill_copied_bytes_total'] / 2**20:.0f} MiB ahead; tokens identical to the uncached "
          "offload path with 1, 2 and 3 buffers, slot reads on and off")


def test_uploads_ahead_of_need_give_the_tokens_and_logits_of_the_uncached_gpu_path(model, tmp_path):
    """--moe-cache-prefetch on a real GPU: the next layer's predicted experts are uploaded on a second CUDA
    stream while this layer computes, and the layer waits on an event before its slots are read. The same
    kernels read the same bytes: tokens and probabilities exactly those without the cache, so a race (a slot read
    before its upload landed, or overwritten while read) shows as a difference. Counters add up, and fewer misses
    than without uploads ahead of need."""
    server = server_path()
    from orchestrator.backend.detect import detect_backend

    if not detect_backend(server).has("expert_cache_prefetch"):
        pytest.skip("uploads ahead of need are in the lab's patch set (lab/llama.cpp-patches), not this build's series")
    expert_bytes, n_tensors = _expert_tensors(model)
    n_layers = n_tensors // 3
    mib = _mib_for_slots(24, expert_bytes, n_tensors)
    env = {"GGML_OP_OFFLOAD_MIN_BATCH": "1"}
    flags = ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4"]
    ahead, m, log = _run(server, model, tmp_path / "prefetch.log", [*flags, "--moe-cache-prefetch", "on"], env)
    base, mb, _lb = _run(server, model, tmp_path / "cache.log", flags, env)
    offload, _m, _l = _run(server, model, tmp_path / "offload.log", [], env)
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert ahead["tokens"] == offload["tokens"] and probs(ahead) == probs(offload)
    lookups, hits, misses = m["moe_cache_lookups_total"], m["moe_cache_hits_total"], m["moe_cache_misses_total"]
    assert lookups == hits + misses == mb["moe_cache_lookups_total"]
    predicted, correct = m["moe_cache_prefetch_predicted_total"], m["moe_cache_prefetch_correct_total"]
    uploads, useful = m["moe_cache_prefetch_uploads_total"], m["moe_cache_prefetch_useful_total"]
    # every decode step predicts one token's 8 experts for every layer after the first, in each of its 3 tensors
    steps, rest = divmod(predicted, 8 * 3 * (n_layers - 1))
    assert rest == 0 and N_PREDICT - 1 <= steps <= N_PREDICT, (predicted, n_layers)
    assert 0 < useful <= uploads <= predicted and useful <= correct <= predicted
    assert m["moe_cache_prefetch_uploaded_bytes_total"] == pytest.approx(uploads * expert_bytes, rel=1e-5)
    assert misses < mb["moe_cache_misses_total"]
    print(f"prefetch vs offload: {len(ahead['tokens'])} identical tokens; accuracy {correct / predicted:.3f}, "
          f"{uploads:.0f} uploaded ahead, {useful:.0f} used; misses {misses:.0f} against "
          f"{mb['moe_cache_misses_total']:.0f} without; hit rate {hits / lookups:.3f} against "
          f"{mb['moe_cache_hits_total'] / mb['moe_cache_lookups_total']:.3f}")


def test_slots_assigned_on_the_device_give_the_tokens_logits_and_counters_of_the_host_assignment(model, tmp_path):
    """--moe-cache-slots device on a real GPU: each layer's slots are assigned by a kernel from its ids, and
    its misses read from pinned host memory by another, with no wait for the host. The device keeps the host's
    least-recently-used list: the same tokens and probabilities as the uncached offload path, and exactly the host
    assignment's hits, misses and bytes. Two completions in turn: the second prompt (op offload, refresh mode)
    reads the device's table and writes it back, which must leave the counters equal too. /metrics says which
    assignment ran (llamacpp:moe_cache_device_slots). With memory-mapped weights the device cannot read the misses:
    the host assigns, with one warning."""
    server = server_path()
    expert_bytes, n_tensors = _expert_tensors(model)
    mib = _mib_for_slots(24, expert_bytes, n_tensors)
    env = {"GGML_OP_OFFLOAD_MIN_BATCH": "1"}
    # the device reads misses from pinned host memory: the weights loaded, not memory-mapped
    flags = ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4", "--load-mode", "none"]
    bodies = [{"n_predict": 128}, {"n_predict": 128, "prompt": PROMPT[::-1]}]
    dev, log_dev = _run_in_turn(server, model, tmp_path / "device.log", [*flags, "--moe-cache-slots", "device"],
                                env, bodies)
    mapped, log_mapped = _run_in_turn(server, model, tmp_path / "mapped.log",
                                      [*flags[:-2], "--moe-cache-slots", "device"], env, bodies[:1])
    host, log_host = _run_in_turn(server, model, tmp_path / "host.log", flags, env, bodies)
    waits, log_wait = _run_in_turn(server, model, tmp_path / "wait.log", flags,
                                   {**env, "LLAMA_MOE_CACHE_SPLIT_WAIT": "1"}, bodies)
    plain, _log = _run_in_turn(server, model, tmp_path / "offload.log", ["--load-mode", "none"], env, bodies)
    assert dev[-1][1].get("moe_cache_device_slots") == 1, log_dev[-3000:]
    assert host[-1][1].get("moe_cache_device_slots") == 0 == waits[-1][1].get("moe_cache_device_slots")
    assert mapped[-1][1].get("moe_cache_device_slots") == 0 and mapped[-1][1].get("moe_cache_active") == 1
    assert "slots assigned on the host: the device cannot read the experts' host memory" in log_mapped, \
        log_mapped[-3000:]
    assert mapped[0][0]["tokens"] == dev[0][0]["tokens"]
    for run in (dev, host, waits):
        for (got, _m), (want, _w) in zip(run, plain):
            assert got["tokens"] == want["tokens"]
            assert probs(got) == probs(want)
    md, mh, mw = dev[-1][1], host[-1][1], waits[-1][1]
    for key in ("lookups", "hits", "misses", "uploaded_bytes", "prefill_hits", "prefill_admitted"):
        assert md[f"moe_cache_{key}_total"] == mh[f"moe_cache_{key}_total"] == mw[f"moe_cache_{key}_total"], key
    assert mh["moe_cache_misses_total"] > 0 and mh["moe_cache_prefill_hits_total"] > 0
    print(f"device vs host assignment: {sum(len(a['tokens']) for a, _m in dev)} identical tokens; hits "
          f"{md['moe_cache_hits_total']:.0f}, misses {md['moe_cache_misses_total']:.0f} on both; the second prompt "
          f"read {md['moe_cache_prefill_hits_total']:.0f} experts from the slots on both")
