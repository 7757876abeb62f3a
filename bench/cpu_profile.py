"""Measure this machine's numbers for ``conf/hardware/cpu.yaml``: matmul peak, copy and memory bandwidth.

    python bench/cpu_profile.py            # all cores (torch's default thread count)
    python bench/cpu_profile.py --threads 1

Prints the measured figures and the YAML lines to paste into ``conf/hardware/cpu.yaml``. Each
figure is the best of a few repetitions (the machine may be shared; the best run is the closest
to what the hardware can do).

- matmul peak: ``torch.mm`` of two [n, n] matrices, 2·n³ FLOPs per product, for bf16 and fp32;
- host link (the CPU "device" window): ``Tensor.copy_`` of a 256 MB bf16 buffer, bytes copied / s;
- host memory bandwidth: a STREAM-triad-like ``torch.add(b, c, alpha=s, out=a)`` over three
  64 M-element fp32 arrays, 3 × 4 bytes moved per element (McCalpin's STREAM convention).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

__all__ = ["best_time", "matmul_flops", "copy_gbps", "triad_gbps", "cpu_name"]


def best_time(fn, reps: int = 5) -> float:
    """Shortest wall time of ``reps`` calls of ``fn`` after one warm-up call, in seconds."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    """Best FLOP/s of an [n, n] @ [n, n] product in ``dtype`` (2·n³ FLOPs)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b, out=out))


def copy_gbps(nbytes: int = 256 << 20) -> float:
    """Best GB/s (1e9 bytes) of copying ``nbytes`` of bf16 between two host buffers."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return nbytes / best_time(lambda: dst.copy_(src)) / 1e9


def triad_gbps(numel: int = 64 << 20) -> float:
    """Best GB/s of ``a = b + s·c`` over fp32 arrays (3 × 4 bytes per element, STREAM triad)."""
    a, b, c = torch.empty(numel), torch.ones(numel), torch.ones(numel)
    return 12 * numel / best_time(lambda: torch.add(b, c, alpha=3.0, out=a)) / 1e9


def cpu_name() -> str:
    """The ``model name`` line of /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    bf16, fp32 = matmul_flops(torch.bfloat16), matmul_flops(torch.float32)
    link, triad = copy_gbps(), triad_gbps()
    cpu = cpu_name()
    print(f"cpu: {cpu}, {os.cpu_count()} logical cores, torch {torch.__version__}, {threads} threads")
    print(f"matmul bf16: {bf16 / 1e9:8.1f} GFLOP/s   fp32: {fp32 / 1e9:8.1f} GFLOP/s  (2048² mm)")
    print(f"copy (bf16 256 MB): {link:6.1f} GB/s   triad (fp32): {triad:6.1f} GB/s")
    print("# conf/hardware/cpu.yaml")
    print(f"peak_flops: {max(bf16, fp32):.3e}  # best of bf16/fp32 mm, {threads} threads")
    print(f"host_link_gbps: {link:.1f}")
    print(f"host_memory_bandwidth_gbps: {triad:.1f}")
    torch.set_num_threads(1)
    print(f"core_memory_bandwidth_gbps: {triad_gbps():.1f}  # the triad on 1 thread")


if __name__ == "__main__":
    main()
