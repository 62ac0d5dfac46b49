"""The expert cache end to end without a GPU: ggml's RPC backend stands in for one.

llama.cpp's RPC backend presents a remote ggml backend as a GPU device; a ``ggml-rpc-server`` on 127.0.0.1 runs
the CPU backend behind it. With ``--rpc`` and every routed expert in host memory (``-ngl 999 --cpu-moe``) the
expert cache puts its slot banks on that device as it does on a real GPU: the scheduler reads the router's picks,
assigns slots (hits first, then the least recently used), uploads the missing experts into their slots and runs
the expert matmuls from the bank. Both paths compute with the same CPU kernels, which give every output element
from one dot product whatever the thread split, so the tokens and probabilities with the cache must equal those
without it exactly, and the counters must add up. The counters' hit rate must also be what the plan predicts from
the model's routing profile. Speed is the device's to show (docs/benchmarks.md); this is the scheduler
integration, in CI.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from orchestrator.model import synth
from tests.backend.expert_cache_support import N_PREDICT, PROMPT, completions_in_turn, one_completion, probs

pytestmark = pytest.mark.integration

SLOTS = 24              # of the model's 128 experts per tensor: decoding evicts all the time


@pytest.fixture(scope="module")
def rpc_server(llama_server_path) -> str:
    path = Path(llama_server_path).with_name("ggml-rpc-server")
    assert os.access(path, os.X_OK), (f"{path}: not built; orchestrator's build of llama.cpp includes ggml's RPC "
                                      "backend and its server (scripts/setup.sh runs it)")
    return str(path)


class Setup:
    def __init__(self, model: Path, info) -> None:
        experts = [t for t in info.tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps", t.name)]
        assert len({t.nbytes for t in experts}) == 1      # one slot size for every tensor
        self.model = model
        self.n_expert = experts[0].shape[-1]
        self.expert_bytes = experts[0].nbytes // self.n_expert
        self.n_tensors = len(experts)
        self.n_used = info.metadata["qwen3moe.expert_used_count"]
        self.mib = -(-SLOTS * self.expert_bytes * self.n_tensors // 2**20)   # the least whole MiB for SLOTS slots
        self.slots = self.mib * 2**20 // (self.expert_bytes * self.n_tensors)  # what the cache makes of it


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    from orchestrator.model.reader import read_gguf

    path = synth.write_model(tmp_path_factory.mktemp("rpc") / "m.gguf", "qwen3-30b-a3b", scale=0.125, quant="q4_0",
                             seed=21).path
    s = Setup(path, read_gguf(path))
    assert SLOTS <= s.slots < s.n_expert // 2             # of every tensor, all tensors alike
    return s


@pytest.fixture(scope="module")
def plain(setup, llama_server_path, rpc_server, tmp_path_factory):
    """The same server without the cache: the experts are computed on the CPU from host memory."""
    out, metrics, _ = one_completion(llama_server_path, rpc_server, setup.model, tmp_path_factory.mktemp("plain"),
                                     "plain", [])
    assert not metrics.get("moe_cache_active")             # (no cache asked: no cache lines)
    return out


@pytest.fixture(scope="module")
def uploads(setup, llama_server_path, rpc_server, tmp_path_factory):
    """The cache as upstream has it: every miss is uploaded."""
    return one_completion(llama_server_path, rpc_server, setup.model, tmp_path_factory.mktemp("cache"), "cache",
                          ["--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4"])


def test_cache_on_an_rpc_device_gives_the_tokens_and_probabilities_of_no_cache(setup, plain, uploads):
    cache, m, log = uploads
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert m["moe_cache_slots"] == setup.slots and m["moe_cache_tensors"] == setup.n_tensors

    assert len(cache["tokens"]) == N_PREDICT
    assert cache["tokens"] == plain["tokens"]
    assert probs(cache) == probs(plain)

    # every decode step looks up the token's experts in each tensor (the 16-token prompt is above the cache's
    # batches and takes the usual path); each miss uploads one whole expert
    lookups, hits, misses = m["moe_cache_lookups_total"], m["moe_cache_hits_total"], m["moe_cache_misses_total"]
    assert lookups == hits + misses
    assert lookups >= (N_PREDICT - 1) * setup.n_used * setup.n_tensors
    assert misses > setup.slots * setup.n_tensors and hits > 0      # slots were reused, and evicted
    assert m["moe_cache_cpu_misses_total"] == 0
    assert m["moe_cache_uploaded_bytes_total"] == pytest.approx(misses * setup.expert_bytes, rel=1e-5)


def test_slots_asked_on_a_device_that_cannot_assign_them_are_assigned_by_the_host(setup, plain, uploads,
                                                                                  llama_server_path, rpc_server,
                                                                                  tmp_path):
    """--moe-cache-slots device where the device does not export the assignment (the RPC backend; CUDA does): one
    warning, the host's assignment, and exactly its tokens, probabilities and counters; /metrics says the host
    assigns (llamacpp:moe_cache_device_slots 0)."""
    flags = ["--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4", "--moe-cache-slots", "device"]
    out, m, log = one_completion(llama_server_path, rpc_server, setup.model, tmp_path, "device-slots", flags)
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert m["moe_cache_device_slots"] == 0
    assert "slots assigned on the host: the device cannot assign them" in log, log[-3000:]
    assert out["tokens"] == plain["tokens"] and probs(out) == probs(plain)
    for key in ("lookups", "hits", "misses", "uploaded_bytes"):
        assert m[f"moe_cache_{key}_total"] == uploads[1][f"moe_cache_{key}_total"], key


def test_an_unknown_slot_assignment_is_refused_with_one_line(llama_server_path, setup, tmp_path):
    import subprocess

    r = subprocess.run([llama_server_path, "-m", str(setup.model), "--moe-cache-mib", "64", "--moe-cache-slots",
                        "gpu", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--moe-cache-slots must be host or device" in r.stderr + r.stdout


def test_misses_computed_on_the_cpu_give_the_same_tokens_and_upload_less(setup, plain, uploads, llama_server_path,
                                                                        rpc_server, tmp_path):
    """--moe-cache-cpu-misses: an expert missing from the slots that was not used recently enough to stay in an
    LRU of the slots' size is computed on the CPU (its row written over the device's), not uploaded. The CPU's
    rows come from llama.cpp's own CPU kernel: the tokens and probabilities stay exactly those without a cache."""
    flags = ["--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4", "--moe-cache-cpu-misses"]
    out, m, log = one_completion(llama_server_path, rpc_server, setup.model, tmp_path, "cpu-misses", flags)
    assert m.get("moe_cache_active") == 1, log[-3000:]

    assert out["tokens"] == plain["tokens"]
    assert probs(out) == probs(plain)

    lookups, hits, misses, cpu = (m["moe_cache_lookups_total"], m["moe_cache_hits_total"],
                                  m["moe_cache_misses_total"], m["moe_cache_cpu_misses_total"])
    assert lookups == hits + misses
    assert lookups >= (N_PREDICT - 1) * setup.n_used * setup.n_tensors
    assert 0 < cpu < misses                              # some computed on the CPU, some reused soon and uploaded
    uploaded = m["moe_cache_uploaded_bytes_total"]
    assert uploaded == pytest.approx((misses - cpu) * setup.expert_bytes, rel=1e-5)
    assert hits > 0 and uploaded < uploads[1]["moe_cache_uploaded_bytes_total"]
    print(f"cpu misses: {cpu:.0f} of {misses:.0f} misses ({lookups:.0f} lookups, {hits:.0f} hits); uploaded "
          f"{uploaded / 2**20:.1f} MiB against {uploads[1]['moe_cache_uploaded_bytes_total'] / 2**20:.1f} MiB "
          f"uploading every miss ({uploads[1]['moe_cache_hits_total']:.0f} hits)")


@pytest.mark.parametrize("locality", [None, 0.0], ids=["default-locality", "no-locality"])
def test_the_cache_hits_as_the_routing_profile_predicts(llama_server_path, rpc_server, tmp_path, locality):
    """The plan predicts the cache's hit rate from the model's routing profile (a decode-order trace through
    llama.cpp, orchestrator.model.routing). Here the cache's own counters, over a sampled generation, must agree
    with that prediction within 5 points: about 0.9 with the default routing locality, about the slot fraction
    (0.24) when every token routes independently."""
    from orchestrator.model import routing
    from orchestrator.model import routing_profile as R
    from orchestrator.model.reader import read_gguf

    res = synth.write_model(tmp_path / "demo.gguf", "qwen3-30b-a3b", scale=0.125, quant="q8_0", seed=11,
                            locality=locality, fsync=False)
    curve = R.profile(routing.trace(res.path, tokens=512, sample=1.0, seed=3, threads=2)).curve("lru-layer")
    info = read_gguf(res.path)
    experts = [t for t in info.tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps", t.name)]
    n_expert = experts[0].shape[-1]
    expert_bytes = experts[0].nbytes // n_expert
    mib = int(0.25 * n_expert) * expert_bytes * len(experts) // 2**20        # about a quarter of the experts
    slots = mib * 2**20 // (expert_bytes * len(experts))
    predicted = R.hit_rate(curve, slots / n_expert)
    out, m, log = one_completion(llama_server_path, rpc_server, res.path, tmp_path, "sampled",
                                 ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4"],
                                 sampling={"n_predict": 384, "temperature": 1.0, "seed": 7, "n_probs": 0})
    assert m.get("moe_cache_active") == 1 and m["moe_cache_slots"] == slots, log[-3000:]
    assert len(set(out["tokens"])) > 300                                     # a stream that does not loop
    measured = m["moe_cache_hits_total"] / m["moe_cache_lookups_total"]
    assert measured == pytest.approx(predicted, abs=0.05), (slots, measured, predicted)
    # with CPU-computed misses: the hits and the re-used misses uploaded, as the patch's rule replayed on the trace
    _o, c, log = one_completion(llama_server_path, rpc_server, res.path, tmp_path, "sampled-cpu",
                                ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4", "--moe-cache-cpu-misses"],
                                sampling={"n_predict": 384, "temperature": 1.0, "seed": 7, "n_probs": 0})
    n = c["moe_cache_lookups_total"]
    cpu_hit, cpu_up = c["moe_cache_hits_total"] / n, (c["moe_cache_misses_total"] - c["moe_cache_cpu_misses_total"]) / n
    want_hit, want_up = curve.cpu_misses.at(slots / n_expert)
    assert cpu_hit == pytest.approx(want_hit, abs=0.05) and cpu_up == pytest.approx(want_up, abs=0.05), \
        (cpu_hit, want_hit, cpu_up, want_up)
    print(f"locality {locality}: {slots} of {n_expert} slots: hit rate {measured:.3f} measured, {predicted:.3f} "
          f"predicted; CPU misses: hits {cpu_hit:.3f} / {want_hit:.3f}, uploads {cpu_up:.3f} / {want_up:.3f}")


def test_cpu_misses_in_a_batch_of_several_tokens(setup, llama_server_path, rpc_server, tmp_path):
    """A 3-token prompt is one batch within the cache's 4: it runs through the cache with an empty cache, so
    every expert it picks is a first use, computed on the CPU, row by row of each token. Then decode. The same
    tokens and probabilities as without the cache."""
    prompt = {"prompt": PROMPT[:3]}
    plain, _m, _l = one_completion(llama_server_path, rpc_server, setup.model, tmp_path, "plain3", [], sampling=prompt)
    flags = ["--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4", "--moe-cache-cpu-misses"]
    out, m, log = one_completion(llama_server_path, rpc_server, setup.model, tmp_path, "cpu3", flags, sampling=prompt)
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert out["tokens"] == plain["tokens"] and probs(out) == probs(plain)
    # the prompt's lookups too: its distinct experts per tensor, beyond one token's
    assert m["moe_cache_lookups_total"] > N_PREDICT * setup.n_used * setup.n_tensors
    assert m["moe_cache_cpu_misses_total"] > 0


# Prompts through op offload: with GGML_OP_OFFLOAD_MIN_BATCH set, the RPC device takes batches of at least that many
# tokens as a local GPU does, copying the host-resident experts they use into its compute buffer. The 16-token
# prompts do; decode (one token) stays on the cache path.
PREFILL_ENV = {"GGML_OP_OFFLOAD_MIN_BATCH": "8"}
SECOND = {"prompt": PROMPT[::-1]}


@pytest.fixture(scope="module")
def prefill_runs(setup, llama_server_path, rpc_server, tmp_path_factory):
    """Two completions in turn (PROMPT, then another prompt) on one server, without a cache and with each
    --moe-cache-prefill mode."""
    runs = {}
    for mode in ("none", "off", "read", "refresh"):
        extra = [] if mode == "none" else ["--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4",
                                           "--moe-cache-prefill", mode]
        runs[mode] = completions_in_turn(llama_server_path, rpc_server, setup.model,
                                         tmp_path_factory.mktemp(f"prefill-{mode}"), mode, extra, [{}, SECOND],
                                         env=PREFILL_ENV)
    return runs


def test_prompts_on_the_device_give_the_tokens_of_no_cache_in_every_prefill_mode(setup, plain, prefill_runs):
    none, _log = prefill_runs["none"]
    assert none[0][0]["tokens"] == plain["tokens"]       # op offload onto the RPC device computes what the CPU does
    for mode in ("off", "read", "refresh"):
        answers, log = prefill_runs[mode]
        assert answers[-1][1].get("moe_cache_active") == 1, log[-3000:]
        for (got, _m), (want, _w) in zip(answers, none):
            assert got["tokens"] == want["tokens"], mode
            assert probs(got) == probs(want), mode


def test_a_prompt_reads_the_experts_the_slots_hold_instead_of_copying_them(setup, prefill_runs):
    expert = setup.expert_bytes
    (_a1, off1), (_a2, off2) = prefill_runs["off"][0]
    (_r1, read1), (_r2, read2) = prefill_runs["read"][0]
    # both prompts ran on the device: every expert they used was copied from host memory when the mode is off
    assert off1["moe_cache_prefill_lookups_total"] > 0, "the prompts did not run through op offload"
    assert off2["moe_cache_prefill_hits_total"] == 0
    # (the page prints 6 significant digits)
    assert off2["moe_cache_prefill_copied_bytes_total"] == pytest.approx(off2["moe_cache_prefill_lookups_total"] * expert,
                                                                         rel=1e-5)
    # the second prompt finds what decoding the first left in the slots
    hits = read2["moe_cache_prefill_hits_total"]
    assert hits > read1["moe_cache_prefill_hits_total"] >= 0
    assert read2["moe_cache_prefill_saved_bytes_total"] == pytest.approx(hits * expert, rel=1e-5)
    assert (read2["moe_cache_prefill_copied_bytes_total"] + read2["moe_cache_prefill_saved_bytes_total"]
            == pytest.approx(read2["moe_cache_prefill_lookups_total"] * expert, rel=2e-5))
    assert read2["moe_cache_prefill_lookups_total"] == off2["moe_cache_prefill_lookups_total"]
    assert read2["moe_cache_prefill_copied_bytes_total"] < off2["moe_cache_prefill_copied_bytes_total"]
    # reading the slots leaves them as they were: decode hits exactly as with the mode off
    for k in ("moe_cache_lookups_total", "moe_cache_hits_total", "moe_cache_uploaded_bytes_total"):
        assert read2[k] == off2[k], k
    assert read2["moe_cache_prefill_admitted_total"] == 0
    print(f"second prompt: {hits:.0f} of {read2['moe_cache_prefill_lookups_total']:.0f} expert copies read from the "
          f"slots; copied {read2['moe_cache_prefill_copied_bytes_total'] / 2**20:.1f} MiB instead of "
          f"{off2['moe_cache_prefill_copied_bytes_total'] / 2**20:.1f} MiB")


# A prompt of several micro-batches (-b larger than -ub): llama.cpp's last layer keeps only the tokens that give
# logits, so in every micro-batch before the prompt's last one its routed matmuls see a batch of no tokens, which is
# within the cache's batch cap and reaches the cache. On CUDA with the slots assigned on the device such a batch
# once launched a copy of zero blocks (a launch error); the RPC device has no device assignment (the host assigns,
# with one warning), so here it is the host's path that must pass such batches through.
MICRO = ["-b", "64", "-ub", "16"]


def test_a_prompt_of_several_micro_batches_gives_the_tokens_of_no_cache(setup, llama_server_path, rpc_server,
                                                                         tmp_path):
    bodies = [{"prompt": PROMPT * 4}]                     # 64 tokens: four micro-batches, logits in the last only
    none, _ = completions_in_turn(llama_server_path, rpc_server, setup.model, tmp_path, "micro-none", MICRO, bodies,
                                  env=PREFILL_ENV)
    flags = [*MICRO, "--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4", "--moe-cache-prefill",
             "refresh", "--moe-cache-slots", "device"]
    cached, log = completions_in_turn(llama_server_path, rpc_server, setup.model, tmp_path, "micro-cache", flags,
                                      bodies, env=PREFILL_ENV)
    (got, m), = cached
    (want, _w), = none
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert m["moe_cache_prefill_lookups_total"] > 0, "the micro-batches did not run through op offload"
    assert len(got["tokens"]) == N_PREDICT
    assert got["tokens"] == want["tokens"] and probs(got) == probs(want)


# Prompts staged (--moe-cache-prefill-ahead): a staged split reads its weight's copy from a staging buffer by address,
# outside the compute buffer the tensor belongs to. CUDA, which moves experts itself, serves that; ggml's RPC device
# checks every tensor's data against its buffer, so llama-server stages nothing there and keeps the cache's whole
# budget for slots. Long prompts (from 43 tokens with 8 of 128 experts) would be staged on a device that can.
LONG = [{"prompt": PROMPT * 6}, {"prompt": PROMPT[::-1] * 6}]


def test_staging_asked_on_the_rpc_device_keeps_the_read_path_and_its_slots(setup, llama_server_path, rpc_server,
                                                                           tmp_path):
    """The same long prompts with --moe-cache-prefill-ahead 2 and without: no buffers, nothing staged, the same
    tokens and probabilities, and the same slot reads and copies (the budget went to slots, none to buffers)."""
    cache = ["--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4", "--moe-cache-prefill", "read"]
    read, _log = completions_in_turn(llama_server_path, rpc_server, setup.model, tmp_path, "read", cache, LONG,
                                     env=PREFILL_ENV)
    # with a smallest staged micro-batch too (set before the first graph, as the context applies the cache)
    asked, log = completions_in_turn(llama_server_path, rpc_server, setup.model, tmp_path, "ahead",
                                     cache + ["--moe-cache-prefill-ahead", "2", "--moe-cache-prefill-ahead-min-batch",
                                              "32"], LONG, env=PREFILL_ENV)
    assert "micro-batches from 32 tokens" not in log      # no buffers here, so nothing is staged from any size
    metrics = asked[-1][1]
    assert metrics.get("moe_cache_active") == 1, log[-3000:]
    assert metrics["moe_cache_slots"] == setup.slots
    assert metrics["moe_cache_prefill_stage_buffers"] == 0 and metrics["moe_cache_prefill_staged_total"] == 0
    assert read[-1][1]["moe_cache_prefill_hits_total"] > 0          # the second prompt read the first's experts
    for (got, m), (want, w) in zip(asked, read):
        assert got["tokens"] == want["tokens"] and probs(got) == probs(want)
        for key in ("moe_cache_prefill_lookups_total", "moe_cache_prefill_hits_total",
                    "moe_cache_prefill_copied_bytes_total"):
            assert m[key] == w[key], key


def test_a_refreshing_prompt_leaves_its_last_experts_in_the_slots_for_decode(setup, prefill_runs):
    (_r1, read1), _ = prefill_runs["read"][0]
    (_f1, fresh1), (_f2, fresh2) = prefill_runs["refresh"][0]
    admitted = fresh1["moe_cache_prefill_admitted_total"]
    # an empty cache takes the experts of the prompt's last tokens (up to as many as the slots hold), each once at
    # least: the last token's picks in every tensor among them
    assert setup.n_used * setup.n_tensors <= admitted <= fresh1["moe_cache_prefill_lookups_total"]
    assert fresh1["moe_cache_hits_total"] > read1["moe_cache_hits_total"]    # the first tokens after it hit
    assert fresh2["moe_cache_prefill_hits_total"] > 0
    print(f"after the first prompt: decode hits {fresh1['moe_cache_hits_total']:.0f} refreshed against "
          f"{read1['moe_cache_hits_total']:.0f} read-only, of {fresh1['moe_cache_lookups_total']:.0f} lookups")


def test_fit_leaves_room_for_the_cache_and_serves(setup, llama_server_path, rpc_server, tmp_path):
    """--fit on with --moe-cache-mib: the slots are allocated after --fit placed the model, so --fit fits the model
    around them (its target grows by the cache on every device), and the server serves with the cache."""
    flags = ["--fit", "on", "--moe-cache-mib", str(setup.mib), "--moe-cache-max-batch", "4"]
    answers, log = completions_in_turn(llama_server_path, rpc_server, setup.model, tmp_path, "fit", flags, [{}])
    assert f"fitting with {setup.mib} MiB more free per device for the expert cache" in log, log[-3000:]
    (out, m), = answers
    assert m.get("moe_cache_active") == 1 and len(out["tokens"]) == N_PREDICT
