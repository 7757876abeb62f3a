"""The host side one rank sees, as rates: its link, the node's DRAM and cores, and what was measured.

Owns: :class:`HostRates` (bytes/s of the link per direction, the node's DRAM, one core, the D2H
worker's accumulation, alone and helped by the idle optimizer thread, and the optimizer thread, and
their thread teams). Built from a hardware
profile by ``core/pricing.host_rates``; priced by ``step_time.py``. Does not own the profiles
(``conf/hardware/``) or measuring them (``bench/cpu_profile.py``, ``bench/copy_bandwidth.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostRates", "helped_share"]


@dataclass(frozen=True)
class HostRates:
    """The node's host side as the planner sees one rank's share of it (bytes/s)."""

    link_bytes_per_s: float
    """One device's host link, per direction."""
    host_bytes_per_s: float
    """The node's DRAM bandwidth, shared by all its ranks."""
    core_bytes_per_s: float
    """What one core's stream of loads and stores reaches (``hardware.core_memory_bandwidth_gbps``)."""
    ranks: int
    """Ranks (one per GPU) sharing the node's DRAM and cores."""
    accum_threads: int
    """The D2H worker's OpenMP team (``host_threads.split_cores``)."""
    optim_threads: int
    """The optimizer thread's OpenMP team."""
    nvme_read_bytes_per_s: float = 0.0
    """The node's NVMe drives together, sequential read (``store.tier=nvme``; shared by its ranks)."""
    nvme_write_bytes_per_s: float = 0.0
    """The node's NVMe drives together, sequential write."""
    accum_bytes_per_s: float = 0.0
    """The D2H worker's measured accumulation rate (``hardware.accum_gbps``); 0 = :meth:`rate`."""
    optim_bytes_per_s: float = 0.0
    """The optimizer thread's measured rate (``hardware.optimizer_gbps``); 0 = :meth:`rate`."""
    d2h_link_bytes_per_s: float = 0.0
    """The link device → host when measured apart (``hardware.host_link_d2h_gbps``); 0 = ``link``."""
    gated_link_bytes_per_s: float = 0.0
    """H2D while the CPU AdamW runs on the same DRAM: the step's first, gated loads
    (``hardware.host_link_gated_gbps``); 0 = ``link_bytes_per_s``."""
    accum_help: bool = False
    """Whether the idle optimizer thread takes chunks of the accumulation (``stream.accum_help``): the
    step prices :func:`helped_share` of it at :meth:`helped_accum_rate`; False: all at the worker's."""

    def rate(self, threads: int) -> tuple[float, str]:
        """Bytes/s of a team of ``threads`` on one rank, and what bounds it: its cores, or its share
        of the node's DRAM bandwidth."""
        cores, share = threads * self.core_bytes_per_s, self.host_bytes_per_s / self.ranks
        return (cores, "cores") if cores < share else (share, "host DRAM")

    def accum_rate(self, helped: float = 0.0) -> float:
        """Bytes/s of the D2H worker's accumulation: measured, else :meth:`rate` of its team; with a
        ``helped`` share (0-1) of its bytes added while the optimizer thread is idle and helps
        (``stream.accum_help``), those at :meth:`helped_accum_rate`, the rest at the worker's alone."""
        alone = self.accum_bytes_per_s or self.rate(self.accum_threads)[0]
        if helped <= 0:
            return alone
        return 1.0 / ((1.0 - helped) / alone + helped / self.helped_accum_rate())

    def helped_accum_rate(self) -> float:
        """Bytes/s of the accumulation while the idle optimizer thread's team takes chunks of it
        (engine/host/helper.py): the same kernel on both teams, so the worker's rate per thread
        (measured, else :meth:`rate`) times both teams' threads, capped by the rank's share of the
        node's DRAM (never below the worker's alone). Not the optimizer's AdamW rate: that kernel
        reads and writes four streams and computes, an add is two reads and a write."""
        threads = self.accum_threads + self.optim_threads
        if not self.accum_bytes_per_s:
            return self.rate(threads)[0]
        scaled = self.accum_bytes_per_s * threads / max(self.accum_threads, 1)
        return max(self.accum_bytes_per_s, min(scaled, self.host_bytes_per_s / self.ranks))

    def optim_rate(self) -> tuple[float, str]:
        """Bytes/s of the optimizer thread and its bound: measured (its cores), else :meth:`rate`."""
        if self.optim_bytes_per_s:
            return self.optim_bytes_per_s, "cores"
        return self.rate(self.optim_threads)


def helped_share(update_mode: str, num_items: int) -> float:
    """The share of a stage's host accumulation that runs while its optimizer thread is idle and
    helps (``stream.accum_help``), by ``update_mode`` (``cost.exposure.MODES``) and the step's
    pipeline items (M/W per round, every round): none without an optimizer thread (``serial``); all
    of it when units are updated after the all-reduce (``deferred``: the previous step's updates are
    done in the forward, before the first offloads); in the backward (``in_backward``,
    ``speculative``) units become final, and are updated, in the backward's last pass: the
    (items − 1)/items of the passes before it are helped, the last one's not."""
    if update_mode == "serial":
        return 0.0
    if update_mode == "deferred":
        return 1.0
    return (num_items - 1) / max(num_items, 1)
