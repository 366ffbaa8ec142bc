"""Dtype, precision and threads come from what the machine supports, never from a fixed table."""

from __future__ import annotations

import os

import pytest
import torch

from eagle import hardware


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Pretend the CPU has (True) or lacks (False) bf16 instructions."""
    def set_(value: bool) -> None:
        monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: value)
    return set_


def test_cpu_without_bf16_instructions_gets_fp32_everywhere(bf16_cpu):
    bf16_cpu(False)
    assert hardware.auto_precision("cpu") == "32-true"
    assert hardware.auto_dtype("cpu", wide=True) == "float32"
    assert hardware.auto_dtype("cpu", wide=False) == "float32"
    assert hardware.resolve_dtype_name("auto", "cpu") == "float32"
    assert hardware.resolve_precision("auto", "cpu") == "32-true"


def test_cpu_with_bf16_instructions_gets_bf16_for_wide_work(bf16_cpu):
    bf16_cpu(True)
    assert hardware.auto_precision("cpu") == "bf16-mixed"
    assert hardware.auto_dtype("cpu", wide=True) == "bfloat16"
    assert hardware.auto_dtype("cpu", wide=False) == "float32"  # one-token steps: fp32 is as fast


def test_explicit_settings_pass_through(bf16_cpu):
    bf16_cpu(False)
    assert hardware.resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"
    assert hardware.resolve_dtype_name("bfloat16", "cpu") == "bfloat16"


def test_capability_probe_agrees_with_torch():
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps:
        want = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
        assert hardware.cpu_has_fast_bf16() is want


def test_a_cuda_device_without_one_is_refused_with_the_way_out(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1", torch.device("cuda:0")):
        with pytest.raises(ValueError, match=r"sees no CUDA device .*use device=cpu"):
            hardware.check_device(device)
    hardware.check_device("cpu")
    hardware.check_device(torch.device("cpu"))


def test_threads_follow_idle_cores(monkeypatch):
    n = torch.get_num_threads()
    try:
        monkeypatch.setattr(hardware, "idle_cores", lambda sample_s=0.25: 0.2)  # everything busy
        assert hardware.set_threads("auto") == 1
        monkeypatch.setattr(hardware, "idle_cores", lambda sample_s=0.25: 1.9)
        assert hardware.set_threads("auto") == 2
        assert hardware.set_threads(1) == 1
    finally:
        torch.set_num_threads(n)


def test_idle_cores_is_within_the_cores_we_have():
    idle = hardware.idle_cores(sample_s=0.05)
    assert 0.0 <= idle <= len(os.sched_getaffinity(0))


def test_benchmark_dtypes_come_from_the_machine(bf16_cpu):
    from eagle.bench.methods import method_dtype

    bf16_cpu(False)
    assert {
        m: method_dtype(m, "cpu") for m in ("vanilla", "eagle", "medusa", "draft")
    } == dict.fromkeys(("vanilla", "eagle", "medusa", "draft"), "float32")
    bf16_cpu(True)
    assert (
        method_dtype("eagle@chain5", "cpu") == "bfloat16"
        and method_dtype("vanilla", "cpu") == "float32"
    )
    assert (
        method_dtype("eagle", "cpu", {"eagle": "float32"}) == "float32"
    )  # an explicit choice wins


def test_a_timings_floor_takes_the_bandwidth_of_the_gpu_it_ran_on():
    """A session's GPU may be an H100 or an H200: the floor of each is its own (an H200's on an
    H100 understated the floor by 1.43x)."""
    from eagle.hardware import gpu_bandwidth_gb_s

    assert gpu_bandwidth_gb_s("NVIDIA H200") == 4800.0
    assert gpu_bandwidth_gb_s("NVIDIA H100 80GB HBM3") == 3350.0
    assert gpu_bandwidth_gb_s("NVIDIA H100 PCIe") == 2000.0
    assert gpu_bandwidth_gb_s("cpu") is None
