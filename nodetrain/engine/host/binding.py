"""A rank's host cores: their split between gradient accumulation and the optimizer, the OpenMP team
of each worker thread, and binding to the NUMA node of the rank's GPU.

Owns: the fair share of cores per rank (split between the D2H worker and the optimizer thread by
``core.cores.split_cores``), setting one thread's OpenMP team, and reading the NUMA topology from
sysfs. Does not own: the threads themselves (window.py's D2H worker, overlap.py's optimizer thread)
or what they compute.

Each worker sets its own OpenMP team with ``omp_set_num_threads`` (ctypes, per thread) in its
initializer. With more than one NUMA node every thread of the rank is bound
(``os.sched_setaffinity``) to the cores of its GPU's node, read from sysfs, before the host store is
populated (first touch).

Why ctypes, not ``torch.set_num_threads`` or threadpoolctl, and how NUMA binding works with
torchrun's: docs/gpu.md#host-memory-and-cores.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nodetrain.core.cores import CoreSplit, split_cores

__all__ = [
    "bind_rank_threads",
    "NumaBinding",
    "bind_threads",
    "cuda_pci_bus_ids",
    "fair_share_threads",
    "limit_thread",
    "numa_binding",
    "parse_cpulist",
]

log = logging.getLogger(__name__)


def fair_share_threads(ranks_sharing: int = 0) -> int:
    """This process's usable cores (its affinity mask) over the ranks sharing them, at least 1.

    Args:
        ranks_sharing: ranks on these cores; 0 = ``LOCAL_WORLD_SIZE`` (every rank of the node).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = ranks_sharing or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, ranks))


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp/libiomp), found in this process's mappings (Linux)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5")) and ".so" in name:
            return ctypes.CDLL(path)
    return None


def limit_thread(threads: int) -> None:
    """Give the calling thread an OpenMP team of ``threads`` (other threads keep theirs; why
    ctypes and not ``torch.set_num_threads`` or threadpoolctl: docs/gpu.md#host-memory-and-cores)."""
    torch.get_num_threads()  # torch's lazy per-thread init first, so it does not undo ours
    runtime = _openmp_runtime()
    if runtime is None:
        log.warning("no OpenMP runtime found; this worker thread uses torch's thread count")
        return
    runtime.omp_set_num_threads(threads)


# ----------------------------------------------------------------------------- NUMA


def parse_cpulist(text: str) -> list[int]:
    """CPUs of a sysfs cpulist such as ``"0-3,8-11,16"`` (Linux ``cpulist_parse`` format).

    Raises:
        ValueError: a malformed list.
    """
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _node_cpus(sysfs: Path) -> dict[int, list[int]]:
    """NUMA node -> its CPUs (nodes without CPUs, e.g. CXL memory, left out)."""
    out = {}
    for d in sorted((sysfs / "devices/system/node").glob("node[0-9]*")):
        cpus = parse_cpulist((d / "cpulist").read_text()) if (d / "cpulist").exists() else []
        if cpus:
            out[int(d.name[4:])] = cpus
    return out


def _device_node(sysfs: Path, pci_bus_id: str) -> int:
    """NUMA node of a PCI device (-1 when sysfs does not say)."""
    path = sysfs / "bus/pci/devices" / pci_bus_id.lower() / "numa_node"
    return int(path.read_text()) if path.exists() else -1


@dataclass(frozen=True)
class NumaBinding:
    """Where a rank's threads should run."""

    cpus: list[int] | None
    """CPUs to bind every thread of the rank to; None = leave the affinity as it is."""
    ranks_sharing: int
    """Ranks of this node bound to the same CPUs (the divisor of the core share); 0 = all of them."""
    reason: str
    """One line for the start-up log."""


def numa_binding(
    pci_bus_ids: list[str], local_rank: int, sysfs: str | Path = "/sys", allowed: set[int] | None = None
) -> NumaBinding:
    """The CPUs of the NUMA node of ``local_rank``'s GPU, from sysfs (pure: reads files only).

    Args:
        pci_bus_ids: PCI bus id (``"0000:1b:00.0"``) of each local rank's GPU, in local-rank order.
        local_rank: this rank.
        sysfs: the sysfs root (a fake tree in tests).
        allowed: CPUs this process may use (``os.sched_getaffinity(0)``); None = all.
    """
    sysfs = Path(sysfs)
    nodes = _node_cpus(sysfs)
    if len(nodes) <= 1:
        return NumaBinding(None, 0, f"{len(nodes) or 1} NUMA node with CPUs: threads not bound")
    where = [_device_node(sysfs, bus) for bus in pci_bus_ids]
    node = where[local_rank]
    if node not in nodes:
        what = f"GPU {pci_bus_ids[local_rank]} has no NUMA node in sysfs ({node})"
        return NumaBinding(None, 0, f"{len(nodes)} NUMA nodes but {what}: threads not bound")
    cpus, sharing = nodes[node], where.count(node)
    if allowed is not None:
        cpus = [c for c in cpus if c in allowed]
    if not cpus:
        return NumaBinding(
            None,
            0,
            f"node {node} of GPU {pci_bus_ids[local_rank]} has no CPU this process may use: not bound",
        )
    reason = (
        f"{len(nodes)} NUMA nodes: local rank {local_rank}'s GPU {pci_bus_ids[local_rank]} is on node "
        f"{node}; threads bound to its {len(cpus)} CPUs ({cpus[0]}-{cpus[-1]}), shared by {sharing} rank(s)"
    )
    return NumaBinding(cpus, sharing, reason)


def cuda_pci_bus_ids() -> list[str]:
    """PCI bus ids of the visible CUDA devices, in device order (``domain:bus:device.0``)."""
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    return out


def bind_threads(cpus: list[int]) -> None:
    """Bind every thread of this process, and those it starts later (they inherit the mask), to
    ``cpus`` (``os.sched_setaffinity`` acts on one thread id at a time)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def bind_rank_threads(
    accum_threads: int, optim_threads: int, device: torch.device, local_rank: int
) -> CoreSplit:
    """Bind this rank's threads to its GPU's NUMA node (more than one node) and split its cores between
    the D2H accumulation and the optimizer (binding.py); both logged, whatever OMP_NUM_THREADS is.

    Args:
        accum_threads, optim_threads: ``stream.accum_threads`` and ``optim.threads`` (0 = auto).
    """
    sharing = 0
    if device.type == "cuda":
        index = device.index if device.index is not None else local_rank
        binding = numa_binding(cuda_pci_bus_ids(), index, allowed=os.sched_getaffinity(0))
        if binding.cpus is not None:
            bind_threads(binding.cpus)
        sharing = binding.ranks_sharing
        log.info("NUMA: %s", binding.reason)
    else:
        log.info("NUMA: device %s is not a GPU: threads not bound", device)
    split = split_cores(fair_share_threads(sharing), accum_threads, optim_threads)
    log.info("%s (OMP_NUM_THREADS=%s)", split.reason, os.environ.get("OMP_NUM_THREADS", "unset"))
    return split
