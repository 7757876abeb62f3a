"""``bench/cpu_optimizer.py --state lean``: LeanAdamW vs torchao and bitsandbytes on CPU, elements/s.

Every row updates ``units × numel`` elements from gradients refilled (untimed) before each round, rows
interleaved round by round, best of ``reps``; round 0 warms up (and compiles torchao's step). A library
that does not import is reported and skipped.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import torch

from nodetrain.config.schema import OptimConfig
from nodetrain.model.hf import Unit
from nodetrain.optim.lean import LeanAdamW
from nodetrain.optim.quant import dequantize_blockwise, quantize_blockwise, stochastic_round_bf16
from nodetrain.store import HostStore, StoreLayout


def _library_rows(units: list[Unit], cfg: OptimConfig, lr: float) -> tuple[dict, list[torch.Tensor]]:
    """torchao / bitsandbytes optimizers over bf16 parameters of the same sizes, and their grads."""
    rows, grads = {}, []
    kw = {"lr": lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        for name, cls in (
            ("torchao AdamW4bit, bf16 SR", AdamW4bit),
            ("torchao AdamW8bit, bf16 SR", AdamW8bit),
        ):
            params = [torch.nn.Parameter(torch.randn(u.numel, dtype=torch.bfloat16)) for u in units]
            for p in params:
                p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            rows[name] = cls(params, bf16_stochastic_round=True, **kw).step
    except Exception as e:  # an import or a backend error: say so, keep the others
        print(f"  torchao: skipped ({type(e).__name__}: {str(e)[:120]})")
    try:
        import bitsandbytes as bnb

        params = [torch.nn.Parameter(torch.randn(u.numel, dtype=torch.bfloat16)) for u in units]
        for p in params:
            p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        opt = bnb.optim.AdamW8bit(params, min_8bit_size=0, **kw)
        opt.step()  # probe: a backend without a CPU kernel raises here
        rows["bitsandbytes AdamW8bit (bf16 params)"] = opt.step
    except Exception as e:
        print(f"  bitsandbytes: skipped ({type(e).__name__}: {str(e)[:120]})")
    return rows, grads


def _piece_rows(n: int) -> dict:
    """Quantize + dequantize one 8-bit moment, and stochastic rounding, ours vs the libraries'."""
    x, out = torch.randn(n), torch.empty(n)
    codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // 2048))
    w16, gen = torch.empty(n, dtype=torch.bfloat16), torch.Generator().manual_seed(0)
    rows = {
        "piece ours: 8-bit quantize + dequantize": lambda: (
            quantize_blockwise(x, codes, absmax, 2048, 8, False),
            dequantize_blockwise(codes, absmax, n, 2048, 8, False, out),
        ),
        "piece ours: stochastic round to bf16": lambda: stochastic_round_bf16(x.clone(), w16, gen),
    }
    try:
        import bitsandbytes.functional as F

        def bnb_q():
            q, state = F.quantize_blockwise(x, blocksize=2048)
            F.dequantize_blockwise(q, state)

        rows["piece bitsandbytes: 8-bit quantize + dequantize"] = bnb_q
    except Exception as e:
        print(f"  bitsandbytes pieces: skipped ({type(e).__name__})")
    try:
        from torchao.optim.quant_utils import _fp32_to_bf16_sr

        rows["piece torchao: stochastic round to bf16"] = lambda: _fp32_to_bf16_sr(x)
    except Exception as e:
        print(f"  torchao pieces: skipped ({type(e).__name__})")
    return rows


def main(args) -> None:
    cfg, n, lr = OptimConfig(), args.numel, OptimConfig().lr
    units = [Unit(i, f"u{i}", (), n, n - 1024) for i in range(args.units)]
    shm = tempfile.mkdtemp(prefix="nt-bench-", dir="/dev/shm")
    layout = StoreLayout(tuple(u.numel for u in units), torch.bfloat16, state="lean")
    store = HostStore.create(layout, shm, "bench-lean")
    store.unlink()
    ours = LeanAdamW(store, units, cfg)
    for u in units:
        ours.load_unit(u.index, torch.randn(n))
    grads = [store.grad(u.index) for u in units]
    rows = {"ours: LeanAdamW (4/8-bit, bf16 SR)": lambda: [ours.step_unit(u.index, lr) for u in units]}
    lib, lib_grads = _library_rows(units, cfg, lr)
    rows.update(lib)
    pieces = _piece_rows(n)
    total = args.units * n
    print(f"optim.state=lean: {args.units} units × {n / 1e6:.1f}M elements, best of {args.reps}")
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        best = {name: float("inf") for name in [*rows, *pieces]}
        for _ in range(args.reps + 1):
            for name, step in [*rows.items(), *pieces.items()]:
                for g in grads + lib_grads:
                    g.uniform_(-1e-3, 1e-3)
                t0 = time.perf_counter()
                step()
                best[name] = min(best[name], time.perf_counter() - t0)
        for name, t in best.items():
            elems = n if name.startswith("piece") else total
            print(f"  {name:48s} threads {threads}  {t * 1e3:9.1f} ms  {elems / t / 1e6:9.1f} Melem/s")
    del store
    shutil.rmtree(shm, ignore_errors=True)
