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


def _cut(path, like, layers, quant="q4_0"):
    from orchestrator.model.synth import write_header_only

    return model_costs(read_model(write_header_only(path, like, quant=quant, layers=layers)))


def test_a_prompt_skips_the_last_layers_feed_forward_but_gpt_oss_runs_it(tmp_path):
    """llama.cpp keeps only the output rows before the last layer's feed-forward (inp_out_ids) in the qwen3moe,
    glm4moe and deepseek2 graphs, not in gpt-oss's: the costs say which layer a prompt skips and what of it beside
    the routed experts (the router, dense or shared FFN)."""
    qwen = _cut(tmp_path / "q.gguf", "qwen3-30b-a3b", 4)
    assert qwen.prompt_skip_ffn_layer == 3
    assert qwen.prompt_skip_ffn_params == 2048 * 128                     # the router alone
    glm = _cut(tmp_path / "g.gguf", "glm-4.5-air", 2)
    assert glm.prompt_skip_ffn_layer == 1
    assert glm.prompt_skip_ffn_params > 3 * 4096 * 1408                  # the shared expert and the router
    assert glm.prompt_skip_ffn_params < glm.layer_always_params[1]       # not its attention
    assert _cut(tmp_path / "o.gguf", "gpt-oss-20b", 2, quant="q8_0").prompt_skip_ffn_layer is None


def test_the_skipped_feed_forward_costs_a_prompt_nothing(tmp_path):
    """GLM-4.5-Air cut to 2 layers ends on its MoE layer, whose experts a prompt does not multiply (measured on
    one thread of the dev VM: 121.6 t/s at pp512, 65.2 at 3 layers); a third layer costs the whole MoE layer the
    second one does not."""
    two, three = _cut(tmp_path / "2.gguf", "glm-4.5-air", 2), _cut(tmp_path / "3.gguf", "glm-4.5-air", 3)

    def seconds(costs):
        return 512 / predict_pp(costs, place_cpu_only(costs, [0] * costs.n_layers), _sp(), 512, None,
                                lengths=(512,))[512]

    every_token = replace(two, prompt_skip_ffn_layer=None, prompt_skip_ffn_params=0)
    skipped = seconds(every_token) - seconds(two)
    assert skipped > 0.3 * seconds(two)
    assert seconds(three) - seconds(two) > 0.9 * skipped
    assert seconds(three) / seconds(two) == pytest.approx(121.6 / 65.2, rel=0.2)
