"""Saved block inputs on the device with and without ``stream.offload_activations``, side by side.

    python bench/activation_offload.py                     # llama_10m, fp32, GPipe, M = 2, 4, 8
    python bench/activation_offload.py --microbatches 4 16 --seq-len 512

One stage in this process (gloo, CPU), GPipe (every micro-batch of the round in flight), the window
streaming every unit. For each M an engine without and one with the offload run alternating blocks of steps
on the same tokens; printed per M: the saved inputs' device high-water mark of each
(``saved_peak_bytes``, measured by weak references to every saved tensor) and their ratio (goal:
with the offload at most two micro-batches' worth, flat in M), the bytes the offload moved each way
per step, the host buffers, and the median step time (wall and CPU) with ÷ without. On CPU the
"device" is host memory and the copies are host copies: the time ratio shows the extra work of the
copies, not a GPU's overlap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._engine import base_config, make_engine, median_time, model_config

VOCAB = 4096


def compare(mcfg, args, m: int) -> tuple[dict, dict]:
    """Engines without and with the offload at M = ``m``, stepped in alternating blocks; returns
    each one's last step breakdown and (median wall s, median CPU s), keyed by the offload's flag."""
    ids = torch.randint(
        0, VOCAB, (m, args.micro_batch, args.seq_len + 1), generator=torch.Generator().manual_seed(m)
    )
    x, y = ids[..., :-1].contiguous(), ids[..., 1:].contiguous()  # [M, B, T] each
    last, steps, engines = {}, {}, {}
    for on in (False, True):
        cfg = base_config(
            mcfg,
            train={
                "seq_len": args.seq_len,
                "micro_batch_size": args.micro_batch,
                "steps": 10**6,
                "dtype": "float32",
            },
            pipeline={"microbatches": m, "schedule": "gpipe"},
            stream={"device_budget": 0, "offload_activations": on},
        )
        engines[on], steps[on] = make_engine(cfg, f"bench-offload-{m}-{on}")[0], iter(range(10**6))

    def step(on: bool) -> None:
        last[on] = engines[on].train_step(next(steps[on]), x, y).breakdown

    times = {on: ([], []) for on in engines}
    for on in engines:  # warm-up
        step(on)
    for _ in range(3):  # alternating blocks: a load change on the machine hits both
        for on, (wall, cpu) in times.items():
            w, c = median_time(lambda on=on: step(on), args.reps)
            wall.append(w)
            cpu.append(c)
    for engine in engines.values():
        engine.close()
    return last, {on: (statistics.median(w), statistics.median(c)) for on, (w, c) in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama_10m")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=2, help="steps per block; three blocks each")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mcfg = model_config(args.model, VOCAB)
    print(f"{args.model}, GPipe, {args.micro_batch}×{args.seq_len} tokens per micro-batch, fp32, 1 stage")
    print(
        f"  {'M':>3s} {'saved MB off':>12s} {'on':>7s} {'on÷off':>7s} {'moved MB':>9s} {'host MB':>8s} "
        f"{'wall on÷off':>11s} {'CPU on÷off':>10s}"
    )
    for m in args.microbatches:
        last, times = compare(mcfg, args, m)
        off_b, on_b = last[False]["stage0/saved_peak_bytes"], last[True]["stage0/saved_peak_bytes"]
        moved, host = last[True]["stage0/act_d2h_bytes"], last[True]["stage0/saved_host_bytes"]
        wall, cpu = (times[True][i] / times[False][i] for i in (0, 1))
        print(
            f"  {m:3d} {off_b / 1e6:12.2f} {on_b / 1e6:7.2f} {on_b / off_b:7.2f} {moved / 1e6:9.2f} "
            f"{host / 1e6:8.2f} {wall:11.2f} {cpu:10.2f}"
        )


if __name__ == "__main__":
    main()
