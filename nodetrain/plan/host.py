"""Start-up host check: refuse, before anything is allocated, a host store this node cannot hold.

Owns: the arithmetic of whether a store fits the node's RAM and its directory (``host_problems``) and
the check a training run makes on one rank per node (``preflight``). Does not own: the store's
bytes (``cost/memory.py``), what a whole plan reports (``planner.py``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import torch

from nodetrain.config.schema import Config, ConfigError
from nodetrain.config.tier_checks import tier_dir_problem, tier_space_problem
from nodetrain.core.update import update_kind
from nodetrain.cost.memory import field_bytes, pin_overhead_bytes, store_layout
from nodetrain.cost.shape import shape_of
from nodetrain.cost.tier import ram_store_bytes
from nodetrain.cost.tier import tier_bytes as nvme_bytes  # the name tier_bytes is a local below
from nodetrain.cost.traffic import speculative_backup_bytes
from nodetrain.model import HFModel
from nodetrain.run.inject import NO_FAULTS, Faults
from nodetrain.store import remove_stale_stores

__all__ = ["host_problems", "preflight"]

GB = 1e9
"""Bytes in the GB of every figure here (decimal, as ``psutil`` totals are quoted)."""


def _size(nbytes: float) -> str:
    """``nbytes`` as GB with one decimal, or as MB (kB) when that would print "0.0 GB" (decimal units)."""
    for unit, scale in (("GB", GB), ("MB", 1e6)):
        if nbytes >= 0.1 * scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e3:.1f} kB"


def host_problems(
    store_bytes: int,
    world_size: int,
    rank_overhead_bytes: int,
    available_bytes: int,
    free_bytes: int,
    store_dir,
) -> list[str]:
    """Why a host store cannot be created (empty when it can); pure arithmetic on given numbers.

    The node needs ``store_bytes + world_size × rank_overhead_bytes`` of host memory, and the store
    file needs ``store_bytes`` of free space in ``store_dir`` (tmpfs counts its own limit). Pinned
    memory adds nothing: on CUDA the store itself is page-locked in place (``cudaHostRegister``), and
    the per-rank overhead covers the window and kept heap.
    """
    need = store_bytes + world_size * rank_overhead_bytes
    fix = (
        "use a smaller model, a node with more RAM (or free what holds it now), or see "
        "`python -m nodetrain.plan` for what fits"
    )
    problems = []
    if need > available_bytes:
        problems.append(
            f"host memory: the host store needs {_size(store_bytes)} + {world_size} rank(s) × "
            f"{rank_overhead_bytes / GB:.2f} GB (plan.rank_overhead_gb) = {_size(need)}, but only "
            f"{_size(available_bytes)} is available; {fix}"
        )
    if store_bytes > free_bytes:
        problems.append(
            f"store.dir={store_dir}: the host store needs {_size(store_bytes)} but the directory has "
            f"{_size(free_bytes)} free; enlarge it (e.g. `mount -o remount,size=<GB>G /dev/shm`) or "
            "point store.dir at a larger RAM-backed filesystem"
        )
    return problems


def preflight(cfg: Config, model: HFModel, world_size: int, faults: Faults = NO_FAULTS) -> int:
    """Refuse, before anything is allocated, a run whose host store cannot fit this node.

    Removes host stores of dead runs from ``store.dir`` first (as ``HostStore.create`` would), so
    their memory counts as available. Call on one rank per node and share the outcome.

    Returns:
        the host store's size in bytes.

    Raises:
        ConfigError: ``store.dir`` or ``store.tier_dir`` does not exist; the store (+ per-rank
            overhead) exceeds the available host memory (``psutil.virtual_memory().available``) or
            the free space of ``store.dir`` (``shutil.disk_usage``); or ``store.tier=nvme``'s file
            exceeds the free space of ``store.tier_dir`` (``os.statvfs``; RAM then holds only the
            rest of the store and the tier's pool). The message gives the numbers and the fix.
    """
    store_dir = Path(cfg.store.dir)
    if not store_dir.is_dir():
        raise ConfigError(f"store.dir={store_dir}: not a directory; create it or use /dev/shm")
    remove_stale_stores(store_dir, remove=cfg.store.cleanup_stale)
    shape = shape_of(model)
    layout = store_layout(shape, getattr(torch, cfg.train.dtype), cfg.optim.state)
    nbytes = ram_bytes = layout.nbytes
    tier_problem = None
    if cfg.store.tier == "nvme":  # RAM holds the rest of the store and the tier's pool
        if missing := tier_dir_problem(cfg.store.tier_dir):
            raise ConfigError(missing)
        ram_bytes = ram_store_bytes(layout, "nvme", cfg.store.tier_buffers)  # the planner's arithmetic
        tier_bytes = nvme_bytes(layout, cfg.store.tier_buffers)[0]
        real = os.statvfs(cfg.store.tier_dir)
        free = faults.seen_tier_free_bytes(real.f_bavail * real.f_frsize)
        tier_problem = tier_space_problem(cfg.store.tier_dir, tier_bytes, free)
    overhead = int(cfg.plan.rank_overhead_gb * GB)
    overhead += speculative_backup_bytes(shape, update_kind(cfg.optim) == "speculative") // world_size
    if torch.cuda.is_available():  # each rank page-locks the transfer copies it loads (HostStore.pin)
        compute = field_bytes(layout)["compute"]
        overhead += pin_overhead_bytes(compute) // world_size
    available = faults.seen_host_available_bytes(psutil.virtual_memory().available)
    free = shutil.disk_usage(store_dir).free
    problems = host_problems(ram_bytes, world_size, overhead, available, free, store_dir)
    problems += [tier_problem] if tier_problem else []
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        n = shape.num_params
        what = f"{n / 1e9:,.2f}B parameters × {nbytes / n:.1f} bytes/param of host store"
        raise ConfigError(f"model {cfg.model.name} ({what}) does not fit this node:\n{lines}")
    return nbytes
