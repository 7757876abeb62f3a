"""The NVMe tier on CPU: its I/O rate against plain sequential I/O, and its step time against RAM.

    python bench/tier_io.py                                  # tier_dir: a temp dir under /tmp (on disk)
    python bench/tier_io.py --tier-dir /mnt/nvme/tier --io-units 16 --io-numel 16777216

1. I/O (``store.tier=nvme``'s own code, optim/tier_files.py): ``--io-units`` units of ``--io-numel``
   parameters (``optim.state=full``: fp32 master, exp_avg, exp_avg_sq = 12 B/param in the file) are
   written back (``TierFile.write_unit``: pwrite from the pool slot mapped over the store range,
   then unmapped) and read (``map_unit`` + ``read_unit``: preadv into the slot), against a plain
   sequential O_DIRECT write and read of the same bytes on the same disk (8 MiB requests from one
   page-aligned buffer, as ``dd oflag=direct bs=8M``). ``--io-rounds`` interleaved rounds (which goes
   first alternates); median GB/s each.
   Goal: tier ÷ plain ≥ 0.7 both ways (issue 23).
2. Step time (``model=llama_10m``, fp32, one stage in this process, clipping on: deferred updates):
   an engine with ``store.tier=ram`` and one with ``store.tier=nvme`` run interleaved blocks of
   steps on the same batch; median step time of each. The tier moves 2 × its file's bytes per step
   (every unit read and written back once); it is hidden when that I/O at the rates of part 1 takes
   less than the step (what the planner prices: overlapped work costs its maximum, not its sum).
   Goal: tier ÷ RAM ≤ 1.15 at such a batch.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._engine import base_config, bench_args, make_engine, median_time, model_config, random_batch
from nodetrain.optim.tier_files import TierFile, TierLayout
from nodetrain.store import HostStore, StoreLayout

VOCAB = 4096
CHUNK = 8 << 20
GOAL_IO, GOAL_STEP = 0.7, 1.15


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _plain(path: Path, nbytes: int) -> tuple[float, float]:
    """Seconds of a sequential O_DIRECT write, then read, of ``nbytes`` (8 MiB requests)."""
    raw = torch.empty(CHUNK + 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    buf = memoryview(raw[start : start + CHUNK].numpy())
    buf[:] = b"\x5a" * CHUNK
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)

        def write() -> None:
            for off in range(0, nbytes, CHUNK):
                assert os.pwrite(fd, buf[: min(CHUNK, nbytes - off)], off) == min(CHUNK, nbytes - off)

        def read() -> None:
            for off in range(0, nbytes, CHUNK):
                assert os.preadv(fd, [buf[: min(CHUNK, nbytes - off)]], off) == min(CHUNK, nbytes - off)

        return _timed(write), _timed(read)
    finally:
        os.close(fd)
        path.unlink()


def io_rates(args, tier_dir: Path) -> dict[str, float]:
    """GB/s of the tier's write-back and read and of plain O_DIRECT sequential I/O (medians)."""
    layout = StoreLayout((args.io_numel,) * args.io_units, torch.bfloat16)
    shm = Path(tempfile.mkdtemp(prefix="nt-bench-", dir="/dev/shm"))
    store = HostStore.create(layout, shm, "bench-tier", populate=False)
    store.unlink()
    os.rmdir(shm)
    tier = TierFile.create(TierLayout(layout), store, tier_dir, "bench-tier")
    tier.unlink()
    print(f"I/O: {tier.layout.nbytes / 1e9:.2f} GB in {tier_dir} (O_DIRECT: {tier.direct})")
    units = range(args.io_units)
    tier.open_pool(args.io_units, units)  # one slot per unit (a run has store.tier_buffers of them)
    for u in units:
        tier.map_unit(u, u)
        for f in ("master", "exp_avg", "exp_avg_sq"):
            store.buffer(u, f).normal_()

    def read_all() -> None:
        for u in units:
            tier.map_unit(u, u)  # as the pool does before each read
            tier.read_unit(u)

    times = {k: [] for k in ("tier write", "tier read", "plain write", "plain read")}
    nbytes = tier.layout.nbytes
    for i in range(args.io_rounds):  # alternating which goes first: neither always finds the disk idle
        for kind in ("tier", "plain") if i % 2 == 0 else ("plain", "tier"):
            if kind == "tier":
                times["tier write"].append(_timed(lambda: [tier.write_unit(u) for u in units]))
                times["tier read"].append(_timed(read_all))
            else:
                w, r = _plain(tier_dir / "plain.bin", nbytes)
                times["plain write"].append(w)
                times["plain read"].append(r)
    tier.close()
    store.close()
    rates = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    for way in ("write", "read"):
        ratio = rates[f"tier {way}"] / rates[f"plain {way}"]
        verdict = "met" if ratio >= GOAL_IO else "MISSED"
        print(
            f"  {way:5s}: tier {rates[f'tier {way}']:.2f} GB/s, plain O_DIRECT {rates[f'plain {way}']:.2f} "
            f"GB/s → tier ÷ plain {ratio:.2f} (goal ≥ {GOAL_IO}: {verdict})"
        )
    return rates


def step_ratio(args, tier_dir: Path, rates: dict[str, float]) -> None:
    x, y = random_batch(args, VOCAB)  # [M, B, T] each
    m, b = x.shape[:2]
    mcfg, engines, fns = model_config(args.model, VOCAB), {}, {}
    for tier in ("ram", "nvme"):
        cfg = base_config(
            mcfg,
            train={"seq_len": args.seq_len, "micro_batch_size": b, "steps": 10**6, "dtype": "float32"},
            pipeline={"microbatches": m},
            optim={"lr": 1e-4, "min_lr": 1e-5, "threads": 1, "max_grad_norm": 1.0, "speculative": False},
            store={"tier": tier, "tier_dir": str(tier_dir), "tier_buffers": args.tier_buffers},
        )
        engines[tier] = engine = make_engine(cfg, f"bench-tier-{tier}")[0]
        step = iter(range(10**6))
        fns[tier] = lambda engine=engine, step=step: engine.train_step(next(step), x, y)
    for fn in fns.values():  # warm-up
        fn()
    wall = {k: [] for k in fns}
    for _ in range(3):  # interleaved blocks: a load change on the machine hits both
        for k, fn in fns.items():
            wall[k].append(median_time(fn, args.reps)[0])
    med = {k: statistics.median(v) for k, v in wall.items()}
    moved = 2 * engines["nvme"].optimizer.tier.layout.nbytes
    io_s = moved / 2 / (rates["tier read"] * 1e9) + moved / 2 / (rates["tier write"] * 1e9)
    ratio = med["nvme"] / med["ram"]
    print(
        f"step: {args.model}, {args.batch}×{args.seq_len} tokens/step, fp32, {args.threads} compute "
        f"thread(s), store.tier_buffers={args.tier_buffers}"
    )
    hidden = "hidden" if io_s < med["ram"] else "NOT hidden"
    print(
        f"  tier I/O {moved / 1e6:.0f} MB/step = {io_s * 1e3:.0f} ms at part 1's rates vs a "
        f"{med['ram'] * 1e3:.0f} ms step: {hidden} by the planner's rule"
    )
    print(
        f"  step ms: ram {med['ram'] * 1e3:.0f}, nvme {med['nvme'] * 1e3:.0f} → tier ÷ RAM {ratio:.3f} "
        f"(goal ≤ {GOAL_STEP}: {'met' if ratio <= GOAL_STEP else 'MISSED'})"
    )
    for e in engines.values():
        e.close()


def main() -> None:
    ap = bench_args(__doc__.splitlines()[0], microbatches=1)
    ap.add_argument("--tier-dir", default="", help="directory on the drive to measure (default: under /tmp)")
    ap.add_argument("--io-units", type=int, default=8)
    ap.add_argument("--io-numel", type=int, default=8 << 20, help="parameters per unit of part 1")
    ap.add_argument("--io-rounds", type=int, default=5)
    ap.add_argument("--tier-buffers", type=int, default=4)
    args = ap.parse_args()
    tier_dir = Path(args.tier_dir or tempfile.mkdtemp(prefix="nt-bench-tier-", dir="/tmp"))
    rates = io_rates(args, tier_dir)
    step_ratio(args, tier_dir, rates)
    if not args.tier_dir:
        os.rmdir(tier_dir)


if __name__ == "__main__":
    main()
