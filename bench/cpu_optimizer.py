"""CPU optimizer throughput: our fused pass over the host store vs torch's fused AdamW, elements/s.

    python bench/cpu_optimizer.py                       # 8 units × 4M fp32 elements, 1 and all threads
    python bench/cpu_optimizer.py --units 16 --numel 8000000
    python bench/cpu_optimizer.py --chunk 1048576   # optim.CHUNK_NUMEL
    python bench/cpu_optimizer.py --state lean      # optim.state=lean vs torchao / bitsandbytes

All rows run on the same tensors (the store's master weights, gradients and moments), interleaved
rep by rep so a busy neighbour slows every row alike; each figure is the best of ``--reps``:

- torch AdamW(fused=True): the update alone, one call over every unit (the reference, "vs fused" 1.00).
- before: what ``StoreAdamW.step_unit`` did until issue 14: ``g.mul_(coef)``, fused AdamW over the
  whole unit, then ``compute.copy_(master)`` (three passes over memory).
- ours: ``step_unit(unit, lr, coef, found_inf)`` (optim.py): clip scale and finiteness flag in the
  fused kernel, the bf16 refresh chunk by chunk while the chunk is in cache; coef = 1 (no clip) and
  0.5 (the kernel then also writes the scaled gradient back, as ``mul_`` did).
- pieces: the bf16 refresh alone and the clip scale alone, each a separate pass over all units.

``--state lean`` (bench/lean_rows.py) times ``LeanAdamW`` (optim/lean.py) against the libraries that
offer the same formats on CPU, when importable: torchao's ``AdamW4bit`` / ``AdamW8bit`` with
``bf16_stochastic_round`` (bf16 weights, torch.compile'd step) and bitsandbytes' ``AdamW8bit``, and
the pieces (block-wise quantize + dequantize, stochastic rounding) against their library twins.

AdamW on CPU moves ~16 bytes read + 12 written per element; the refresh adds 2 written (+2 read for
ownership of the destination's cache line), the clip 4 written; the GB/s column counts each row's
bytes that must come from or go to DRAM. Wall times are the figure; the CPU columns (all threads;
"CPU vs": torch fused's CPU seconds ÷ the row's) are steadier on a shared machine at 1 thread (at 2,
OpenMP threads spinning at a barrier while the other is descheduled count as CPU time).
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
from nodetrain.config.schema import OptimConfig
from nodetrain.model.hf import Unit
from nodetrain.optim import adamw as optim
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.store import HostStore, StoreLayout

UPDATE_BYTES, REFRESH_BYTES, CLIP_BYTES = 28, 2, 4
FUSED = "torch AdamW(fused=True)"


def best_times(rows: dict, grads: list[torch.Tensor], reps: int) -> dict[str, tuple[float, float]]:
    """Per row, the shortest wall and CPU seconds (all threads) of its step over ``reps`` rounds, the
    rows interleaved within a round, gradients refilled (untimed) before each; round 0 warms up."""
    wall = {name: [] for name in rows}
    cpu = {name: [] for name in rows}
    for _ in range(reps + 1):
        for name, step in rows.items():
            for g in grads:
                g.uniform_(-1e-3, 1e-3)
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: (min(wall[name][1:]), min(cpu[name][1:])) for name in rows}


def _rows(ours: StoreAdamW, store: HostStore, units: list[Unit], lr: float) -> dict[str, tuple]:
    """Row name -> (step function, DRAM bytes per element)."""
    decay = [p for u in units for p, _ in ours._params[u.index][:1]]
    no_decay = [p for u in units for p, _ in ours._params[u.index][1:]]
    groups = [
        {"params": decay, "weight_decay": ours.cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = torch.optim.AdamW(
        groups, lr=lr, betas=(ours.cfg.beta1, ours.cfg.beta2), eps=ours.cfg.eps, fused=True
    )
    for u in units:  # the same moments as ours (the step counts are its own)
        for p, _ in ours._params[u.index]:
            st = ours._opts[u.index].state[p]
            fused.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": st["exp_avg"],
                "exp_avg_sq": st["exp_avg_sq"],
            }
    found_inf = torch.zeros(())

    def before():
        for u in units:
            store.grad(u.index).mul_(0.5)
        fused.step()
        for u in units:
            store.compute(u.index).copy_(store.master(u.index))

    def ours_step(coef):
        return lambda: [ours.step_unit(u.index, lr, coef, found_inf) for u in units]

    return {
        FUSED: (fused.step, UPDATE_BYTES),
        "before: mul_(0.5) + fused + copy_": (before, UPDATE_BYTES + CLIP_BYTES + 4 + 2 * REFRESH_BYTES),
        "ours: flag + AdamW + bf16, coef 1": (ours_step(1.0), UPDATE_BYTES + 2 * REFRESH_BYTES),
        "ours: flag + clip + AdamW + bf16, coef 0.5": (
            ours_step(0.5),
            UPDATE_BYTES + CLIP_BYTES + 2 * REFRESH_BYTES,
        ),
        "piece: bf16 refresh alone (copy_)": (
            lambda: [store.compute(u.index).copy_(store.master(u.index)) for u in units],
            4 + 2 * REFRESH_BYTES,
        ),
        "piece: clip scale alone (mul_)": (lambda: [store.grad(u.index).mul_(0.5) for u in units], 8),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--numel", type=int, default=4_000_000, help="elements per unit")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=optim.CHUNK_NUMEL, help="elements")
    ap.add_argument("--state", default="full", choices=("full", "lean"))
    args = ap.parse_args()
    if args.state == "lean":
        from lean_rows import main as lean_main

        return lean_main(args)
    optim.CHUNK_NUMEL = args.chunk
    cfg = OptimConfig()
    n = args.numel
    units = [Unit(i, f"u{i}", (), n, n - 1024) for i in range(args.units)]  # a matrix + a norm each
    shm = tempfile.mkdtemp(prefix="nt-bench-", dir="/dev/shm")
    store = HostStore.create(StoreLayout(tuple(u.numel for u in units), torch.bfloat16), shm, "bench-optim")
    store.unlink()
    ours = StoreAdamW(store, units, cfg)
    rows = _rows(ours, store, units, cfg.lr)
    total = args.units * n
    cores = len(os.sched_getaffinity(0))
    print(
        f"{args.units} units × {n / 1e6:.1f}M fp32 elements ({total / 1e6:.0f}M), best of {args.reps}, "
        f"chunks of {args.chunk} elements (1 thread only)"
    )
    head = ("threads", "ms/step", "Melem/s", "GB/s", "vs fused", "CPU ms", "CPU vs")
    print(f"  {'':44s} " + " ".join(f"{h:>8s}" for h in head))
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        grads = [store.grad(u.index) for u in units]
        times = best_times({name: step for name, (step, _) in rows.items()}, grads, args.reps)
        fused, fused_cpu = times[FUSED]
        for name, (t, c) in times.items():
            nbytes = rows[name][1]
            print(
                f"  {name:44s} {threads:8d} {t * 1e3:8.1f} {total / t / 1e6:8.1f} "
                f"{total * nbytes / t / 1e9:8.1f} {fused / t:8.2f} {c * 1e3:8.1f} {fused_cpu / c:8.2f}"
            )
    del store
    shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
