"""What this machine computes fast: the dtype, training precision and thread count to use.

Nothing here is a fixed table. bfloat16 is chosen only where the hardware has bf16 arithmetic:
a CUDA GPU that supports it, or a CPU with AVX512-BF16 or AMX instructions. Elsewhere PyTorch
emulates bf16 on the CPU, and a bf16 autocast training step runs far slower than fp32
(LOG.md, 2026-11-30, AVX2-only EPYC): fp32 is the fast choice there.

Threads: PyTorch's OpenMP pool spins on every core it was given. When other processes share
the cores, a spinning thread that loses its core stalls every barrier, and a 2-thread run
beside one busy process ran 3x slower than a 1-thread run (LOG.md). `auto_threads` gives the
pool only the cores that are idle right now.
"""

from __future__ import annotations

import os
import time
from functools import cache

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU instructions that make bf16 matmuls fast


# nominal memory bandwidth (GB/s) of the GPUs a timing's floor is stated for, by a piece of their
# name as torch.cuda.get_device_name gives it; the first match counts (PCIe before the plain name)
GPU_BANDWIDTH_GB_S = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
)


def gpu_bandwidth_gb_s(name: str) -> float | None:
    """The nominal memory bandwidth of the GPU called `name`, None when it is not in the table."""
    return next((gb for piece, gb in GPU_BANDWIDTH_GB_S if piece in name), None)


@cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX512-BF16 or AMX), as PyTorch reports it
    (`torch.cpu.get_capabilities`), else as /proc/cpuinfo lists it."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        found = caps()
        if any(flag in found for flag in BF16_CPU_FLAGS):
            return any(bool(found.get(flag)) for flag in BF16_CPU_FLAGS)
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return False
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def check_device(device: str | torch.device) -> None:
    """A CUDA device asked for where torch sees none stops here, saying so, rather than in the
    first tensor moved to it (an `AssertionError: Torch not compiled with CUDA enabled`)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
        raise ValueError(
            f"device={device}, but torch {torch.__version__} sees no CUDA device ({build}): "
            "use device=cpu"
        )


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bf16 compute is fast on `device` (a CUDA GPU with bf16, or a bf16-capable CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_fast_bf16()
    return False


def auto_dtype(device: str | torch.device = "cpu", wide: bool = True) -> str:
    """The dtype to run a model in on `device`: "bfloat16" where bf16 is fast, else "float32".

    `wide`: the forward scores many tokens at once (a tree verification, a training batch).
    On a CPU, a one-token decode step is memory- and overhead-bound, and fp32 decodes it at
    least as fast as bf16 even with AMX (LOG.md), so narrow work stays in fp32 there. A rule, not
    a measurement: where it says bf16 on a CPU, `eagle.bench.builder.Methods` measures both dtypes
    on the target (`eagle.bench.precision.faster_dtype`; a small model can verify faster in fp32).
    """
    device = torch.device(device)
    if not fast_bf16(device):
        return "float32"
    return "bfloat16" if wide or device.type == "cuda" else "float32"


def resolve_dtype_name(name: str, device: str | torch.device = "cpu", wide: bool = True) -> str:
    """`name`, or `auto_dtype(device, wide)` when `name` is "auto"."""
    return auto_dtype(device, wide) if name == "auto" else name


def auto_precision(accelerator: str = "cpu") -> str:
    """Lightning's `precision` for training on `accelerator`: bf16 autocast (fp32 weights and
    optimizer state) where bf16 is fast, full fp32 elsewhere."""
    device = (
        "cuda" if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available() else "cpu"
    )
    return "bf16-mixed" if fast_bf16(device) else "32-true"


def resolve_precision(precision: str | int, accelerator: str = "cpu") -> str | int:
    """`precision`, or `auto_precision(accelerator)` when it is "auto"."""
    return auto_precision(accelerator) if precision == "auto" else precision


def idle_cores(sample_s: float = 0.25) -> float:
    """How many of this process's cores were idle over the last `sample_s` seconds (Linux
    /proc/stat; the whole machine is assumed to be ours elsewhere)."""

    def busy_idle() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, idle

    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    first = busy_idle()
    if first is None:
        return float(cores)
    time.sleep(sample_s)
    second = busy_idle()
    busy, idle = second[0] - first[0], second[1] - first[1]
    total_cores = os.cpu_count() or cores
    if busy + idle <= 0:
        return float(cores)
    return min(float(cores), total_cores * idle / (busy + idle))


def auto_threads() -> int:
    """Intra-op threads for this process: the cores idle right now (at least 1)."""
    return max(1, int(idle_cores() + 0.5))


def set_threads(threads: int | str | None) -> int:
    """Apply a `threads` setting: an integer, "auto" (`auto_threads`) or None (torch's
    default: every core). Returns the number of threads torch now uses."""
    if threads == "auto":
        threads = auto_threads()
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()
