"""One rank of a memory measurement (run under torchrun by ``host_memory.py`` / ``plan_accuracy.py``).

    torchrun --nproc_per_node 2 bench/memory_worker.py '{"overrides": ["model=llama_10m"], "steps": 2}'

Builds the real engine for the composed config (random tokens, no dataset), runs ``steps`` training
steps, and reports, per rank: the host store and window bytes of the engine's objects, the peak
resident growth during the last step (``VmHWM`` − ``VmRSS`` before it, after resetting the peak
through ``/proc/self/clear_refs``; every page of the store is mapped into the rank first, so the
growth is the step's own memory, not store pages the rank happens to touch for the first time),
the wall seconds of the steps between the first and the last (``step_s``) with the engine's
breakdown of each (``breakdowns``: per-stage phase seconds, workers' busy seconds, CPU seconds;
rank 0), and, with ``"calibrate"`` in the spec, the machine's rates right before each step from the
second on (``rates``, see :func:`_calibrate`: a timed step lies between two of them),
and the rank's proportional set size (``Pss`` of ``/proc/self/smaps_rollup``: shared pages divided
among the processes mapping them, so the ranks' PSS add up to the node's memory without counting
the host store twice), after the steps and before the engine is built (``base_pss_bytes``: the
interpreter, torch, transformers and the process group). Rank 0 prints one line ``RESULT <json>``
with every rank's figures.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nodetrain.config.registry import register_configs, to_typed  # noqa: E402
from nodetrain.config.schema import validate  # noqa: E402
from nodetrain.engine.startup import build_engine  # noqa: E402
from nodetrain.plan.planner import model_of  # noqa: E402


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rollup_kb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        out[key.rstrip(":")] = int(value)
    return out


def _map_store(store) -> None:
    """Read one byte of every page of the host store, so that its pages are in this rank's RSS
    before the measured step: a page a rank first maps during the step (e.g. AdamW state first
    touched by the previous step's overlapped update) is store memory, not the step's growth."""
    for unit, name in store.layout.offsets:
        int(store.buffer(unit, name).view(torch.uint8)[::4096].sum())


def _kernels(calibrate: dict) -> list[tuple[str, object, float]]:
    """``cpu_profile.py``'s kernels for ``calibrate`` (``dtype``; the model's shapes: ``matmul``
    (M, K, N), ``attention`` [B, H, T, Q], ``elementwise`` [rows, cols]; ``arch``): (name, call, work
    per call), buffers allocated once."""
    from cpu_profile import workload

    dtype = getattr(torch, calibrate["dtype"])
    kernels = [
        ("matmul", *workload("matmul", dtype, tuple(calibrate["matmul"]))),
        ("attention", *workload("attention", dtype, tuple(calibrate["attention"]))),
        ("elementwise", *workload("elementwise", dtype, tuple(calibrate["elementwise"]))),
        ("overhead", *workload("overhead", dtype, (calibrate["arch"],))),
        ("copy", *workload("copy")),
        ("triad", *workload("triad", torch.float32)),
    ]
    for _, fn, _ in kernels:
        fn()  # warm-up: first-touch of the buffers, lazy initialisation
    return kernels


def _calibrate(kernels, seconds: float = 1.5) -> dict[str, float]:
    """This rank's throughput of each kernel now (FLOP/s, bytes/s; overhead: calls/s) over a window of
    ``seconds``, every rank at the same time (as they compute at once), the kernels taken in turn
    (round-robin) so that each one's figure covers the same moments of a machine whose load moves;
    and per second of this thread's CPU time (``cpu:<name>``: what the work costs, whatever share of
    a core the load leaves)."""
    names = [name for name, _, _ in kernels]
    wall, cpu, calls = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    dist.barrier()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for name, fn, _ in kernels:
            t, c = time.perf_counter(), time.thread_time()
            fn()
            wall[name] += time.perf_counter() - t
            cpu[name] += time.thread_time() - c
            calls[name] += 1
    out = {name: work * calls[name] / wall[name] for name, _, work in kernels}
    return {**out, **{f"cpu:{name}": work * calls[name] / cpu[name] for name, _, work in kernels}}


def _memory(engine, base_pss: int, peak_growth: int, shmem_growth: int) -> dict:
    """This rank's memory figures after the steps (bytes): the engine's objects and ``smaps_rollup``."""
    rollup = _rollup_kb()
    return {
        "store_bytes": engine.store.nbytes,
        "window_bytes": engine.window.nbytes,
        "blocks": list(engine.blocks),
        "peak_growth_bytes": peak_growth,
        "shmem_growth_bytes": shmem_growth,
        "pss_bytes": rollup["Pss"] * 1024,
        "base_pss_bytes": base_pss,
        "pss_shmem_bytes": rollup.get("Pss_Shmem", 0) * 1024,
        "rss_bytes": rollup["Rss"] * 1024,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_typed(compose("config", overrides=spec["overrides"]))
    validate(cfg, world)
    model = model_of(cfg)
    base_pss = _rollup_kb()["Pss"] * 1024  # interpreter, libraries, process group: before any state
    engine = build_engine(
        cfg,
        model,
        rank=rank,
        world_size=world,
        local_rank=int(os.environ["LOCAL_RANK"]),
        run_id=f"bench{os.getppid()}",
        device=torch.device("cpu"),
    )
    num_mb = engine.run.batch.global_microbatches
    shape = (num_mb, cfg.train.micro_batch_size, cfg.train.seq_len)
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, model.config.vocab_size, (shape[0], shape[1], shape[2] + 1), generator=gen)
    x, y = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()
    ends, breakdowns, timed, rates = [time.perf_counter()], [], [], []
    kernels = _kernels(spec["calibrate"]) if "calibrate" in spec else None
    try:
        for step in range(spec.get("steps", 2)):
            last = step == spec.get("steps", 2) - 1
            if kernels and step > 0:  # after the last step's updates, before this one
                engine.wait_optimizer()
                rates.append(_calibrate(kernels))
                dist.barrier()
            t0 = time.perf_counter()
            if last:
                _map_store(engine.store)
                dist.barrier()
                shmem_before = _status_kb("RssShmem")
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
                rss_before = _status_kb("VmRSS")
            breakdowns.append(engine.train_step(step, x, y).breakdown)
            ends.append(time.perf_counter())
            timed.append(ends[-1] - t0)
        peak_growth = (_status_kb("VmHWM") - rss_before) * 1024
        shmem_growth = (_status_kb("RssShmem") - shmem_before) * 1024
        dist.barrier()  # every rank still maps the store while PSS is read
        mine = {
            "rank": rank,
            **_memory(engine, base_pss, peak_growth, shmem_growth),
            # wall seconds between the ends of consecutive steps, from the 2nd step to the one before
            # the last (the last is preceded by the store mapping above); calibrated: of each step
            "step_s": timed[1:-1] if kernels else [b - a for a, b in itertools.pairwise(ends[1:-1])],
            "rates": rates,
            # the engine's own record of those steps (breakdown.combine_stages; rank 0 only, else {})
            "breakdowns": breakdowns[1:-1],
        }
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        dist.barrier()
    finally:
        engine.close()
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
