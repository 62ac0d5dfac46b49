"""The CPU-only prompt model (predict.cpu_pp_batch_seconds): it follows the prompt's length (attention over the
context), the micro-batch, the threads and the machine's measured prompt speed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.model.synth import write_model
from orchestrator.model.reader import read_model
from orchestrator.plan import rates as R
from orchestrator.plan.costs import model_costs
from orchestrator.plan.placement import place_cpu_only
from orchestrator.plan.predict import SpeedInputs, predict_pp


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "demo.gguf"
    write_model(path, "qwen3-30b-a3b", scale=0.125, quant="q8_0", fsync=False)
    costs = model_costs(read_model(path))
    return costs, place_cpu_only(costs, [0] * costs.n_layers)


def _sp(threads=1, rate=0.0):
    return SpeedInputs((), (), 1.0, 20e9, R.cpu_flops_per_core(None)[0] * threads, threads=threads, cpu_rate=rate)


def test_the_demo_has_attentions_width(demo):
    costs, _ = demo
    assert costs.attn_pair_macs == 6 * 4 * (128 + 128)          # 6 layers, 4 heads of 128 (keys and values)


def test_longer_prompts_are_slower_per_token_as_attention_grows(demo):
    costs, placement = demo
    pp = predict_pp(costs, placement, _sp(), 512, None, lengths=(32, 512, 4096, 8192))
    assert pp[32] > pp[512] > pp[4096] > pp[8192]
    # measured on this machine's demo (llama-bench, one thread): pp4096 / pp512 = 0.41-0.44
    assert 0.3 < pp[4096] / pp[512] < 0.55


def test_smaller_micro_batches_attend_to_less_masked_context(demo):
    costs, placement = demo
    small = predict_pp(costs, placement, _sp(), 128, None, lengths=(4096,))[4096]
    large = predict_pp(costs, placement, _sp(), 2048, None, lengths=(4096,))[4096]
    assert small > large        # each micro-batch computes its queries against the context up to its own end


def test_threads_and_the_measured_machine_speed_scale_prompts(demo):
    costs, placement = demo
    one = predict_pp(costs, placement, _sp(1), 512, None, lengths=(512,))[512]
    four = predict_pp(costs, placement, _sp(4), 512, None, lengths=(512,))[512]
    # the work scales with threads ** exponent; the experts' memory-bound share does not, so a little below it
    assert 0.95 * 4 ** R.CPU_PP_THREAD_EXPONENT <= four / one <= 4 ** R.CPU_PP_THREAD_EXPONENT
    half = predict_pp(costs, placement, _sp(1, rate=0.5), 512, None, lengths=(512,))[512]
    ref = predict_pp(costs, placement, _sp(1, rate=1.0), 512, None, lengths=(512,))[512]
    assert ref == pytest.approx(one) and half == pytest.approx(ref / 2, rel=0.02)
    # the per-core table is bypassed once the rate is measured: the reference core at the measured speed
    avx512 = replace(_sp(1, rate=1.0), cpu_flops=60e9)
    assert predict_pp(costs, placement, avx512, 512, None, lengths=(512,))[512] == pytest.approx(ref)
