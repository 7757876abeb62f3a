"""CPU optimizer throughput: our AdamW step over the host store vs torch.optim.AdamW, elements/s.

    python bench/cpu_optimizer.py                       # 8 units × 4M fp32 elements, 1 and all threads
    python bench/cpu_optimizer.py --units 16 --numel 8000000

Ours: ``StoreAdamW.step`` (optim.py) over units in a shared-memory host store: the fused AdamW
update of master weights and moments, plus refreshing the bf16 transfer copy (what a training
step needs; the gradient accumulator is not zeroed: the next step's first offload overwrites
it). torch: ``torch.optim.AdamW(foreach=True)`` and ``fused=True`` over ordinary fp32 tensors of
the same sizes, update only. Gradients are refilled (untimed) before every step. Each figure is
the best of ``--reps`` steps; AdamW on CPU is bound by memory bandwidth (~16 bytes read + 12
written per element for the update alone), so the GB/s column counts those 28 bytes (+ 4 read
and 2 written by the refresh, for ours). Wall times are the figure; the CPU column (all threads)
is steadier on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodetrain.config import OptimConfig
from nodetrain.model.hf import Unit
from nodetrain.optim import StoreAdamW
from nodetrain.store import HostStore, StoreLayout

UPDATE_BYTES, OURS_EXTRA_BYTES = 28, 6


def best_step(step, grads: list[torch.Tensor], reps: int) -> tuple[float, float]:
    """Shortest wall and shortest CPU seconds (all threads) of ``step()`` over ``reps`` calls,
    gradients refilled before each; the first call is a warm-up."""
    wall, cpu = [], []
    for _ in range(reps + 1):
        for g in grads:
            g.uniform_(-1e-3, 1e-3)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall[1:]), min(cpu[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--numel", type=int, default=4_000_000, help="elements per unit")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg = OptimConfig()
    n = args.numel
    units = [Unit(i, f"u{i}", (), n, n - 1024) for i in range(args.units)]  # a matrix + a norm each
    shm = tempfile.mkdtemp(prefix="nt-bench-", dir="/dev/shm")
    store = HostStore.create(StoreLayout(tuple(u.numel for u in units), torch.bfloat16), shm, "bench-optim")
    store.unlink()
    ours = StoreAdamW(store, units, cfg)
    ours_grads = [store.grad(u.index) for u in units]
    params = [torch.zeros(s) for u in units for s in (n - 1024, 1024)]
    for p in params:
        p.grad = torch.zeros_like(p)
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    torch_opts = {
        "torch AdamW(foreach=True)": torch.optim.AdamW(params, foreach=True, **kw),
        "torch AdamW(fused=True)": torch.optim.AdamW(params, fused=True, **kw),
    }
    total = args.units * n
    cores = len(os.sched_getaffinity(0))
    print(f"{args.units} units × {n / 1e6:.1f}M fp32 elements ({total / 1e6:.0f}M), best of {args.reps}")
    head = ("threads", "ms/step", "Melem/s", "GB/s", "vs fused", "CPU ms")
    print(f"  {'':44s} " + " ".join(f"{h:>8s}" for h in head))
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        ours_step = lambda: ours.step(cfg.lr, 1.0)  # noqa: E731
        times = {"ours: StoreAdamW.step (+bf16 refresh)": best_step(ours_step, ours_grads, args.reps)}
        for name, opt in torch_opts.items():
            times[name] = best_step(opt.step, [p.grad for p in params], args.reps)
        fused = times["torch AdamW(fused=True)"][0]
        for name, (t, c) in times.items():
            nbytes = UPDATE_BYTES + (OURS_EXTRA_BYTES if name.startswith("ours") else 0)
            print(
                f"  {name:44s} {threads:8d} {t * 1e3:8.1f} {total / t / 1e6:8.1f} "
                f"{total * nbytes / t / 1e9:8.1f} {fused / t:8.2f} {c * 1e3:8.1f}"
            )
    del store
    shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
