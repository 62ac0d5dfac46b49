"""llama.cpp's own buffer sizes and --fit decisions, read from a real llama-server log and a CUDA-style one."""

from __future__ import annotations

from pathlib import Path

from orchestrator.bench.logparse import device_totals, parse_server_log

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def test_real_mainline_log():
    d = parse_server_log(DATA / "mainline-cpu-lv4.log")
    b = d["buffers"]
    assert b["model"] == {"CPU_Mapped": round(0.98 * MiB)}
    assert b["kv"] == {"CPU": round(0.50 * MiB)} and b["compute"] == {"CPU": round(2.26 * MiB)}
    assert any("no changes needed" in line for line in d["fit"])
    assert device_totals(b) == {"CPU_Mapped": round(0.98 * MiB), "CPU": round(0.5 * MiB) + round(2.26 * MiB)}


def test_cuda_style_log_and_a_second_load_replaces_the_first(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "0.1 I load_tensors: loading model tensors, this can take a while... (load_mode = mmap)\n"
        "0.2 I load_tensors:        CUDA0 model buffer size =  9999.00 MiB\n"
        "# orchestrator: starting again\n"
        "0.1 I load_tensors: loading model tensors, this can take a while... (load_mode = none)\n"
        "\x1b[32m0.2 I load_tensors:        CUDA0 model buffer size = 11264.50 MiB\x1b[0m\n"
        "0.2 I load_tensors:    CUDA_Host model buffer size =  5120.00 MiB\n"
        "0.2 I load_tensors: offloaded 49/49 layers to GPU\n"
        "0.3 I llama_kv_cache:      CUDA0 KV buffer size =   768.00 MiB\n"
        "0.4 I sched_reserve:      CUDA0 compute buffer size =  1536.25 MiB\n"
        "0.4 I sched_reserve:  CUDA_Host compute buffer size =    80.00 MiB\n"
        "0.0 I common_params_fit_impl: projected to use 21000 MiB of device memory vs. 12288 MiB free\n")
    d = parse_server_log(log)
    assert d["buffers"]["model"] == {"CUDA0": round(11264.5 * MiB), "CUDA_Host": 5120 * MiB}
    assert d["offloaded_layers"] == [49, 49]
    assert device_totals(d["buffers"]) == {"CUDA0": round(11264.5 * MiB) + 768 * MiB + round(1536.25 * MiB),
                                           "CUDA_Host": 5200 * MiB}
    assert d["fit"] == ["projected to use 21000 MiB of device memory vs. 12288 MiB free"]
    assert parse_server_log(tmp_path / "missing.log") == {}


def test_split_model_buffers_add_up_and_older_compute_lines_count(tmp_path):
    """A model in two files maps one CPU_Mapped buffer per file: the bench records their sum, not the last one;
    compute buffers logged by llama_context (older llama.cpp) count like sched_reserve's."""
    log = tmp_path / "split.log"
    log.write_text(
        "load_tensors: loading model tensors, this can take a while... (mmap = true)\n"
        "load_tensors:   CPU_Mapped model buffer size =  1000.00 MiB\n"
        "load_tensors:   CPU_Mapped model buffer size =   500.00 MiB\n"
        "llama_kv_cache_unified:        CPU KV buffer size =    64.00 MiB\n"
        "llama_context:        CPU compute buffer size =    92.00 MiB\n")
    b = parse_server_log(log)["buffers"]
    assert b == {"model": {"CPU_Mapped": 1500 * MiB}, "kv": {"CPU": 64 * MiB}, "compute": {"CPU": 92 * MiB}}


def test_the_expert_cache_the_server_made(tmp_path):
    """The patch's line at load (as the H200 printed it): slots per expert tensor, device bytes, the batch cap;
    with --moe-cache-cpu-misses the line says so. A load without a cache records none."""
    log = tmp_path / "cache.log"
    line = ("0.07.470.696 I ggml_backend_sched_moe_cache_init: expert cache: 78 host-resident expert tensors x 34 "
            "slots (of 128 experts), 2237.6 MiB of device memory, batches up to 4 tokens")
    log.write_text("load_tensors: loading model tensors, this can take a while... (load_mode = none)\n" + line + "\n")
    assert parse_server_log(log)["expert_cache"] == {"tensors": 78, "slots": 34, "n_expert": 128,
                                                  "bytes": round(2237.6 * MiB), "max_batch": 4, "cpu_misses": False}
    log.write_text(line + "; misses computed on the CPU until reused\n")
    assert parse_server_log(log)["expert_cache"]["cpu_misses"] is True
    log.write_text(line + "\nload_tensors: loading model tensors, this can take a while... (load_mode = none)\n")
    assert "expert_cache" not in parse_server_log(log)
