"""The expert cache on the other model families, without a GPU: a generated DeepSeek-V3 shape (deepseek2: MLA,
dense leading layer, shared expert, grouped sigmoid routing, 256 experts) and a gpt-oss-20b shape (MXFP4 experts
with biases, attention sinks, sliding window) on ggml's RPC device, as tests/backend/test_expert_cache_rpc.py
runs the Qwen3 shape (its module docstring says why the tokens and probabilities must be equal exactly).

One server per family without a cache and two with it, each answering two prompts in turn through op offload
(GGML_OP_OFFLOAD_MIN_BATCH) and generating after each:
- prompts that read the slots (``--moe-cache-prefill read``), asked with prompt staging
  (``--moe-cache-prefill-ahead 2``) and the device's slot assignment (``--moe-cache-slots device``): the RPC
  device has neither (staging needs the CUDA move call, the assignment its kernel), so the documented fallbacks
  hold: no staging buffers, nothing staged, the slots assigned on the host with one warning;
- prompts that refresh the slots (``--moe-cache-prefill refresh``);
- gpt-oss as the plan runs it with a cache: only the experts' weights in host memory (the plan's ``-ot ...\\.weight``),
  their biases on the device with the rest of the layer, so each bias's ADD_ID runs there.
Every answer's tokens and probabilities equal the server's without a cache; the counters add up.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.model import synth
from orchestrator.plan.placement import cpu_expert_override
from tests.backend.expert_cache_support import N_PREDICT, completions_in_turn, probs
from tests.backend.test_expert_cache_rpc import PREFILL_ENV, SECOND, rpc_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

# (shape, scale, layers, slots per expert tensor): small, and a cache that holds less than half of the experts
FAMILIES = {
    "deepseek-v3": ("deepseek-v3", 0.05, 3, 48),
    "gpt-oss-20b": ("gpt-oss-20b", 0.1, 2, 8),
}


class Family:
    def __init__(self, like: str, model: Path, info, slots: int) -> None:
        experts = [t for t in info.tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps\.weight$", t.name)]
        assert len({t.nbytes for t in experts}) == 1      # one slot size for every tensor
        self.like, self.model = like, model
        self.arch = info.metadata["general.architecture"]
        self.n_expert = experts[0].shape[-1]
        self.expert_bytes = experts[0].nbytes // self.n_expert
        self.n_tensors = len(experts)
        self.n_used = info.metadata[f"{self.arch}.expert_used_count"]
        self.has_biases = any(t.name.endswith("_exps.bias") for t in info.tensors)
        self.mib = -(-slots * self.expert_bytes * self.n_tensors // 2**20)
        self.slots = self.mib * 2**20 // (self.expert_bytes * self.n_tensors)
        assert slots <= self.slots < self.n_expert // 2, (like, self.slots)

    def cache(self, *more: str) -> list[str]:
        return ["--moe-cache-mib", str(self.mib), "--moe-cache-max-batch", "4", *more]


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(request, llama_server_path, rpc_server, tmp_path_factory):  # noqa: F811 (rpc_server is the fixture)
    from orchestrator.model.reader import read_gguf

    like, scale, layers, slots = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(like)
    path = synth.write_model(tmp / f"{like}.gguf", like, scale=scale, layers=layers, quant="q4_0", seed=4,
                             fsync=False).path
    fam = Family(like, path, read_gguf(path), slots)
    bodies = [{}, SECOND]
    out = {"none": completions_in_turn(llama_server_path, rpc_server, path, tmp, "none", [], bodies,
                                       env=PREFILL_ENV)}
    out["read"] = completions_in_turn(llama_server_path, rpc_server, path, tmp, "read",
                                      fam.cache("--moe-cache-prefill", "read", "--moe-cache-prefill-ahead", "2",
                                                "--moe-cache-slots", "device"), bodies, env=PREFILL_ENV)
    out["refresh"] = completions_in_turn(llama_server_path, rpc_server, path, tmp, "refresh",
                                         fam.cache("--moe-cache-prefill", "refresh"), bodies, env=PREFILL_ENV)
    if fam.has_biases:
        (pattern, buft), = cpu_expert_override(range(layers), weights_only=True)
        out["biases"] = completions_in_turn(llama_server_path, rpc_server, path, tmp, "biases",
                                            fam.cache("--moe-cache-prefill", "read"), bodies, env=PREFILL_ENV,
                                            experts=("-ot", f"{pattern}={buft}"))
    return fam, out


def test_the_cache_gives_the_tokens_and_probabilities_of_no_cache(runs):
    fam, out = runs
    none, _ = out["none"]
    assert none[0][1].get("moe_cache_active") is None or not none[0][1].get("moe_cache_active")
    for mode in [m for m in out if m != "none"]:
        answers, log = out[mode]
        assert answers[-1][1].get("moe_cache_active") == 1, log[-3000:]
        for (got, _m), (want, _w) in zip(answers, none):
            assert len(got["tokens"]) == N_PREDICT
            assert got["tokens"] == want["tokens"], (fam.like, mode)
            assert probs(got) == probs(want), (fam.like, mode)


def test_counters_add_up_in_decode_and_in_prompts(runs):
    fam, out = runs
    answers, _log = out["read"]
    (_a1, m1), (_a2, m2) = answers
    assert m2["moe_cache_slots"] == fam.slots and m2["moe_cache_tensors"] == fam.n_tensors
    # decode: every generated token looks its experts up in each tensor; each miss uploads one whole expert
    lookups, hits, misses = m2["moe_cache_lookups_total"], m2["moe_cache_hits_total"], m2["moe_cache_misses_total"]
    assert lookups == hits + misses
    assert lookups >= 2 * (N_PREDICT - 1) * fam.n_used * fam.n_tensors
    assert hits > 0 and misses > fam.slots * fam.n_tensors
    assert m2["moe_cache_uploaded_bytes_total"] == pytest.approx(misses * fam.expert_bytes, rel=1e-5)
    # prompts through op offload: each expert a prompt uses is read from a slot or copied from host memory
    assert m1["moe_cache_prefill_lookups_total"] > 0, "the prompts did not run through op offload"
    p_hits = m2["moe_cache_prefill_hits_total"]
    assert p_hits > m1["moe_cache_prefill_hits_total"] >= 0       # the second prompt reads what decode left
    assert m2["moe_cache_prefill_saved_bytes_total"] == pytest.approx(p_hits * fam.expert_bytes, rel=1e-5)
    assert (m2["moe_cache_prefill_copied_bytes_total"] + m2["moe_cache_prefill_saved_bytes_total"]
            == pytest.approx(m2["moe_cache_prefill_lookups_total"] * fam.expert_bytes, rel=2e-5))
    assert m2["moe_cache_prefill_admitted_total"] == 0               # reading leaves the slots as they were
    # refresh: the first prompt's last experts go into the empty slots, each at least once
    (_f1, f1), (_f2, f2) = out["refresh"][0]
    assert fam.n_used * fam.n_tensors <= f1["moe_cache_prefill_admitted_total"] <= f1["moe_cache_prefill_lookups_total"]
    assert f1["moe_cache_hits_total"] > m1["moe_cache_hits_total"]   # the first tokens after it hit
    print(f"{fam.like}: {fam.slots} of {fam.n_expert} slots, decode {hits:.0f}/{lookups:.0f} hits; second prompt "
          f"{p_hits:.0f} of {m2['moe_cache_prefill_lookups_total']:.0f} expert reads from the slots")


def test_staging_and_device_slots_fall_back_on_the_rpc_device(runs):
    """Asked where the device cannot: no staging buffers and nothing staged (the budget stays with the slots);
    the slots assigned on the host, said once, and /metrics says so."""
    fam, out = runs
    answers, log = out["read"]
    m = answers[-1][1]
    assert m["moe_cache_prefill_stage_buffers"] == 0 and m["moe_cache_prefill_staged_total"] == 0
    assert m["moe_cache_slots"] == fam.slots
    assert m["moe_cache_device_slots"] == 0
    assert log.count("slots assigned on the host: the device cannot assign them") == 1, log[-3000:]


def test_gpt_oss_biases_stay_on_the_device_as_the_plan_places_them(runs):
    """The plan's -ot for a cached gpt-oss layer moves the experts' weights to host memory and nothing else: the
    cache serves every weight tensor (as many banks as with --cpu-moe), and the biases' ADD_IDs run on the device."""
    fam, out = runs
    if not fam.has_biases:
        pytest.skip(f"{fam.like} has no expert biases")
    (_a1, m1), (_a2, m2) = out["biases"][0]
    (_r1, r1), (_r2, r2) = out["read"][0]
    assert m2["moe_cache_tensors"] == r2["moe_cache_tensors"] == fam.n_tensors
    assert m2["moe_cache_lookups_total"] == r2["moe_cache_lookups_total"]
    assert m2["moe_cache_hits_total"] == r2["moe_cache_hits_total"]
