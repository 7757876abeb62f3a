"""What a rank measures of its machine at start-up, shared so that every rank resolves the same run.

Owns: the hardware profile of the host side (the one naming this GPU, else the run's), this rank's
peak FLOP/s (``startup.peak_flops``), the device memory it may use (its share of the free memory of a
device several ranks may share), its optimizer's host bytes/s (timed on scratch buffers on its
optimizer thread's OpenMP team, when ``optim.speculative=auto`` needs it), the host RAM available, and
the one all-reduce that gives every rank every rank's figures: a :class:`~nodetrain.core.machine.Machine`.
Collective over the world. Does not own what is decided from it (``core.run_shape.resolve``).

Why, and the default job's figures: docs/optimizer.md#speculative-updates.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch
import torch.distributed as dist

from nodetrain.config.hardware import HardwareConfig
from nodetrain.config.schema import Config
from nodetrain.core.cores import CoreSplit
from nodetrain.core.machine import Machine
from nodetrain.core.placement import ranks_on_device
from nodetrain.core.topology import Topology
from nodetrain.core.update import speculation_applies
from nodetrain.cost.memory import store_layout
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.tier import ram_store_bytes
from nodetrain.engine.host.binding import limit_thread
from nodetrain.optim.adamw import chunk_numel
from nodetrain.run.breakdown import hardware_profiles

__all__ = ["SCRATCH_NUMEL", "adamw_bytes_per_s", "free_device_bytes", "host_profile", "measure_machine"]

log = logging.getLogger(__name__)

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
                [p],
                [g],
                [m],
                [v],
                [],
                [step],
                amsgrad=False,
                lr=1e-3,
                beta1=0.9,
                beta2=0.95,
                weight_decay=0.1,
                eps=1e-8,
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )
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


_HOST_KEYS = (
    "matmul_efficiency",
    "host_link_gbps",
    "host_memory_bandwidth_gbps",
    "core_memory_bandwidth_gbps",
)


def host_profile(hardware: HardwareConfig, device: torch.device):
    """The hardware profile for the host side: the one naming this GPU (as MFU's peak is found), else
    the run's ``hardware``, else (a config built without it: MISSING figures) the shipped ``cpu``."""
    profiles = [_typed(p) for p in hardware_profiles()]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).strip().lower()
        for prof in [hardware, *profiles]:
            if name in [n.strip().lower() for n in (getattr(prof, "device_names", None) or [])]:
                return prof
    if all(isinstance(getattr(hardware, k, None), int | float) for k in _HOST_KEYS):
        return hardware
    return next(p for p in profiles if p.name == "cpu")


def _typed(profile) -> HardwareConfig:
    """A profile YAML as loaded (``hardware_profiles``) with the schema's defaults for what it leaves out."""
    from omegaconf import OmegaConf  # the engine keeps omegaconf off its step's path

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), profile))


def free_device_bytes(device: torch.device) -> int:
    """This rank's share of the free memory of its CUDA device (read now: after the process group and
    the peak measurement's cached blocks are settled), split evenly among the node's ranks on the same
    device (:func:`~nodetrain.core.placement.ranks_on_device`; logged); 0 on the CPU.

    A rank sharing the device that reads the free memory after another allocated takes a smaller
    share, never a larger one, so the ranks together stay within what was free."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ranks = ranks_on_device(device.index or 0, local, torch.cuda.device_count())
    log.info("device memory: %.2f GB free / %d rank(s) on %s", free / 1e9, ranks, device)
    return free // max(ranks, 1)


def _share(comm, topo: Topology, figures: list[float]) -> list[list[float]]:
    """Every rank's ``figures`` (one all-reduce, a sum of each rank's figures at its own slots):
    ``out[k][rank]`` is rank ``rank``'s k-th figure."""
    w, k = topo.world_size, len(figures)
    flat = [0.0] * (w * k)
    for i, x in enumerate(figures):
        flat[i * w + topo.rank] = float(x)
    total = comm.tensor(flat)
    comm.all_reduce(total)
    got = total.tolist()
    return [got[i * w : (i + 1) * w] for i in range(k)]


def measure_machine(
    cfg: Config, shape: ModelShape, topo: Topology, device: torch.device, split: CoreSplit, comm, peak: float
) -> Machine:
    """The machine every rank resolves the run for: each rank's measurements, shared.

    Per stage the device memory is the least of its replicas' shares (:func:`free_device_bytes`) and the
    optimizer rate the slowest of its replicas' (:func:`adamw_bytes_per_s` on ``split.optim_threads``,
    timed by every rank together: their optimizers share the node's DRAM in a run too; only when
    ``optim.speculative=auto`` can speculate); the peak is the lowest rank's and the host RAM free the
    least any rank sees less the host store's RAM (measured before the store exists). Collective over
    the world.

    Args:
        cfg: the run; shape: its model (sizes the timed buffers: a stage's share of the parameters);
        topo: this rank's place; device: its compute device; split: its core split;
        comm: its ``Comm``; peak: this rank's peak FLOP/s (``startup.peak_flops``).
    """
    rate = 0.0
    if speculation_applies(cfg):
        dist.barrier()
        numel = min(SCRATCH_NUMEL, max(shape.num_params // topo.num_stages, _MIN_NUMEL))
        rate = adamw_bytes_per_s(split.optim_threads, numel, getattr(torch, cfg.train.dtype))
    free = free_device_bytes(device)
    layout = store_layout(shape, getattr(torch, cfg.train.dtype), cfg.optim.state)
    available = psutil.virtual_memory().available - ram_store_bytes(
        layout, cfg.store.tier, cfg.store.tier_buffers
    )
    frees, rates, peaks, availables = _share(comm, topo, [free, rate, peak, available])
    stages = range(topo.num_stages)
    replicas = [[topo.rank_of(r, s) for r in range(topo.num_replicas)] for s in stages]
    return Machine(
        hardware=host_profile(cfg.hardware, device),
        device_bytes=tuple(int(min(frees[k] for k in ranks)) for ranks in replicas),
        host_free_bytes=int(min(availables)),
        cores=split,
        peak_flops=min(peaks),
        optimizer_bytes_per_s=tuple(min(rates[k] for k in ranks) for ranks in replicas) if rate else (),
        on_cpu=device.type != "cuda",
    )
