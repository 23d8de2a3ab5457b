"""What this CPU can do, for the benchmarks' JSON: its model, its vector extensions (as /proc/cpuinfo
lists them and as torch sees them) and its measured fp32 matrix-product rate. Speed figures differ by
3x between the machines here (AVX2 only, AVX512, AVX512-BF16, AMX), so every speed benchmark prints
`machine()` beside its timings (`common.emit`).

Imported by the benchmarks beside it (`from hardware import ...`: a script's folder is on its path).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from trace_rl.models import native_bf16
from trace_rl.training.sft import torch_threads


def cpu_flags() -> dict[str, object]:
    """Native bf16 (AVX512-BF16, AMX tiles: what `sft.precision: auto` decides by) and the widest
    vector code torch dispatches to."""
    return {**native_bf16(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def matmul_gflops(size: int = 512, reps: int = 50, threads: int | None = None, dtype: torch.dtype = torch.float32) -> float:
    """`size` x `size` matrix products per second in `dtype` (default fp32), in GFLOP/s, on `threads`
    threads (default: torch's current count): what a compute-bound step can reach on this CPU."""
    with torch_threads(threads or torch.get_num_threads()):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        for _ in range(3):
            a @ b
        begin = time.perf_counter()
        for _ in range(reps):
            a @ b
        return 2 * size**3 * reps / (time.perf_counter() - begin) / 1e9


FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
"""The /proc/cpuinfo flags that change what a CPU's matrix products and bf16 cost."""


def cpuinfo() -> tuple[str, list[str]]:
    """The CPU's model name and which of `FLAGS` it has, from /proc/cpuinfo (Linux; elsewhere the
    platform's processor name and no flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)  # the last CPU's lines
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", platform.processor() or platform.machine()), [f for f in FLAGS if f in flags]


def machine() -> dict[str, object]:
    """The facts every speed benchmark prints as its `machine`: CPU model, cores, vector flags, torch's
    view of them (`cpu_flags`) and the fp32 matrix-product rate on every core (under a second to measure)."""
    model, flags = cpuinfo()
    cpus = os.cpu_count() or 1
    return {
        "cpu_model": model,
        "cpus": cpus,
        "cpuinfo_flags": flags,
        **cpu_flags(),
        "matmul_gflops_fp32": round(matmul_gflops(threads=cpus), 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
