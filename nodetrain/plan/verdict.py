"""The planner's verdict: why a plan cannot start on its hardware, and what would make it faster.

Owns: the problems (each with its numbers and a fix) and the hints a ``Plan`` prints. Does not own:
the figures they quote (``planner.py``, ``core/fit.py``, ``cost/``), printing (``report.py``).
"""

from __future__ import annotations

import math

from nodetrain.config.schema import Config
from nodetrain.core.batch import BatchShape
from nodetrain.core.fit import NodeFit
from nodetrain.cost.memory import StageMemory
from nodetrain.cost.step_time import StepTime

__all__ = ["problems", "hints", "tier_problems"]

GB = 1e9


def tier_problems(hw, tier: int, capacity_gb: float) -> list[str]:
    """Why the tier cannot run on profile ``hw`` (empty when it can): no NVMe rates or capacity, or
    ``tier`` bytes over the drives' ``capacity_gb``."""
    missing = [k for k in ("nvme_read_gbps", "nvme_write_gbps", "nvme_capacity_gb") if not getattr(hw, k) > 0]
    if missing:
        return [
            f"store.tier=nvme: hardware={hw.name} has no NVMe tier "
            f"({', '.join(f'hardware.{k}=0' for k in missing)}); set the drives' datasheet figures "
            "(GB/s, GB; nodetrain/config/hardware.py) or use store.tier=ram"
        ]
    if tier > capacity_gb * 1e9:
        return [
            f"store.tier=nvme: the tier needs {tier / 1e9:,.0f} GB but hardware.nvme_capacity_gb="
            f"{capacity_gb:,.0f}; use optim.state=lean (fewer tier bytes) or larger drives"
        ]
    return []


def problems(
    cfg: Config, node: NodeFit, batch: BatchShape, stages: list[StageMemory], host_need: int, max_b: int
) -> list[str]:
    """Why the run cannot start on this hardware, each with its numbers and a fix."""
    hw, b, host = cfg.hardware, batch.micro_batch_size, node.host_bytes
    problems = tier_problems(hw, node.tier_bytes, hw.nvme_capacity_gb) if cfg.store.tier == "nvme" else []
    if node.ram_store_bytes + node.overhead_bytes > host:
        per_param = node.ram_store_bytes / node.shape.num_params
        largest = (host - node.overhead_bytes) / per_param
        problems.append(
            f"host memory: the host store needs {node.ram_store_bytes / GB:,.0f} GB ({per_param:.1f} "
            f"bytes/param) + {node.overhead_bytes / GB:.1f} GB rank overhead, but {hw.name} has "
            f"{host / GB:,.0f} GB; the largest model that fits is ~{largest / 1e9:,.1f}B parameters"
        )
        if node.cpu:
            return problems
    if max_b >= b:
        return problems
    worst = max(stages, key=lambda x: x.total_bytes)
    limit, need = (host, host_need) if node.cpu else (node.device_limit_bytes, worst.total_bytes)
    fixes = (
        [f"use train.micro_batch_size={max_b}"] if max_b else ["shorten train.seq_len", "lower stream.slots"]
    )
    if cfg.pipeline.wave > 1:  # W micro-batches' saved inputs (and kept graphs) per item in flight
        fixes.append(f"use a smaller pipeline.wave (now {cfg.pipeline.wave}; the wave line names what fits)")
    if cfg.stream.recompute is False:
        fixes.append("set stream.recompute=auto")
    fixes += [] if max_b else ["use more stages"]
    fix = ", ".join(fixes[:-1]) + " or " + fixes[-1] if len(fixes) > 1 else fixes[0]
    problems.append(
        f"{'host' if node.cpu else 'device'} memory at train.micro_batch_size={b}: needs {need / GB:,.1f} GB "
        f"(stage {worst.stage}: window {worst.window_bytes / GB:.2f} + activations "
        f"{worst.activation_bytes / GB:.2f} GB) but {limit / GB:,.1f} GB is usable; {fix}"
    )
    return problems


def hints(batch: BatchShape, t: StepTime, max_b: int, num_stages: int) -> list[str]:
    """What would make the step faster."""
    tr, hints = batch, []
    if t.bottleneck in ("H2D", "D2H"):
        ratio = max(t.h2d_s, t.d2h_s) / t.compute_s
        tokens = math.ceil(ratio * tr.micro_batch_size * tr.seq_len)
        hints.append(
            f"streaming takes {ratio:.1f}× the compute: ≥ {tokens:,} tokens per micro-batch "
            "(train.micro_batch_size × train.seq_len) would hide it"
        )
    if t.bubble_s > 0.25 * t.step_s:
        hints.append(
            f"the pipeline bubble is {t.bubble_s / t.step_s:.0%} of the step: raise pipeline.microbatches "
            f"(now {batch.microbatches}) to ≥ {4 * (num_stages - 1)}"
        )
    if t.bottleneck == "optimizer cores":
        hints.append(
            "the CPU AdamW is bound by its cores: raise optim.threads, or more tokens per step amortise it"
        )
    if t.bottleneck == "host DRAM":
        hints.append(
            "host DRAM carries every rank's D2H, accumulation and optimizer bytes: keep more units resident "
            "(stream.device_budget) or more tokens per step amortise the optimizer"
        )
    if t.bottleneck == "shared cores":
        hints.append(
            "the stages share the node's cores: all their compute, copies, accumulation and optimizer "
            "work over hardware.cores bounds the step; fewer stages do not make it shorter"
        )
    if t.bottleneck == "host accumulation":
        hints.append(
            "the D2H worker's gradient adds are the slot: raise stream.accum_threads or keep units resident"
        )
    if max_b > tr.micro_batch_size:
        hints.append(f"up to train.micro_batch_size={max_b} fits")
    return hints
