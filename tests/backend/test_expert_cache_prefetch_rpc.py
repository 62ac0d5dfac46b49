"""Uploads ahead of need (``--moe-cache-prefetch on``) end to end without a GPU, on the RPC stand-in device.

With prefetch on, the qwen3moe graph computes, for every layer but the first, the experts that layer's router
would pick from the previous layer's FFN input (``moe_route_pred-<layer>``); when the scheduler fills layer N-1's
slots it reads that prediction and uploads layer N's predicted experts that are not in its slots yet. On a real
GPU the upload runs on a second stream, overlapped with layer N-1's compute; the RPC device has no events, so here
the uploads are queued in order (the log says which). Either way a prediction only changes which experts are in
the slots and when they arrive: the tokens and probabilities must stay exactly those without a cache, and the
counters must add up: every predicted expert is checked against the batch that follows, an expert uploaded
ahead that the batch uses is a hit there, and the bytes are whole experts.
"""

from __future__ import annotations

import re

import pytest

from tests.backend.expert_cache_support import N_PREDICT, one_completion, probs
from tests.backend.test_expert_cache_rpc import Setup, rpc_server, setup  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _lab_build(llama_server_path):
    from orchestrator.backend.detect import detect_backend

    if not detect_backend(llama_server_path).has("expert_cache_prefetch"):
        pytest.skip("uploads ahead of need are in the lab's patch set (lab/llama.cpp-patches), not the product "
                    "series this llama-server was built with")

CACHE = ["--moe-cache-max-batch", "4"]


@pytest.fixture(scope="module")
def plain_and_uploads(setup, llama_server_path, rpc_server, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("prefetch-base")
    plain, _m, _l = one_completion(llama_server_path, rpc_server, setup.model, tmp, "plain", [])
    uploads = one_completion(llama_server_path, rpc_server, setup.model, tmp, "cache",
                             ["--moe-cache-mib", str(setup.mib), *CACHE])
    return plain, uploads


@pytest.fixture(scope="module")
def prefetch(setup, llama_server_path, rpc_server, tmp_path_factory):  # noqa: F811
    return one_completion(llama_server_path, rpc_server, setup.model, tmp_path_factory.mktemp("prefetch"),
                          "prefetch", ["--moe-cache-mib", str(setup.mib), *CACHE, "--moe-cache-prefetch", "on"])


def _n_layers(setup) -> int:
    return setup.n_tensors // 3


def test_prefetch_gives_the_tokens_and_probabilities_of_no_cache(setup, plain_and_uploads, prefetch):  # noqa: F811
    plain, _ = plain_and_uploads
    out, m, log = prefetch
    assert m.get("moe_cache_active") == 1, log[-3000:]
    assert len(out["tokens"]) == N_PREDICT
    assert out["tokens"] == plain["tokens"]
    assert probs(out) == probs(plain)


def test_prefetch_counters_add_up(setup, plain_and_uploads, prefetch):  # noqa: F811
    _plain, (_o, base, _l) = plain_and_uploads
    _out, m, log = prefetch
    lookups, hits, misses = m["moe_cache_lookups_total"], m["moe_cache_hits_total"], m["moe_cache_misses_total"]
    assert lookups == hits + misses
    assert lookups == base["moe_cache_lookups_total"]          # the same batches look up the same experts
    predicted, correct = m["moe_cache_prefetch_predicted_total"], m["moe_cache_prefetch_correct_total"]
    uploads, useful = m["moe_cache_prefetch_uploads_total"], m["moe_cache_prefetch_useful_total"]
    # every decode step predicts one token's picks for every layer after the first, in each of its 3 tensors
    n_layers = _n_layers(setup)
    steps, rest = divmod(predicted, setup.n_used * 3 * (n_layers - 1))
    assert rest == 0 and N_PREDICT - 1 <= steps <= N_PREDICT, (predicted, n_layers)
    assert 0 <= useful <= uploads <= predicted and useful <= correct <= predicted
    assert m["moe_cache_prefetch_uploaded_bytes_total"] == pytest.approx(uploads * setup.expert_bytes, rel=1e-5)
    # an expert uploaded ahead and then used is a hit of that batch; the misses are what was still missing
    assert m["moe_cache_uploaded_bytes_total"] == pytest.approx(misses * setup.expert_bytes, rel=1e-5)
    assert hits >= useful
    # the prediction knows something: far better than guessing n_used of n_expert experts at random
    accuracy = correct / predicted
    chance = setup.n_used / setup.n_expert
    print(f"prefetch: accuracy {accuracy:.3f} (chance {chance:.3f}); {uploads:.0f} uploaded ahead, {useful:.0f} "
          f"used; misses {misses:.0f} against {base['moe_cache_misses_total']:.0f} without prefetch; hits "
          f"{hits:.0f} / {base['moe_cache_hits_total']:.0f}")
    assert accuracy > 2 * chance, (accuracy, chance)
    # misses the prediction caught are not waited for: fewer uploads on the critical path than without it
    assert misses < base["moe_cache_misses_total"]


def test_prefetch_off_by_default_and_its_counters_stay_zero(plain_and_uploads):
    _plain, (_o, base, log) = plain_and_uploads
    assert base["moe_cache_prefetch_predicted_total"] == 0 and base["moe_cache_prefetch_uploads_total"] == 0


def test_prefetch_rejects_a_bad_value(setup, llama_server_path, rpc_server, tmp_path):  # noqa: F811
    import subprocess

    r = subprocess.run([llama_server_path, "-m", str(setup.model), "--moe-cache-prefetch", "sometimes"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert re.search(r"--moe-cache-prefetch must be on or off", r.stdout + r.stderr)
