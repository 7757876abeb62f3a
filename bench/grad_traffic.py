"""Gradient traffic per step: D2H bytes and host bytes of the gradient path, by micro-batch count.

    python bench/grad_traffic.py                  # llama_10m shape, 2 layers, fp32, 1 rank
    python bench/grad_traffic.py --dtype bfloat16 --layers 4

One rank (gloo, CPU), the same model and step size (``--batch`` sequences of ``--seq-len``), run
with ``pipeline.microbatches`` = 4 and then 8, once with every unit resident
(``stream.device_budget`` large enough) and once all streamed (``device_budget=0``). Each run takes
``--steps`` steps; the figures are the engine's own counters of its last step (metrics.jsonl's
``d2h_bytes``, ``accum_host_bytes``, ``optim_host_bytes``). With every unit resident the gradients
leave the device once per step as fp32 accumulators (DESIGN invariant 8): D2H bytes are the same
for 4 and 8 micro-batches (ratio 1.00) and equal to 4 B × the stage's parameters (llama_10m is
untied: each parameter is bound once); streamed, they grow with the micro-batch count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._engine import base_config, make_engine, model_config

VOCAB = 4096


def step_counters(args, microbatches: int, budget: int) -> tuple[dict, int]:
    """The breakdown of the last of ``args.steps`` steps, and the stage's parameter count."""
    b = args.batch // microbatches
    cfg = base_config(
        model_config(args.model, VOCAB, num_hidden_layers=args.layers),
        train={"seq_len": args.seq_len, "micro_batch_size": b, "steps": 10**6, "dtype": args.dtype},
        pipeline={"microbatches": microbatches},
        stream={"device_budget": budget},
        optim={"lr": 1e-4, "min_lr": 1e-5, "threads": 1, "max_grad_norm": 1.0},
    )
    engine, _ = make_engine(cfg, f"bench-grad-traffic-{microbatches}-{budget}")
    try:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (microbatches, b, args.seq_len + 1), generator=gen)
        x, y = ids[..., :-1].contiguous(), ids[..., 1:].contiguous()  # [M, B, T]
        for step in range(args.steps):
            res = engine.train_step(step, x, y)
        params = sum(u.numel for u in engine.units)
        resident = len(engine.window.resident)
        assert budget == 0 or resident == len(engine.blocks), f"only {resident} units resident"
        return res.breakdown, params
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama_10m")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = f"{args.batch}×{args.seq_len} tokens/step"
    print(f"{args.model} with {args.layers} layers, {shape}, {args.dtype}, 1 rank")
    print(f"  {'':22s} {'M':>3s} {'D2H MB':>9s} {'B/param':>8s} {'accum MB':>9s} {'optim MB':>9s}")
    ratios, per_param = {}, {}
    for name, budget in (("every unit resident", 1 << 40), ("all streamed", 0)):
        d2h = {}
        for m in (4, 8):
            bd, params = step_counters(args, m, budget)
            d2h[m] = bd["d2h_bytes"]
            print(
                f"  {name:22s} {m:3d} {d2h[m] / 1e6:9.3f} {d2h[m] / params:8.2f} "
                f"{bd['accum_host_bytes'] / 1e6:9.3f} {bd['optim_host_bytes'] / 1e6:9.3f}"
            )
        ratios[name], per_param[name] = d2h[8] / d2h[4], d2h[4] / params
        print(f"  {name:22s} D2H bytes per step, M = 8 ÷ M = 4: {ratios[name]:.2f}")
    ok = ratios["every unit resident"] == 1.0 and per_param["every unit resident"] == 4.0
    print(f"  target: resident D2H ratio 1.00 and 4 B/param — {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
