"""Speculative updates with clipping (``optim.speculative``) vs deferred ones, side by side on CPU.

    python bench/speculative.py                          # llama_10m, fp32, 1 compute thread
    python bench/speculative.py --microbatches 4 --reps 6

One rank in this process, the window streaming every unit, clipping on. For each clip threshold
(``--max-norms``: one that bites on these random tokens and one that never does) two engines run
the same steps, interleaved (deferred, speculative, deferred, ...): ``optim.speculative=false``
(every update waits for the step's all-reduce and overlaps the next forward) and ``true`` (updates
during the backward as if unclipped, rolled back and redone when the step clipped). Printed per
variant: the median step time, the median exposed optimizer time (``optim_s``: what the training
thread waited for, StepResult), the optimizer thread's busy time, the share of steps that clipped,
and rollbacks (units a step, and the share of steps with any). With one stage a step that clips
is seen coming (the stage's own norm is the global one): its remaining units are held, not
speculated, so rollbacks stay rare.

Measured (2-core machine shared with other jobs, load average 5–9; step times are noise, the
optimizer columns are the figure), ``--seq-len 32 --batch 2 --reps 4``::

    max_grad_norm speculative   step ms  optim_s ms  busy ms  clipped  rollbacks
    1             false           297.9         2.5     17.8     100%          0
    1             true            134.7         0.4     18.8     100%          0
    1e9           false           135.2         1.7     16.0       0%          0
    1e9           true            143.3         0.4     25.0       0%          0

and with the defaults (8×256 tokens): optim_s 1.9 / 1.5 ms (clipping 11% of steps, 0.89 units
rolled back a step) and 2.0 / 2.9 ms (never clipping) of 6.6–8.8 s steps. On CPU the deferred
updates are already hidden behind the next forward, so speculation has no exposed time to save.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._engine import base_config, bench_args, make_engine, model_config, random_batch

VOCAB = 4096


def make_runs(mcfg, args, xs: torch.Tensor, ys: torch.Tensor) -> tuple[dict, list]:
    """name -> (step function, its StepResults); and the engines, to close."""
    runs, engines = {}, []
    m, b = xs.shape[:2]
    for max_norm in args.max_norms:
        for speculative in (False, True):
            cfg = base_config(
                mcfg,
                train={"seq_len": args.seq_len, "micro_batch_size": b, "steps": 10**6, "dtype": "float32"},
                pipeline={"microbatches": m},
                stream={"device_budget": 0},
                optim={
                    "lr": 1e-4,
                    "min_lr": 1e-5,
                    "warmup_steps": 0,
                    "threads": 1,
                    "max_grad_norm": max_norm,
                    "speculative": speculative,
                },
            )
            engine = make_engine(cfg, f"bench-spec-{max_norm}-{speculative}")[0]
            engines.append(engine)
            results: list = []
            step = iter(range(10**6))

            def run(engine=engine, results=results, step=step) -> None:
                results.append(engine.train_step(next(step), xs, ys))

            runs[f"max_grad_norm={max_norm:g} speculative={str(speculative).lower()}"] = (run, results)
    return runs, engines


def main() -> None:
    ap = bench_args(__doc__.splitlines()[0], microbatches=2)
    ap.add_argument("--max-norms", type=float, nargs="+", default=[1.0, 1e9])
    args = ap.parse_args()
    x, y = random_batch(args, VOCAB)  # [M, B, T] each
    runs, engines = make_runs(model_config(args.model, VOCAB), args, x, y)
    for fn, _ in runs.values():  # warm-up
        fn()
    for _ in range(3):  # interleaved blocks: a load change on the machine hits every variant
        for fn, _results in runs.values():
            for _rep in range(args.reps):
                fn()
    print(
        f"{args.model}, {args.batch}×{args.seq_len} tokens/step, {args.microbatches} micro-batches, fp32, ",
        end="",
    )
    print(f"{args.threads} compute thread(s), {3 * args.reps} steps each after 1 warm-up")
    head = ("step ms", "optim_s ms", "busy ms", "clipped", "rollbacks", "steps rolled")
    print(f"  {'':42s} " + " ".join(f"{h:>12s}" for h in head))
    for name, (_, results) in runs.items():
        timed = results[1:]
        rolled = [r.breakdown["num_rollbacks"] for r in timed]
        row = (
            statistics.median(r.step_s for r in timed) * 1e3,
            statistics.median(r.optim_s for r in timed) * 1e3,
            statistics.median(r.breakdown["optim_busy_s"] for r in timed) * 1e3,
        )
        share = sum(n > 0 for n in rolled) / len(rolled)
        max_norm = float(name.split()[0].split("=")[1])
        clipped = sum(r.grad_norm + 1e-6 > max_norm for r in timed) / len(timed)
        print(f"  {name:42s} " + " ".join(f"{v:12.1f}" for v in row), end="")
        print(f" {clipped:12.0%} {statistics.mean(rolled):12.2f} {share:12.0%}")
        assert all(r.grad_norm > 0 for r in timed)
    for e in engines:
        e.close()


if __name__ == "__main__":
    main()
