"""The one vocabulary of llama-server and numactl: settings -> argv/env for both flavors, and a user's flags back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.backend.info import BackendInfo, nominal_backend
from orchestrator.launch.llama_args import (
    OFFLOAD_ENV, OFFLOAD_NEVER, backend_seen_in, parse_server_args, server_args, server_env,
)
from orchestrator.launch.settings import ALL_LAYERS, WorkerSettings

MAINLINE = nominal_backend("mainline", cuda=True)
IK = nominal_backend("ik_llama.cpp", cuda=True)
S = WorkerSettings(model_path="/m/q.gguf", context=8192, parallel=2, alias="q", host="127.0.0.1", port=9000,
                   gpus=(2, 3), n_gpu_layers=ALL_LAYERS, split_mode="layer", tensor_split=(24, 24), main_gpu=0,
                   tensor_overrides=((r"blk\.(0|1)\.ffn_(up|down|gate)_exps", "CPU"),), fit=False,
                   op_offload_min_batch=128, load_mode="pinned", numa_flag="distribute", threads=16,
                   threads_batch=32, n_batch=4096, n_ubatch=2048, flash_attn="on", type_k="q8_0", type_v="q8_0")


def _value(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def test_mainline_and_ik_spell_the_same_settings_their_own_way():
    m, ik = server_args(S, MAINLINE), server_args(S, IK)
    assert _value(m, "--load-mode") == "none" and "--no-mmap" not in m
    assert "--no-mmap" in ik and "--load-mode" not in ik
    assert _value(m, "--fit") == "off" and "--fit" not in ik            # ik_llama.cpp is never told --fit
    assert server_env(S, MAINLINE) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3",
                                       OFFLOAD_ENV: "128"}
    assert _value(ik, "-cuda") == "offload-batch-size=128" and OFFLOAD_ENV not in server_env(S, IK)
    assert _value(m, "-ot") == r"blk\.(0|1)\.ffn_(up|down|gate)_exps=CPU" and _value(m, "-ts") == "24,24"


def test_never_is_a_switch_where_the_binary_has_one_else_the_variable():
    never = replace(S, op_offload_min_batch=OFFLOAD_NEVER)
    assert "--no-op-offload" in server_args(never, MAINLINE) and OFFLOAD_ENV not in server_env(never, MAINLINE)
    old = replace(MAINLINE, features=MAINLINE.features - {"no_op_offload"})
    assert "--no-op-offload" not in server_args(never, old)
    assert server_env(never, old)[OFFLOAD_ENV] == str(OFFLOAD_NEVER)


def test_expert_cache_only_when_asked_for_and_offered():
    with_cache = MAINLINE                                # the nominal mainline is our patched build
    assert "expert_cache" in with_cache.features
    assert "--moe-cache-mib" not in server_args(S, with_cache)                     # 0 = off
    cached = replace(S, expert_cache_mib=4096)
    assert _value(server_args(cached, with_cache), "--moe-cache-mib") == "4096"
    without = replace(MAINLINE, features=MAINLINE.features - {"expert_cache"})
    assert "--moe-cache-mib" not in server_args(cached, without)                   # the binary lacks it
    assert "--moe-cache-max-batch" not in server_args(cached, with_cache)          # llama-server's default
    wide = replace(cached, expert_cache_max_batch=16)
    assert _value(server_args(wide, with_cache), "--moe-cache-max-batch") == "16"
    assert parse_server_args(server_args(wide, with_cache)).expert_cache_max_batch == 16
    assert "--moe-cache-max-batch" not in server_args(replace(S, expert_cache_max_batch=16), with_cache)  # no cache
    with pytest.raises(ValueError):
        replace(S, expert_cache_mib=-1)


def test_cpu_misses_only_with_a_cache_and_a_binary_that_has_them():
    cpu = replace(S, expert_cache_mib=4096, expert_cache_cpu_misses=True)
    has = replace(MAINLINE, features=MAINLINE.features | {"expert_cache_cpu_misses"})
    args = server_args(cpu, has)
    assert "--moe-cache-cpu-misses" in args and parse_server_args(args).expert_cache_cpu_misses
    older = replace(MAINLINE, features=MAINLINE.features - {"expert_cache_cpu_misses"})
    assert "--moe-cache-cpu-misses" not in server_args(cpu, older)                   # the binary lacks it
    assert "--moe-cache-cpu-misses" not in server_args(replace(cpu, expert_cache_mib=0), has)      # no cache
    assert "--moe-cache-cpu-misses" not in server_args(replace(cpu, expert_cache_cpu_misses=False), has)


def test_uploads_ahead_only_with_a_cache_and_a_binary_that_has_them():
    ahead = replace(S, expert_cache_mib=4096, expert_cache_prefetch=True)
    has = replace(MAINLINE, features=MAINLINE.features | {"expert_cache", "expert_cache_prefetch"})
    args = server_args(ahead, has)
    assert _value(args, "--moe-cache-prefetch") == "on" and parse_server_args(args).expert_cache_prefetch
    assert "--moe-cache-prefetch" not in server_args(ahead, replace(has, features=has.features - {"expert_cache_prefetch"}))
    assert "--moe-cache-prefetch" not in server_args(replace(ahead, expert_cache_mib=0), has)        # no cache
    assert "--moe-cache-prefetch" not in server_args(replace(ahead, expert_cache_prefetch=False), has)
    assert not parse_server_args(["--moe-cache-prefetch", "off"]).expert_cache_prefetch


def test_prompt_staging_only_with_a_cache_and_a_binary_that_has_it():
    staged = replace(S, expert_cache_mib=4096, expert_cache_stage_buffers=2)
    has = replace(MAINLINE, features=MAINLINE.features | {"expert_cache", "expert_cache_staging"})
    args = server_args(staged, has)
    assert _value(args, "--moe-cache-prefill-ahead") == "2" and parse_server_args(args).expert_cache_stage_buffers == 2
    assert backend_seen_in(args).has("expert_cache_staging")
    assert "--moe-cache-prefill-ahead" not in server_args(
        staged, replace(has, features=has.features - {"expert_cache_staging"}))      # the binary lacks it
    assert "--moe-cache-prefill-ahead" not in server_args(replace(staged, expert_cache_mib=0), has)         # no cache
    assert "--moe-cache-prefill-ahead" not in server_args(replace(staged, expert_cache_stage_buffers=0), has)
    with pytest.raises(ValueError):
        replace(S, expert_cache_stage_buffers=-1)


def test_the_smallest_staged_micro_batch_goes_with_staging_and_a_binary_that_has_it():
    staged = replace(S, expert_cache_mib=4096, expert_cache_stage_buffers=2, expert_cache_stage_min_batch=401)
    has = replace(MAINLINE, features=MAINLINE.features | {"expert_cache", "expert_cache_staging",
                                                          "expert_cache_stage_min_batch"})
    args = server_args(staged, has)
    assert _value(args, "--moe-cache-prefill-ahead-min-batch") == "401"
    back = parse_server_args(args)
    assert (back.expert_cache_stage_buffers, back.expert_cache_stage_min_batch) == (2, 401)
    assert backend_seen_in(args).has("expert_cache_stage_min_batch")
    lacks = replace(has, features=has.features - {"expert_cache_stage_min_batch"})
    assert "--moe-cache-prefill-ahead-min-batch" not in server_args(staged, lacks)
    assert "--moe-cache-prefill-ahead" in server_args(staged, lacks)          # staging itself stays
    assert "--moe-cache-prefill-ahead-min-batch" not in server_args(replace(staged, expert_cache_stage_buffers=0), has)
    assert "--moe-cache-prefill-ahead-min-batch" not in server_args(
        replace(staged, expert_cache_stage_min_batch=0), has)
    with pytest.raises(ValueError):
        replace(S, expert_cache_stage_min_batch=-1)


@pytest.mark.parametrize("backend", [MAINLINE, IK], ids=["mainline", "ik"])
def test_rendered_flags_read_back_to_the_same_settings(backend):
    """What launch renders, parse_server_args reads back (the NUMA binding is numactl's, not llama-server's)."""
    cached = replace(S, expert_cache_mib=512, expert_cache_cpu_misses=not backend.ik, extra_args=("--seed", "-1"))
    b = replace(backend, features=backend.features | {"expert_cache"} | ({"expert_cache_cpu_misses"} if not backend.ik
                                                                        else set()))
    back = parse_server_args(server_args(cached, b), server_env(cached, b))
    expected = cached if not b.ik else replace(cached, fit=None)                   # ik is never told --fit
    assert back == replace(expected, metrics=back.metrics)


def test_unknown_and_unreadable_flags_stay_in_order():
    s = parse_server_args(["-m", "x", "--seed", "-1", "-ot", "a{1,2}=CPU", "--mlock", "-fa"])
    assert s.model_path == "x" and not s.tensor_overrides
    assert s.extra_args == ("--seed", "-1", "-ot", "a{1,2}=CPU", "-fa", "--mlock")
    assert parse_server_args(["--no-mmap", "--mlock"]).load_mode == "mlock"
    assert parse_server_args(["-lm", "none"]).load_mode == "pinned"
    assert parse_server_args(["-ngl", "all"]).n_gpu_layers == ALL_LAYERS
    # GPU numbers are taken as the plan's only in PCI order
    assert parse_server_args([], {"CUDA_VISIBLE_DEVICES": "1"}).gpus is None
    assert parse_server_args([], {"CUDA_VISIBLE_DEVICES": ""}).gpus == ()


def test_the_binary_a_user_s_flags_were_written_for():
    assert backend_seen_in(["-cuda", "offload-batch-size=8"]).ik
    seen = backend_seen_in(["--fit", "off", "--metrics"])
    assert not seen.ik and {"fit", "load_mode", "metrics"} <= seen.features
    assert backend_seen_in([]).features == frozenset()


def test_settings_round_trip_through_json():
    import json

    from orchestrator.launch.numa import NumaPolicy

    s = replace(S, numa=NumaPolicy.bind([1], cpus=[8, 9]), disable_numa_balancing=True)
    assert WorkerSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert BackendInfo.from_dict(json.loads(json.dumps(IK.to_dict()))) == IK
