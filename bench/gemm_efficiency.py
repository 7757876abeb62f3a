"""Matmul efficiency of a model's own shapes: the fraction of a device's peak its layer's GEMMs reach,
the figure a profile's ``hardware.matmul_efficiency`` holds.

    python bench/gemm_efficiency.py model=llama3_2_3b hardware=h200_1gpu \
        train.micro_batch_size=2 train.seq_len=4096
    python bench/gemm_efficiency.py model=llama_10m hardware=cpu train.seq_len=256 --seconds 0.5   # CPU

Composes the config as training does (any override), takes the decoder layer's weight shapes from the
planner's model (``ModelShape``: q, k, v, o [D, H·Q] / [D, K·Q], gate and up [D, F], down [F, D]) and
n = B·T tokens, and times, in the run's dtype on CUDA when there is one, each GEMM's forward
[n, in] @ [in, out] and the backward's two ([n, out] @ [out, in] for the input's gradient, [in, n] @
[n, out] for the weight's), 2·n·in·out FLOPs each, the best of a ``--seconds`` window after a warm-up
(``torch.cuda.synchronize`` around each call). Prints each shape's TFLOP/s and the layer's total FLOPs
over its total seconds against ``hardware.peak_flops`` (``fp32_flops`` in fp32): the efficiency.
The first GPU run's compute phase gave 0.47 on an H200 (conf/hardware/h200_1gpu.yaml), recompute
counted; this measures the GEMMs alone, an upper bound (attention and elementwise kernels aside).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hydra import compose, initialize_config_dir  # noqa: E402

from nodetrain.config.registry import register_configs, to_typed  # noqa: E402
from nodetrain.plan.planner import make_plan  # noqa: E402


def _best_s(fn, seconds: float, cuda: bool) -> float:
    fn()
    best, t0 = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - t0 < seconds:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    args = sys.argv[1:]
    seconds = float(next((a.split("=")[1] for a in args if a.startswith("--seconds=")), "1.0"))
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_typed(compose("config", overrides=[a for a in args if not a.startswith("--")]))
    s = make_plan(cfg).shape
    n, dtype = cfg.train.micro_batch_size * cfg.train.seq_len, getattr(torch, cfg.train.dtype)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)  # a CPU rank computes on one thread (torchrun's OMP_NUM_THREADS=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    d, q, kv, f = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    shapes = {
        "q": (d, q),
        "k": (d, kv),
        "v": (d, kv),
        "o": (q, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
    flops = seconds_total = 0.0
    for name, (i, o) in shapes.items():
        x, w = torch.randn(n, i, dtype=dtype, device=device), torch.randn(i, o, dtype=dtype, device=device)
        g = torch.randn(n, o, dtype=dtype, device=device)
        calls = (
            ("fwd", lambda x=x, w=w: x @ w),
            ("dx", lambda g=g, w=w: g @ w.T),
            ("dw", lambda x=x, g=g: x.T @ g),
        )
        for what, fn in calls:
            sec = _best_s(fn, seconds, cuda)
            flops, seconds_total = flops + 2 * n * i * o, seconds_total + sec
            print(f"{name:>5} {what:<3} [{n}, {i}] @ [{i}, {o}]: {2 * n * i * o / sec / 1e12:8.2f} TFLOP/s")
    hw = cfg.hardware
    peak = (hw.fp32_flops or hw.peak_flops) if dtype == torch.float32 else hw.peak_flops
    if not cuda and hw.gpus_per_node == 0:
        peak /= hw.cores  # one rank computes on one thread of a CPU profile's node
    rate = flops / seconds_total
    print(f"layer GEMMs: {rate / 1e12:.2f} TFLOP/s on {device} of {peak / 1e12:.1f} peak ({hw.name})")
    print(f"matmul_efficiency: {rate / peak:.3f}")


if __name__ == "__main__":
    main()
