"""``optim.speculative=auto``: speculative or deferred updates, chosen at start-up by measurement.

Owns: timing this rank's fused AdamW on an OpenMP team of its optimizer thread's size (scratch
buffers, not the store), sharing every rank's figures in one all-reduce (so every rank makes the
same choice, as the replicas of a stage must), checking that the backups fit the node's available
RAM, pricing the step in both modes with the planner's model (``step_time.step_time`` with the measured
rate in place of the profile's and the engine's own peak FLOP/s), and the one log line. Does not
own: the rule (``exposure.choose_speculative``), the model (``plan/exposure.py``) or running the
updates (overlap.py).

Why, and the default job's figures: docs/optimizer.md#speculative-updates.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from nodetrain.config.hardware import HardwareConfig
from nodetrain.config.schema import OptimConfig, PipelineConfig, TrainConfig
from nodetrain.engine.host_threads import CoreSplit, limit_thread
from nodetrain.engine.policy import update_kind
from nodetrain.engine.replicas import Topology
from nodetrain.optim.adamw import chunk_numel
from nodetrain.plan.costs import shape_of, speculative_backup_bytes
from nodetrain.plan.exposure import CLIP_FRACTION, choose_speculative
from nodetrain.plan.step_time import HostRates, step_time
from nodetrain.run.breakdown import hardware_profiles

__all__ = ["SCRATCH_NUMEL", "UpdateChoice", "adamw_bytes_per_s", "choose_update_mode"]

SCRATCH_NUMEL = 1 << 23
"""Elements of the timed update (at most; fewer when the stage owns fewer): 32 MB per fp32 buffer,
~150 MB with the moments, gradient and transfer copy, beyond a server socket's last-level cache."""

_MIN_NUMEL = 1 << 20


def _adamw_seconds(numel: int, dtype: torch.dtype, reps: int) -> float:
    """Best of ``reps`` (after a warm-up that also faults the pages in) of one fused AdamW pass and
    transfer-copy refresh over ``numel`` elements, chunked as ``StoreAdamW.step_unit`` chunks."""
    master, exp_avg, exp_avg_sq = (torch.zeros(numel) for _ in range(3))  # [numel] fp32 each
    grad = torch.full((numel,), 1e-3)
    compute = torch.empty(numel, dtype=dtype)
    step = torch.zeros(())
    size = chunk_numel() or numel
    chunks = [
        tuple(x[lo : lo + size] for x in (master, grad, exp_avg, exp_avg_sq, compute))
        for lo in range(0, numel, size)
    ]
    best = float("inf")
    for rep in range(reps + 1):
        step += 1  # a step count of 0 would divide by a zero bias correction
        t0 = time.perf_counter()
        for p, g, m, v, c in chunks:
            torch._fused_adamw_(
                [p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.95,
                weight_decay=0.1, eps=1e-8, maximize=False, grad_scale=None, found_inf=None,
            )  # fmt: skip
            c.copy_(p)
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best


def adamw_bytes_per_s(threads: int, numel: int, dtype: torch.dtype, reps: int = 3) -> float:
    """Host bytes/s of the optimizer's kernels on an OpenMP team of ``threads``.

    Times ``torch._fused_adamw_`` (the kernel of ``StoreAdamW.step_unit``) and the transfer-copy
    refresh on fresh scratch buffers, on a thread of its own with that team (the caller's is left
    alone), and counts the bytes they move per element: AdamW reads 16 and writes 12, the refresh
    reads 4 and writes ``dtype``'s size.

    Args:
        threads: the optimizer thread's OpenMP team (``CoreSplit.optim_threads``).
        numel: elements of each scratch buffer (fp32; the transfer copy in ``dtype``).
        dtype: the compute dtype.
    """
    with ThreadPoolExecutor(1, "optim-timing", initializer=limit_thread, initargs=(threads,)) as pool:
        seconds = pool.submit(_adamw_seconds, numel, dtype, reps).result()
    return numel * (32 + dtype.itemsize) / seconds


@dataclass(frozen=True)
class UpdateChoice:
    """What ``optim.speculative`` became on this run, and the line that says why."""

    speculative: bool
    line: str


_HOST_KEYS = (
    "matmul_efficiency",
    "host_link_gbps",
    "host_memory_bandwidth_gbps",
    "core_memory_bandwidth_gbps",
)


def _profile(hardware: HardwareConfig, device: torch.device):
    """The hardware profile for the host side: the one naming this GPU (as MFU's peak is found), else
    the run's ``hardware``, else (a config built without it: MISSING figures) the shipped ``cpu``."""
    profiles = hardware_profiles()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).strip().lower()
        for prof in [hardware, *profiles]:
            if name in [n.strip().lower() for n in (getattr(prof, "device_names", None) or [])]:
                return prof
    if all(isinstance(getattr(hardware, k, None), int | float) for k in _HOST_KEYS):
        return hardware
    return next(p for p in profiles if p.name == "cpu")


@dataclass(frozen=True)
class _Shared:
    """Every rank's figures after the all-reduce: the same on every rank."""

    rates: list[float]
    """Per stage, its optimizer's host bytes/s (the slowest of its replicas)."""
    peak_flops: float
    """The lowest of the ranks' peaks (a measured matmul differs from rank to rank)."""
    fits: bool
    """Every rank found the node's backups fit its available RAM."""
    resident: set[int]
    """Blocks some stage keeps resident."""


def _share(comm, topo: Topology, rate: float, peak: float, fits: bool, resident, num_units: int) -> _Shared:
    """One all-reduce (a sum) of [each rank's rate at its rank, each rank's peak at world + its rank,
    1 per rank that fits, resident flags]."""
    w = topo.world_size
    figures = [0.0] * (2 * w + 1 + num_units)
    figures[topo.rank], figures[w + topo.rank] = rate, peak
    figures[2 * w] = float(fits)
    for i in resident:
        figures[2 * w + 1 + i] = 1.0
    total = comm.tensor(figures)
    comm.all_reduce(total)
    got = total.tolist()
    rates = [min(got[topo.rank_of(k, s)] for k in range(topo.num_replicas)) for s in range(topo.num_stages)]
    held = {i for i in range(num_units) if got[2 * w + 1 + i] > 0}
    return _Shared(rates, min(got[w : 2 * w]), got[2 * w] == w, held)


def _host_rates(hw, device: torch.device, num_stages: int, split: CoreSplit) -> HostRates:
    """The host side as ``plan.host_rates`` sees it, from profile ``hw`` and this rank's core split."""
    share = 1 if device.type == "cuda" else num_stages  # CPU ranks share the copy bandwidth
    return HostRates(
        link_bytes_per_s=hw.host_link_gbps * 1e9 / share,
        host_bytes_per_s=hw.host_memory_bandwidth_gbps * 1e9,
        core_bytes_per_s=hw.core_memory_bandwidth_gbps * 1e9,
        ranks=num_stages,
        accum_threads=split.accum_threads,
        optim_threads=split.optim_threads,
    )


def _without_measuring(o: OptimConfig, tier: str) -> UpdateChoice | None:
    """The choice when no measurement is needed (a fixed ``optim.speculative``, or ``auto`` where
    speculation cannot apply), else None."""
    if o.speculative != "auto":
        return UpdateChoice(o.speculative is True, "")
    if update_kind(o) != "auto":
        why = "speculation needs optim.overlap, clipping and optim.update_in_backward"
    elif o.state == "lean":
        why = "optim.state=lean keeps no fp32 state to back up"
    elif tier == "nvme":
        why = "store.tier=nvme keeps the fp32 state a backup would copy out of host RAM"
    else:
        return None
    return UpdateChoice(False, f"optim.speculative=auto: {why}; not speculating")


def choose_update_mode(
    o: OptimConfig,
    model,
    *,
    train: TrainConfig,
    pipeline: PipelineConfig,
    hardware: HardwareConfig,
    rank_overhead_gb: float,
    stage_blocks: list[range],
    topo: Topology,
    comm,
    peak_flops: float,
    split: CoreSplit,
    resident,
    grad_accum: int,
    device: torch.device,
    tier: str = "ram",
) -> UpdateChoice:
    """Resolve ``optim.speculative``; collective over the world when it is ``auto`` and applies.

    Args:
        o, train, pipeline, hardware: the run's sections; rank_overhead_gb: ``plan.rank_overhead_gb``;
            model: the HF adapter; stage_blocks: every stage's blocks (``partition``).
        topo: this rank's place; comm: its ``Comm``; peak_flops: one device's peak (the engine's MFU
            denominator), times ``matmul_efficiency`` of the host-side profile; split: this rank's
            cores; resident: this rank's resident blocks; grad_accum: rounds per step.
        device: the compute device; tier: ``store.tier``.

    Returns:
        the choice; a ``true``/``false`` config is returned as is, with an empty line.
    """
    if (fixed := _without_measuring(o, tier)) is not None:
        return fixed
    shape, dtype = shape_of(model), getattr(torch, train.dtype)
    own = sum(shape.unit_numels[i] for i in stage_blocks[topo.stage])
    dist.barrier()  # every rank times together: their optimizers share the node's DRAM in a run too
    rate = adamw_bytes_per_s(split.optim_threads, min(SCRATCH_NUMEL, max(own, _MIN_NUMEL)), dtype)
    backup = speculative_backup_bytes(shape, True)  # all ranks of the node (one stage each)
    headroom = topo.num_stages * int(rank_overhead_gb * 1e9)  # windows, activations to come
    available = psutil.virtual_memory().available
    fits = backup + headroom <= available
    got = _share(comm, topo, rate, peak_flops, fits, resident, len(shape.unit_numels))
    hw = _profile(hardware, device)
    kw = dict(
        b=train.micro_batch_size, t=train.seq_len, m=pipeline.microbatches, g=grad_accum,
        itemsize=dtype.itemsize, flops_per_s=got.peak_flops * hw.matmul_efficiency,
        rates=_host_rates(hw, device, topo.num_stages, split), schedule=pipeline.schedule,
        resident=[frozenset(got.resident & set(b)) for b in stage_blocks], optim_bytes_per_s=got.rates,
    )  # fmt: skip
    deferred = step_time(shape, stage_blocks, update_mode="deferred", **kw)
    spec = step_time(shape, stage_blocks, update_mode="speculative", **kw)
    chosen = choose_speculative(deferred.step_s, spec.step_s, got.fits)
    memory = (backup, headroom, available)
    return UpdateChoice(chosen, _line(got, split, kw["flops_per_s"], hw.name, deferred, spec, memory, chosen))


def _line(got: _Shared, split: CoreSplit, flops_per_s: float, hw_name: str, deferred, spec, memory,
          chosen: bool) -> str:  # fmt: skip
    """The start-up line: the measured rate, both modes' exposed optimizer and step, the backups'
    fit in RAM (``memory``: backup, headroom and available bytes), and the choice."""
    backup, headroom, available = memory
    x, ms = spec.exposure, 1e3
    return (
        f"optim.speculative=auto: AdamW {min(got.rates) / 1e9:.1f} GB/s on {split.optim_threads} "
        f"thread(s) (measured, slowest rank), compute {flops_per_s / 1e12:.3g} TFLOP/s (lowest peak × "
        f"hardware={hw_name}'s matmul_efficiency); optimizer the next step waits for: deferred "
        f"{deferred.optimizer_exposed_s * ms:,.1f} ms, speculative {spec.optimizer_exposed_s * ms:,.1f} ms "
        f"({x.speculative_s * ms:,.1f} unclipped, {x.speculative_clipped_s * ms:,.1f} clipped, "
        f"{CLIP_FRACTION:.0%} of steps assumed to clip); step {deferred.step_s * ms:,.1f} vs "
        f"{spec.step_s * ms:,.1f} ms; backups {backup / 1e9:.3g} GB (+ {headroom / 1e9:.3g} GB headroom) "
        f"{'fit' if got.fits else 'do not fit'} in the available RAM ({available / 1e9:.1f} GB here) "
        f"→ {'speculative' if chosen else 'deferred'} updates"
    )
