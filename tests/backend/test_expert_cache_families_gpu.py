"""The expert cache on a GPU for the other model families: a generated DeepSeek-V3 shape (deepseek2: MLA attention,
shared expert, grouped sigmoid routing, 256 experts; CUDA's MLA kernels) and a gpt-oss-120b shape (MXFP4 experts
with biases added by ADD_ID, attention sinks, sliding window; CUDA's MXFP4 kernels).

Needs an NVIDIA GPU and a CUDA llama-server built with our patch series ($LLAMA_SERVER, else the suite's); on the
device it runs without the suite's conftest (`pytest --noconftest -m gpu
tests/backend/test_expert_cache_families_gpu.py`, or `bash lab/device/run.sh gpu-tests-families`); in CI it is
skipped (no GPU). As in tests/backend/test_expert_cache_gpu.py, every routed expert is in host memory
(`-ngl 999 --cpu-moe`), the weights loaded (`--load-mode none`) and every batch takes the offload path
(GGML_OP_OFFLOAD_MIN_BATCH=1): the cache's runs and the uncached one read the same expert bytes with the same CUDA
kernels, only from another place, so tokens and probabilities must be equal exactly. Per family, two prompts of 256
tokens in turn, 64 tokens generated after each:
- the uncached offload path;
- the cache with its slots assigned on the host, and on the device (the assignment kernel): the same tokens and
  probabilities, and exactly the same counters;
- the cache refreshing its slots from the prompts, which it stages ahead into two buffers
  (--moe-cache-prefill-ahead 2, the CUDA move call): the same tokens and probabilities, staging reported.
And gpt-oss as the plan runs it with a cache: only the experts' weights in host memory (the plan's `-ot ...\\.weight`),
their biases on the GPU, so each ADD_ID runs there: the same tokens and probabilities, the same counters.
And per family a prompt of 4096 tokens in micro-batches of 512 (-b 2048 -ub 512), with the slots assigned on the
device: the micro-batches before the last give no logits, so the last layer's routed matmuls see batches of no
tokens, which reach the cache (they are within its batch cap); the same tokens and probabilities as the uncached
path with the same batches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.model import synth
from tests.backend.expert_cache_support import PROMPT, probs, server_path
from tests.backend.test_expert_cache_gpu import _run_in_turn

pytestmark = pytest.mark.gpu

# (shape, scale, layers, slots per expert tensor): a cache that holds less than a fifth of the experts
FAMILIES = {
    "deepseek-v3": ("deepseek-v3", 0.1, 4, 48),
    "gpt-oss-120b": ("gpt-oss-120b", 0.25, 4, 24),
}
ENV = {"GGML_OP_OFFLOAD_MIN_BATCH": "1"}
LONG = (PROMPT * 16)[:256]
BODIES = [{"n_predict": 64, "prompt": LONG}, {"n_predict": 64, "prompt": LONG[::-1]}]


def _experts(model: Path) -> tuple[int, int, int]:
    """(bytes of one expert of one routed expert tensor, experts per tensor, how many such tensors)."""
    from orchestrator.model.reader import read_gguf

    experts = [t for t in read_gguf(model).tensors if re.match(r"blk\.\d+\.ffn_(up|gate|down)_exps\.weight$", t.name)]
    assert len({t.nbytes for t in experts}) == 1
    return experts[0].nbytes // experts[0].shape[-1], experts[0].shape[-1], len(experts)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    like, scale, layers, slots = FAMILIES[request.param]
    path = synth.write_model(tmp_path_factory.mktemp(like) / f"{like}.gguf", like, scale=scale, layers=layers,
                             seed=21, fsync=False).path
    expert_bytes, n_expert, n_tensors = _experts(path)
    mib = -(-slots * expert_bytes * n_tensors // 2**20)
    plain = _run_in_turn(server_path(), path, tmp_path_factory.mktemp(f"{like}-plain") / "offload.log",
                         ["--load-mode", "none"], ENV, BODIES)
    return like, path, expert_bytes, n_expert, n_tensors, slots, mib, plain


def _same(run, plain, what: str) -> None:
    for (got, _m), (want, _w) in zip(run, plain):
        assert len(got["tokens"]) == 64
        assert got["tokens"] == want["tokens"], what
        assert probs(got) == probs(want), what


def test_slots_assigned_on_the_device_and_the_host_give_the_tokens_of_the_uncached_gpu_path(family, tmp_path):
    like, path, expert_bytes, _n, n_tensors, slots, mib, (plain, _log) = family
    flags = ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4", "--load-mode", "none",
             "--moe-cache-prefill", "refresh"]
    host, log_host = _run_in_turn(server_path(), path, tmp_path / "host.log", [*flags, "--moe-cache-slots", "host"],
                                  ENV, BODIES)
    dev, log_dev = _run_in_turn(server_path(), path, tmp_path / "device.log", [*flags, "--moe-cache-slots", "device"],
                                ENV, BODIES)
    mh, md = host[-1][1], dev[-1][1]
    assert mh.get("moe_cache_active") == 1 and mh.get("moe_cache_device_slots") == 0, log_host[-3000:]
    assert md.get("moe_cache_device_slots") == 1, log_dev[-3000:]
    assert mh["moe_cache_slots"] >= slots and mh["moe_cache_tensors"] == n_tensors
    _same(host, plain, f"{like}, host assignment")
    _same(dev, plain, f"{like}, device assignment")
    for key in ("lookups", "hits", "misses", "uploaded_bytes", "prefill_hits", "prefill_admitted"):
        assert md[f"moe_cache_{key}_total"] == mh[f"moe_cache_{key}_total"], key
    lookups, hits, misses = mh["moe_cache_lookups_total"], mh["moe_cache_hits_total"], mh["moe_cache_misses_total"]
    assert lookups == hits + misses and hits > 0 and misses > 0
    assert mh["moe_cache_uploaded_bytes_total"] == pytest.approx(misses * expert_bytes, rel=1e-5)
    assert mh["moe_cache_prefill_hits_total"] > 0
    print(f"{like}: device and host assignment, {sum(len(a['tokens']) for a, _m in dev)} tokens identical to the "
          f"uncached path; decode hit rate {hits / lookups:.3f}; the second prompt read "
          f"{mh['moe_cache_prefill_hits_total']:.0f} experts from the slots")


def test_staged_prompts_give_the_tokens_of_the_uncached_gpu_path(family, tmp_path):
    like, path, expert_bytes, n_expert, _t, _slots, mib, (plain, _log) = family
    buffers = 2
    budget = mib + (buffers + 1) * -(-expert_bytes * n_expert // 2**20)     # the slots, and room for the buffers
    staged, log = _run_in_turn(server_path(), path, tmp_path / "staged.log",
                               ["--moe-cache-mib", str(budget), "--moe-cache-max-batch", "4", "--load-mode", "none",
                                "--moe-cache-prefill", "refresh", "--moe-cache-prefill-ahead", str(buffers)],
                               ENV, BODIES)
    m = staged[-1][1]
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert m["moe_cache_prefill_stage_buffers"] == buffers, log[-3000:]
    assert m["moe_cache_prefill_staged_total"] > 0
    _same(staged, plain, f"{like}, staged prompts")
    print(f"{like}: prompts staged into {buffers} buffers ({m['moe_cache_prefill_staged_total']:.0f} staged "
          f"tensors), tokens identical to the uncached path")


def test_gpt_oss_with_its_expert_biases_on_the_gpu_gives_the_tokens_of_the_uncached_gpu_path(family, tmp_path):
    like, path, _b, _n, n_tensors, slots, mib, (plain, _log) = family
    if like != "gpt-oss-120b":
        pytest.skip(f"{like} has no expert biases")
    from orchestrator.plan.placement import cpu_expert_override

    (pattern, buft), = cpu_expert_override(range(FAMILIES[like][2]), weights_only=True)
    flags = ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4", "--load-mode", "none",
             "--moe-cache-prefill", "refresh", "--moe-cache-slots", "device"]
    run, log = _run_in_turn(server_path(), path, tmp_path / "biases.log", flags, ENV, BODIES,
                            experts=("-ot", f"{pattern}={buft}"))
    m = run[-1][1]
    assert m.get("moe_cache_device_slots") == 1, log[-3000:]
    assert m["moe_cache_slots"] >= slots and m["moe_cache_tensors"] == n_tensors
    _same(run, plain, f"{like}, biases on the GPU")
    print(f"{like}: the experts' biases on the GPU, {sum(len(a['tokens']) for a, _m in run)} tokens identical to "
          f"the uncached path; decode hit rate {m['moe_cache_hits_total'] / m['moe_cache_lookups_total']:.3f}")


MICRO = ["-c", "8192", "-b", "2048", "-ub", "512"]
LONGEST = [{"n_predict": 16, "prompt": (PROMPT * 256)[:4096]}]


def test_a_prompt_of_several_micro_batches_with_device_slots_gives_the_tokens_of_the_uncached_path(family, tmp_path):
    like, path, _b, _n, _t, _slots, mib, _plain = family
    plain, _log = _run_in_turn(server_path(), path, tmp_path / "micro-plain.log", ["--load-mode", "none", *MICRO],
                               ENV, LONGEST)
    dev, log = _run_in_turn(server_path(), path, tmp_path / "micro-device.log",
                            ["--moe-cache-mib", str(mib), "--moe-cache-max-batch", "4", "--load-mode", "none",
                             "--moe-cache-prefill", "refresh", "--moe-cache-slots", "device", *MICRO], ENV, LONGEST)
    (got, m), = dev
    (want, _w), = plain
    assert m.get("moe_cache_device_slots") == 1, log[-3000:]
    assert m["moe_cache_prefill_lookups_total"] > 0, "the micro-batches did not run through op offload"
    assert m["moe_cache_lookups_total"] > 0                       # decode assigned its slots on the device
    assert len(got["tokens"]) == 16
    assert got["tokens"] == want["tokens"], like
    assert probs(got) == probs(want), like
    print(f"{like}: a 4096-token prompt in micro-batches of 512 with device slots, tokens identical to the "
          f"uncached path")
