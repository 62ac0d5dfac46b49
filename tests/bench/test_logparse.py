"""llama.cpp's own buffer sizes and --fit decisions, read from a real llama-server log and a CUDA-style one."""

from __future__ import annotations

from pathlib import Path

from orchestrator.bench.logparse import device_totals, parse_server_log

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def test_real_mainline_log():
    d = parse_server_log(DATA / "mainline-cpu-lv4.log")
    b = d["buffers"]
    assert b["model"] == {"CPU_Mapped": int(0.98 * MiB)}
    assert b["kv"] == {"CPU": int(0.50 * MiB)} and b["compute"] == {"CPU": int(2.26 * MiB)}
    assert any("no changes needed" in line for line in d["fit"])
    assert device_totals(b) == {"CPU_Mapped": int(0.98 * MiB), "CPU": int(0.5 * MiB) + int(2.26 * MiB)}


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
    assert d["buffers"]["model"] == {"CUDA0": int(11264.5 * MiB), "CUDA_Host": 5120 * MiB}
    assert d["offloaded_layers"] == [49, 49]
    assert device_totals(d["buffers"]) == {"CUDA0": int(11264.5 * MiB) + 768 * MiB + int(1536.25 * MiB),
                                           "CUDA_Host": 5200 * MiB}
    assert d["fit"] == ["projected to use 21000 MiB of device memory vs. 12288 MiB free"]
    assert parse_server_log(tmp_path / "missing.log") == {}
