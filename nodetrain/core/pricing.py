"""A step priced on a machine: which of its rates price which work, in the update mode asked for.

Owns: the host side one rank sees (:func:`host_rates`: its link, the node's DRAM, its core split)
and the step priced from a :class:`~nodetrain.core.machine.Machine` (:func:`priced_step`: the compute
dtype's rates, a CPU machine's one core per rank, the NVMe tier, the measured optimizer rate and
peak where the engine measured them). The engine's choices (the automatic batch, speculative updates)
and the planner's report both price through here. Does not own the arithmetic (cost/step_time.py,
cost/compute.py) or choosing (batch.py, run_shape.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from nodetrain.config.schema import Config
from nodetrain.core.machine import GB, Machine
from nodetrain.cost.memory import store_layout
from nodetrain.cost.rates import HostRates
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.step_time import StepTime, step_time
from nodetrain.cost.tier import tier_bytes
from nodetrain.cost.work import StageWork

__all__ = ["host_rates", "matmul_flops", "priced_step"]


def host_rates(machine: Machine, num_stages: int) -> HostRates:
    """The host side of one rank: its link (a CPU machine's copy bandwidth shared by its ranks), the
    node's DRAM bandwidth shared by all ranks, and its core split (``machine.cores``)."""
    hw = machine.hardware
    share = num_stages if machine.on_cpu else 1
    return HostRates(
        link_bytes_per_s=hw.host_link_gbps * GB / share,
        host_bytes_per_s=hw.host_memory_bandwidth_gbps * GB,
        core_bytes_per_s=hw.core_memory_bandwidth_gbps * GB,
        ranks=num_stages,
        accum_threads=machine.cores.accum_threads,
        optim_threads=machine.cores.optim_threads,
        nvme_read_bytes_per_s=hw.nvme_read_gbps * GB,
        nvme_write_bytes_per_s=hw.nvme_write_gbps * GB,
        accum_bytes_per_s=hw.accum_gbps * GB,
        optim_bytes_per_s=hw.optimizer_gbps * GB,
        d2h_link_bytes_per_s=hw.host_link_d2h_gbps * GB / share,
        gated_link_bytes_per_s=hw.host_link_gated_gbps * GB / share,
    )


def _tier_per_param(cfg: Config, shape: ModelShape, dtype: torch.dtype, hw) -> float:
    """NVMe bytes per parameter read and written once a step (``store.tier=nvme`` on a profile ``hw``
    with NVMe rates; else 0: the plan refuses the tier, unpriced)."""
    if cfg.store.tier != "nvme" or not (hw.nvme_read_gbps > 0 and hw.nvme_write_gbps > 0):
        return 0.0
    tier, _ = tier_bytes(store_layout(shape, dtype, cfg.optim.state), cfg.store.tier_buffers)
    return tier / shape.num_params


def matmul_flops(cfg: Config, machine: Machine) -> float:
    """Achieved matmul FLOP/s of one rank's device: its peak in the compute dtype (``machine.peak_flops``
    when measured, else the profile's: ``hardware.fp32_flops`` in fp32, a core's share on a CPU machine)
    × ``hardware.matmul_efficiency``."""
    hw = machine.hardware
    share = hw.cores if machine.on_cpu else 1  # one thread per rank: a core's share of the peak
    fp32 = cfg.train.dtype == "float32"
    peak = machine.peak_flops or ((hw.fp32_flops or hw.peak_flops) if fp32 else hw.peak_flops) / share
    return peak * hw.matmul_efficiency


def priced_step(
    cfg: Config, shape: ModelShape, works: list[StageWork], machine: Machine, mode: str, b: int
) -> StepTime:
    """The step of ``works`` (one per stage) at micro-batch size ``b`` on ``machine``, in update ``mode``.

    Matmuls run at the machine's peak (``machine.peak_flops`` when measured, else the profile's in the
    compute dtype: ``hardware.fp32_flops`` in fp32) × ``matmul_efficiency``, attention at
    ``attention_flops`` (or ``fp32_attention_flops``; 0: as matmuls), elementwise kernels at the
    device's memory bandwidth. A CPU machine's ranks each compute on one thread (torchrun's
    ``OMP_NUM_THREADS=1``): a core's share of the profile's rates (a measured peak is already one
    rank's), its elementwise kernels at one core's (``device_memory_bandwidth_gbps``, else
    ``core_memory_bandwidth_gbps``), ``layer_overhead_s`` per layer and micro-batch, and every thread
    of every rank on the node's ``cores`` (``shared_cores``). The AdamW of units kept on the device
    (``optim.on_device``) streams at ``hbm_bandwidth_gbps`` (else the elementwise rate). With
    ``store.tier=nvme`` the tier's bytes are read and written at the profile's NVMe rates, with
    ``stream.offload_activations`` the saved inputs cross the host link; with ``stream.accum_help``
    the idle optimizer thread's team helps the host accumulation (``cost.rates.helped_share``).

    Args:
        cfg: the run (``train.seq_len``, ``train.dtype``, ``store``, ``stream.offload_activations``,
            ``stream.accum_help``);
        shape: the model; works: per stage, its step (``StepPlan.work``); machine: what prices it;
        mode: ``serial``, ``deferred``, ``in_backward`` or ``speculative`` (``cost.exposure.MODES``);
        b: sequences per micro-batch.
    """
    hw, dtype = machine.hardware, getattr(torch, cfg.train.dtype)
    fp32 = dtype.itemsize == 4
    share = hw.cores if machine.on_cpu else 1  # one thread per rank: a core's share of the peak
    attention = hw.fp32_attention_flops if fp32 else hw.attention_flops
    bandwidth = hw.device_memory_bandwidth_gbps or (hw.core_memory_bandwidth_gbps if machine.on_cpu else 0.0)
    return step_time(
        shape,
        works,
        b=b,
        t=cfg.train.seq_len,
        itemsize=dtype.itemsize,
        flops_per_s=matmul_flops(cfg, machine),
        rates=replace(host_rates(machine, len(works)), accum_help=cfg.stream.accum_help),
        update_mode=mode,
        optim_bytes_per_s=list(machine.optimizer_bytes_per_s) or None,
        attention_flops_per_s=attention / share,
        elementwise_bytes_per_s=bandwidth * GB,
        layer_overhead_s=hw.layer_overhead_s,
        shared_cores=hw.cores if machine.on_cpu else 0,
        tier_bytes_per_param=_tier_per_param(cfg, shape, dtype, hw),
        offload_activations=cfg.stream.offload_activations,
        slots=cfg.stream.slots,
        device_optimizer_bytes_per_s=(hw.hbm_bandwidth_gbps or bandwidth) * GB,
    )
