"""The planner's config groups: one node's hardware profile (``conf/hardware/``) and the planner's own
settings (``python -m nodetrain.plan``, the start-up memory check). Part of the schema
(nodetrain/config/schema.py re-exports both as fields of ``Config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from nodetrain.config.fields import above, at_least, checked, in_range

__all__ = ["HardwareConfig", "PlanConfig"]


@dataclass
class HardwareConfig:
    """One node's hardware, for the planner (``conf/hardware/``); GB = 1e9 bytes. Every YAML names the
    source of each number in ``source``."""

    name: str = MISSING
    """Profile name, e.g. ``h100_sxm``."""
    peak_flops: float = checked(MISSING, above(0, "the device's dense bf16 FLOP/s"))
    """Dense bf16 peak of one device (one GPU; on a CPU profile the whole CPU), FLOP/s."""
    matmul_efficiency: float = checked(
        0.6, in_range(0, 1, "the default is 0.6", closed_low=False, closed_high=True)
    )
    """Fraction of ``peak_flops`` (``fp32_flops`` in fp32) the model's matmuls reach (an assumption the
    planner prints), (0, 1]."""
    fp32_flops: float = checked(0.0, at_least(0, "use 0 when not known"))
    """Dense fp32 matmul FLOP/s of one device (on a CPU profile the whole CPU) at torch's default
    precision (no TF32 on CUDA), priced when ``train.dtype=float32``; 0 = ``peak_flops``."""
    attention_flops: float = checked(0.0, at_least(0, "use 0 when not known"))
    """FLOP/s of causal attention (SDPA, forward and backward) of one device in bf16/fp16, counted as
    the planner counts it (4·n·T·H·Q per forward; ``bench/cpu_profile.py``); 0 = at the matmuls' rate."""
    fp32_attention_flops: float = checked(0.0, at_least(0, "use 0 when not known"))
    """``attention_flops`` in fp32; 0 = at the fp32 matmuls' rate."""
    device_memory_bandwidth_gbps: float = checked(0.0, at_least(0, "use 0 when not known"))
    """What one device's elementwise kernels (norms, activations, softmax) stream at, GB/s: a GPU's
    memory bandwidth; on a CPU profile one core's rate on activations (``bench/cpu_profile.py``), 0 =
    ``core_memory_bandwidth_gbps``. 0 on a GPU profile: elementwise work not priced."""
    hbm_bandwidth_gbps: float = checked(0.0, at_least(0, "use 0 when not known"))
    """One GPU's memory bandwidth from its datasheet, GB/s (H100 SXM 3,350; H200 4,800): what the
    fused AdamW of units kept on the device (``optim.on_device``) streams at; 0 =
    ``device_memory_bandwidth_gbps``."""
    layer_overhead_s: float = checked(0.0, at_least(0, "use 0 when not known"))
    """Seconds per decoder layer and micro-batch (forward, recompute, backward) that do not shrink
    with the layer: Python, autograd, kernel dispatch (``bench/cpu_profile.py``, on a CPU profile).
    0 on GPU profiles: the host issues kernels ahead of the device, which hides it."""
    device_memory_gb: float = checked(MISSING, at_least(0, "use 0 on a CPU profile"))
    """Memory of one GPU, GB; 0 on a CPU profile (the "device" window then lives in host memory)."""
    host_link_gbps: float = checked(MISSING, above(0, "the host link's GB/s per direction"))
    """Host↔device bandwidth of one device, per direction, GB/s (PCIe; a memcpy on a CPU profile)."""
    host_memory_gb: float = checked(MISSING, above(0, "the node's RAM in GB"))
    """Host RAM of the node, GB."""
    host_memory_bandwidth_gbps: float = checked(MISSING, above(0, "the node's GB/s"))
    """Host memory bandwidth of the node (all sockets), GB/s; bounds the CPU optimizer."""
    cores: int = MISSING
    """CPU cores of the node (≥ 1); each rank gets cores / ranks, split between the gradient
    accumulation and the optimizer as the engine splits them (``host_threads.split_cores``)."""
    core_memory_bandwidth_gbps: float = checked(
        10.0, above(0, "one core's GB/s: bench/cpu_profile.py --threads 1")
    )
    """What one core's stream of loads and stores reaches, GB/s (a one-thread STREAM triad,
    ``bench/cpu_profile.py --threads 1``); a team of k threads reaches k × this, at most the rank's
    share of ``host_memory_bandwidth_gbps``."""
    host_link_d2h_gbps: float = checked(0.0, at_least(0, "use 0 when not known"))
    """Device → host bandwidth of one device when measured apart, GB/s; 0 = ``host_link_gbps``.
    ``bench/copy_bandwidth.py`` measures both (page-locked, each direction alone, and each while the
    other runs) and ``--profile-lines`` prints them as profile lines; the planner prices the two
    directions as independent, each at its own figure."""
    host_link_gated_gbps: float = checked(0.0, at_least(0, "use 0 when not known"))
    """Host → device bandwidth while the CPU AdamW runs on the same DRAM (a step's first loads wait for
    their units' updates and cross beside the optimizer), GB/s; 0 = ``host_link_gbps``."""
    accum_gbps: float = checked(0.0, at_least(0, "use 0 when not known"))
    """One rank's host accumulation (the D2H worker adding gradients into the fp32 accumulators),
    measured, in the planner's accumulation bytes (``cost.traffic.StageTraffic.accum_bytes``) per
    second, GB/s (``bench/cpu_profile.py --host``); 0 = its ``stream.accum_threads`` ×
    ``core_memory_bandwidth_gbps``, at most the rank's share of ``host_memory_bandwidth_gbps``."""
    optimizer_gbps: float = checked(0.0, at_least(0, "use 0 when not known"))
    """One rank's CPU AdamW (with the transfer-copy refresh), measured, in the planner's optimizer bytes
    (``cost.traffic.optimizer_bytes_per_param``) per second, GB/s (``bench/cpu_profile.py --host``);
    0 = its ``optim.threads`` × ``core_memory_bandwidth_gbps``, at most the rank's DRAM share."""
    nvme_read_gbps: float = checked(0.0, at_least(0, "use 0 for a node without NVMe drives"))
    """Sequential read bandwidth of the node's local NVMe drives together (``store.tier=nvme``), GB/s;
    0 = no NVMe tier on this profile."""
    nvme_write_gbps: float = checked(0.0, at_least(0, "use 0 for a node without NVMe drives"))
    """Sequential write bandwidth of those drives together, GB/s; 0 = no NVMe tier."""
    nvme_capacity_gb: float = checked(0.0, at_least(0, "use 0 for a node without NVMe drives"))
    """Capacity of those drives together, GB (the tier's files must fit); 0 = no NVMe tier."""
    gpus_per_node: int = MISSING
    """GPUs of the node; 0 = no accelerator (stages are CPU processes)."""
    device_names: list[str] = field(default_factory=list)
    """``torch.cuda.get_device_name()`` of the profile's GPU (case-insensitive, exact): a run on such
    a GPU measures MFU against this profile's ``peak_flops`` (see ``breakdown.select_peak_flops``)."""
    source: str = ""
    """Where each number comes from (datasheet names/URLs, or the measuring script)."""


@dataclass
class PlanConfig:
    """Planner settings (``python -m nodetrain.plan``) and the training start-up memory check."""

    rank_overhead_gb: float = checked(0.5, at_least(0, "the measured value is 0.5"))
    """Host RAM per rank beyond the host store, the window and the D2H staging buffers (interpreter,
    torch, transformers, gloo, kept heap), GB. Measured per CPU rank by ``bench/plan_accuracy.py``:
    0.28-0.29 GB; the default leaves room for a CUDA rank's context (raise it if that is larger)."""
    device_reserve_gb: float = checked(2.0, at_least(0, "the default is 2.0"))
    """Device memory the planner keeps free (CUDA context, allocator slack), GB."""
    overlap_optimizer: bool = True
    """Plan with the CPU optimizer overlapped with device work (False: added after each step)."""
    train_tokens: float = checked(0.0, at_least(0, "use 0 for 20 tokens per parameter"))
    """Tokens to train for; 0 = 20 × parameters (Chinchilla, arXiv:2203.15556)."""
    days: float = checked(0.0, at_least(0, "use 0 for no deadline"))
    """When > 0, also report the nodes needed to train ``train_tokens`` within this many days."""
