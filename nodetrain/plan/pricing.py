"""A config's step time on its hardware profile: which of the profile's rates price which work.

Owns: the host side one rank sees (``host_rates``: its link, the node's DRAM, the engine's core
split) and the step priced from a profile (``priced_step``: the compute dtype's rates, a CPU
profile's one core per rank, the update mode the engine runs). Does not own: the arithmetic
(``step_time.py``, ``compute.py``), the node's memory (``planner.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodetrain.config.schema import Config
from nodetrain.engine.host_threads import split_cores
from nodetrain.engine.policy import update_kind
from nodetrain.plan.costs import speculative_backup_bytes
from nodetrain.plan.exposure import choose_speculative
from nodetrain.plan.step_time import HostRates, StepTime, step_time

if TYPE_CHECKING:
    from nodetrain.plan.planner import _Node

__all__ = ["host_rates", "priced_step"]

GB = 1e9
"""Bytes in the GB of the profile's figures (decimal, as datasheets quote them)."""


def host_rates(cfg: Config, num_stages: int) -> HostRates:
    """The host side of one rank: its link (a CPU profile's copy bandwidth shared by its ranks), the
    node's DRAM bandwidth shared by all ranks, and the engine's split of its cores (``cores`` /
    ranks, ``host_threads.split_cores`` of ``stream.accum_threads`` and ``optim.threads``)."""
    hw = cfg.hardware
    share = 1 if hw.gpus_per_node else num_stages
    split = split_cores(max(1, hw.cores // num_stages), cfg.stream.accum_threads, cfg.optim.threads)
    return HostRates(
        link_bytes_per_s=hw.host_link_gbps * GB / share,
        host_bytes_per_s=hw.host_memory_bandwidth_gbps * GB,
        core_bytes_per_s=hw.core_memory_bandwidth_gbps * GB,
        ranks=num_stages,
        accum_threads=split.accum_threads,
        optim_threads=split.optim_threads,
        nvme_read_bytes_per_s=hw.nvme_read_gbps * GB,
        nvme_write_bytes_per_s=hw.nvme_write_gbps * GB,
    )


def priced_step(cfg: Config, node: _Node, b: int, resident: list[frozenset[int]]) -> StepTime:
    """The step time of ``node`` at micro-batch size ``b``. Matmuls run at the compute dtype's peak
    (``hardware.fp32_flops`` in fp32) × ``matmul_efficiency``, attention at ``attention_flops`` (or
    ``fp32_attention_flops``; 0: as matmuls), elementwise kernels at the device's memory bandwidth. A
    CPU profile's ranks each compute on one thread (torchrun's ``OMP_NUM_THREADS=1``): a core's share
    of those rates, its elementwise kernels at one core's (``device_memory_bandwidth_gbps``, else
    ``core_memory_bandwidth_gbps``), ``layer_overhead_s`` per layer and micro-batch, and every thread of
    every rank on the node's ``cores`` (``shared_cores``). With ``store.tier=nvme`` the tier's bytes are
    read and written at the profile's NVMe rates, with ``stream.offload_activations`` the saved inputs
    cross the host link. The optimizer is priced in the mode the
    engine runs (``plan.overlap_optimizer=false``: serial); ``optim.speculative=auto`` as the engine
    chooses it (``exposure.choose_speculative``), from this profile's rates instead of its measurement."""
    hw, num_stages = cfg.hardware, len(node.stage_blocks)
    fp32 = node.itemsize == 4
    peak = (hw.fp32_flops or hw.peak_flops) if fp32 else hw.peak_flops
    attention = hw.fp32_attention_flops if fp32 else hw.attention_flops
    share = 1 if hw.gpus_per_node else hw.cores  # one thread per rank: a core's share of the peak
    bandwidth = hw.device_memory_bandwidth_gbps or (
        0.0 if hw.gpus_per_node else hw.core_memory_bandwidth_gbps
    )
    kind = update_kind(cfg.optim) if cfg.plan.overlap_optimizer else "serial"
    nvme = hw.nvme_read_gbps > 0 and hw.nvme_write_gbps > 0  # else the plan refuses the tier, unpriced

    def priced(mode: str) -> StepTime:
        return step_time(
            node.shape,
            node.stage_blocks,
            b=b,
            t=node.seq_len,
            m=node.microbatches,
            g=node.grad_accum,
            itemsize=node.itemsize,
            flops_per_s=peak * hw.matmul_efficiency / share,
            rates=host_rates(cfg, num_stages),
            update_mode=mode,
            schedule=node.schedule,
            resident=resident,
            attention_flops_per_s=attention / share,
            elementwise_bytes_per_s=bandwidth * GB,
            layer_overhead_s=hw.layer_overhead_s,
            shared_cores=0 if hw.gpus_per_node else hw.cores,
            tier_bytes_per_param=node.tier_bytes / node.shape.num_params if nvme else 0.0,
            offload_activations=node.offload_activations,
        )

    if kind != "auto":
        return priced(kind)
    deferred, speculative = priced("deferred"), priced("speculative")
    fits = (
        node.ram_store_bytes + node.overhead_bytes + speculative_backup_bytes(node.shape, True)
        <= node.host_bytes
    )
    return speculative if choose_speculative(deferred.step_s, speculative.step_s, fits) else deferred
