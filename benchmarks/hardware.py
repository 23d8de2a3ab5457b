"""What this CPU can do, for the benchmarks' JSON: its vector extensions as torch sees them and its
measured fp32 matrix-product rate. Speed figures differ by 3x between the machines here (AVX2 only,
AVX512, AVX512-BF16, AMX), so every speed benchmark prints these beside its timings.

Imported by the benchmarks beside it (`from hardware import ...`: a script's folder is on its path).
"""

from __future__ import annotations

import time

import torch

from trace_rl.models import native_bf16
from trace_rl.train.sft import torch_threads


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
