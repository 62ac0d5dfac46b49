"""One spelling per device (orchestrator/backend/devices.py): llama.cpp's names, its buffer names mapped to them,
RPC devices told apart by endpoint, and the bench's machine-GPU keys."""

from __future__ import annotations

import pytest

from orchestrator.backend import devices as D


def test_names_are_llama_cpp_s_and_recorded_spellings_read_as_them():
    assert D.gpu(1) == "CUDA1" and D.gpu(0, D.RPC) == "RPC0"
    assert D.canonical("cuda0") == "CUDA0" and D.canonical("cpu") == "CPU" and D.canonical("RPC3") == "RPC3"
    assert D.parse("RPC2") == D.Device("RPC", 2) and D.parse("CPU") == D.Device("CPU")
    assert D.parse("CUDA0").pads_rows and not D.parse("RPC0").pads_rows and not D.parse("CPU").is_gpu
    assert D.is_gpu("RPC1") and not D.is_gpu("PCIe") and not D.is_gpu("CPU")
    for bad in ("GPU0", "cuda", "CUDA-1", "RPC[127.0.0.1:50052]"):
        with pytest.raises(ValueError):
            D.parse(bad)
    with pytest.raises(ValueError):
        D.gpu(0, "CPU")


def test_buffers_map_to_their_device():
    eps = ["127.0.0.1:50052", "127.0.0.1:50053"]
    # each one-device server numbers its device 0: the endpoint says which of the --rpc devices it is
    assert D.device_of_buffer("RPC0[127.0.0.1:50053]", eps) == "RPC1"
    assert D.device_of_buffer("RPC0[127.0.0.1:50052]", eps) == "RPC0"
    assert D.device_of_buffer("RPC[127.0.0.1:50052]", eps) == "RPC0"          # older llama.cpp's buffer name
    assert D.device_of_buffer("RPC0[10.0.0.9:1]", eps) == "RPC[10.0.0.9:1]"    # not one of ours: said as it is
    assert D.device_of_buffer("CUDA1_Split") == "CUDA1" and D.device_of_buffer("CUDA0") == "CUDA0"
    for host in ("CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host"):
        assert D.device_of_buffer(host) == "CPU"


def test_machine_gpu_keys_follow_the_worker_s_gpus():
    assert D.machine_gpu_key("CUDA1", (4, 5)) == "gpu5"
    assert D.machine_gpu_key("RPC0", ()) == "gpu0"
    assert D.machine_gpu_key("CPU", (4, 5)) == "CPU" and D.machine_gpu_key("PCIe", ()) == "PCIe"
