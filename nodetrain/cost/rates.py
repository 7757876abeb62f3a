"""The host side one rank sees, as rates: its link, the node's DRAM and cores, and what was measured.

Owns: :class:`HostRates` (bytes/s of the link per direction, the node's DRAM, one core, the D2H
worker's accumulation and the optimizer thread, and their thread teams). Built from a hardware
profile by ``core/pricing.host_rates``; priced by ``step_time.py``. Does not own the profiles
(``conf/hardware/``) or measuring them (``bench/cpu_profile.py``, ``bench/copy_bandwidth.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostRates"]


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

    def rate(self, threads: int) -> tuple[float, str]:
        """Bytes/s of a team of ``threads`` on one rank, and what bounds it: its cores, or its share
        of the node's DRAM bandwidth."""
        cores, share = threads * self.core_bytes_per_s, self.host_bytes_per_s / self.ranks
        return (cores, "cores") if cores < share else (share, "host DRAM")

    def accum_rate(self) -> float:
        """Bytes/s of the D2H worker's accumulation: measured, else :meth:`rate` of its team."""
        return self.accum_bytes_per_s or self.rate(self.accum_threads)[0]

    def optim_rate(self) -> tuple[float, str]:
        """Bytes/s of the optimizer thread and its bound: measured (its cores), else :meth:`rate`."""
        if self.optim_bytes_per_s:
            return self.optim_bytes_per_s, "cores"
        return self.rate(self.optim_threads)
