"""The machine a run is resolved for: a hardware profile, and what the engine measured of it.

Owns: :class:`Machine`, the inputs of ``resolve`` that are not in the config: the profile whose rates
price a step, and per stage the device memory it may use, the host RAM free beside the store, one
device's peak FLOP/s, the optimizer's measured host bytes/s and the split of a rank's cores. The
planner builds it from a profile alone (:meth:`Machine.from_profile`); the engine from what it
measured at start-up (``engine/startup.py``), identical on every rank. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodetrain.config.hardware import HardwareConfig, PlanConfig
from nodetrain.config.schema import Config
from nodetrain.core.cores import CoreSplit, split_cores

__all__ = ["GB", "Machine", "profile_cores", "profile_machine"]

GB = 1e9
"""Bytes in the GB of a profile's figures (decimal, as datasheets and ``psutil`` totals are quoted)."""


def profile_cores(hw: HardwareConfig, num_stages: int, accum_threads: int, optim_threads: int) -> CoreSplit:
    """One rank's core split on profile ``hw``: its ``cores`` over the ranks, split as the engine splits
    a rank's share (``split_cores`` of ``stream.accum_threads`` and ``optim.threads``)."""
    return split_cores(max(1, hw.cores // num_stages), accum_threads, optim_threads)


@dataclass(frozen=True)
class Machine:
    """What ``resolve`` needs of the machine beyond the config (every rank holds the same one).

    Attributes:
        hardware: the profile whose rates price a step (``conf/hardware/``).
        device_bytes: per stage, the device memory it may use, bytes (0: the stage computes on the CPU).
        host_free_bytes: host RAM free beside the host store and the page-locking, bytes (what
            speculative backups must fit in, with every rank's overhead).
        peak_flops: one device's peak FLOP/s in the compute dtype (the engine's measurement or
            datasheet, the lowest of the ranks); 0 = the profile's.
        optimizer_bytes_per_s: per stage, its optimizer thread's measured host bytes/s; empty = the
            profile's rate for the core split.
        cores: one rank's core split (``core.cores.split_cores``).
        on_cpu: the stages compute on the CPU (their "device" memory is host memory).
    """

    hardware: HardwareConfig
    device_bytes: tuple[int, ...]
    host_free_bytes: int
    cores: CoreSplit
    peak_flops: float = 0.0
    optimizer_bytes_per_s: tuple[float, ...] = ()
    on_cpu: bool = False

    @property
    def measured(self) -> bool:
        """The figures come from this machine (the engine), not from a profile alone (the planner)."""
        return bool(self.optimizer_bytes_per_s) or self.peak_flops > 0

    @classmethod
    def from_profile(
        cls, hw: HardwareConfig, plan: PlanConfig, num_stages: int, host_free_bytes: int, cores: CoreSplit
    ) -> Machine:
        """The machine a profile describes: each stage's device memory is the GPU's less
        ``plan.device_reserve_gb`` (0 on a CPU profile).

        Args:
            hw: the profile; plan: the planner's settings; num_stages: stages (one per GPU).
            host_free_bytes: the profile's host RAM less the host store and its page-locking.
            cores: one rank's core split (:func:`profile_cores`).
        """
        device = 0 if hw.gpus_per_node == 0 else int((hw.device_memory_gb - plan.device_reserve_gb) * GB)
        return cls(hw, (device,) * num_stages, host_free_bytes, cores, on_cpu=hw.gpus_per_node == 0)


def profile_machine(cfg: Config, host_free_bytes: int, num_stages: int) -> Machine:
    """The machine ``cfg.hardware`` describes for ``num_stages`` stages (:meth:`Machine.from_profile`),
    its cores split as ``stream.accum_threads`` and ``optim.threads`` ask.

    Args:
        host_free_bytes: the profile's host RAM less the host store and its page-locking
            (``core.fit.profile_host_free_bytes``).
    """
    cores = profile_cores(cfg.hardware, num_stages, cfg.stream.accum_threads, cfg.optim.threads)
    return Machine.from_profile(cfg.hardware, cfg.plan, num_stages, host_free_bytes, cores)
