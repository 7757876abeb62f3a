"""Residency: which of a stage's blocks stay in device memory instead of streaming.

Owns: the device budget for resident blocks (``stream.device_budget``, or the automatic one) and
the choice of blocks that fit it. Does not own: the buffers or the loads (stream.py).

Every byte of a block costs the same H2D traffic per pass (it is loaded for each micro-batch's
forward and backward), so any block kept resident saves ``2 × micro-batches`` loads of its bytes
per step; the choice is first fit in stage order. Gradients of resident blocks still go to the
host store after every backward (fp32 accumulation on the host keeps the arithmetic exact).
"""

from __future__ import annotations

import logging

import torch

from nodetrain.costs import shape_of, stage_memory

__all__ = [
    "resident_blocks",
    "choose_resident",
    "auto_device_budget",
    "device_budget_bytes",
    "stage_activation_bytes",
    "MARGIN_BYTES",
]

log = logging.getLogger(__name__)

MARGIN_BYTES = 2 << 30
"""Device bytes the automatic budget leaves free for the allocator, CUDA context growth and NCCL."""


def choose_resident(block_bytes: dict[int, int], budget: int) -> list[int]:
    """Blocks to keep resident: first fit in block order within ``budget`` bytes.

    Args:
        block_bytes: block index -> device bytes of its bindings (compute dtype).
        budget: bytes available; ≤ 0 keeps nothing resident.
    """
    chosen, left = [], budget
    for block in sorted(block_bytes):
        if 0 < block_bytes[block] <= left:
            chosen.append(block)
            left -= block_bytes[block]
    return chosen


def stage_activation_bytes(cfg, model, blocks, stage: int, num_stages: int, grad_accum: int, device) -> int:
    """Peak activation bytes of this stage: the planner's model (``costs.stage_memory``: saved
    block inputs of the micro-batches in flight, P2P buffers, one block's recompute + backward and
    the gradients queued for D2H), so the budget and ``python -m nodetrain.plan`` agree."""
    t = cfg.train
    mem = stage_memory(
        shape_of(model),
        range(blocks[0], blocks[-1] + 1),
        stage,
        num_stages,
        b=t.micro_batch_size,
        t=t.seq_len,
        m=cfg.pipeline.microbatches,
        g=grad_accum,
        schedule=cfg.pipeline.schedule,
        slots=cfg.stream.slots,
        itemsize=torch.empty(0, dtype=getattr(torch, t.dtype)).element_size(),
        on_cpu=torch.device(device).type != "cuda",
    )
    return mem.activation_bytes


def device_budget_bytes(free: int, window_bytes: int, activations: int) -> int:
    """The automatic resident budget: ``free`` device bytes minus the window's slots, the activations
    (``costs.stage_memory``) and :data:`MARGIN_BYTES`, at least 0. The planner predicts the same
    figure from the profile's device memory (plan.py), the engine from the memory free at start-up."""
    return max(0, free - window_bytes - activations - MARGIN_BYTES)


def auto_device_budget(device: torch.device, activations: int, window_bytes: int) -> int:
    """``stream.device_budget=-1``: on CUDA the free device memory (read now: call it after the
    process group, the peak measurement and their cached blocks are settled) minus the window's
    slots, the activations and :data:`MARGIN_BYTES` (logged); on CPU 0 (the "device" is host
    memory, streaming is what the CPU path exists to exercise)."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    budget = device_budget_bytes(free, window_bytes, activations)
    log.info(
        "automatic device budget: %.2f GB free - %.2f GB window - %.2f GB activations - %.2f GB margin "
        "(allocator, NCCL, cuBLAS) = %.2f GB",
        free / 1e9,
        window_bytes / 1e9,
        activations / 1e9,
        MARGIN_BYTES / 1e9,
        budget / 1e9,
    )
    return budget


def resident_blocks(
    cfg, model, blocks, stage: int, num_stages: int, device, grad_accum: int = 1
) -> list[int]:
    """The blocks of this stage to keep resident under ``cfg.stream.device_budget`` (see module doc).

    Args:
        cfg: the run config (``stream``, ``train``, ``pipeline``).
        model: the HF adapter (``bindings``, ``config``).
        blocks: this stage's blocks.
        stage, num_stages: this rank's place in the pipeline (its activations in flight).
        device: the compute device.
        grad_accum: rounds per step (the P2P buffers of the activation model).
    """
    itemsize = torch.empty(0, dtype=getattr(torch, cfg.train.dtype)).element_size()
    block_bytes = {i: sum(b.numel for b in model.bindings[i]) * itemsize for i in blocks}
    budget = cfg.stream.device_budget
    if budget == "auto" or budget < 0:
        acts = stage_activation_bytes(cfg, model, blocks, stage, num_stages, grad_accum, device)
        budget = auto_device_budget(torch.device(device), acts, cfg.stream.slots * max(block_bytes.values()))
    chosen = choose_resident(block_bytes, budget)
    log.info(
        "stage %d: device budget %.1f MB, %d of %d blocks resident (%.1f MB)",
        stage,
        budget / 1e6,
        len(chosen),
        len(block_bytes),
        sum(block_bytes[i] for i in chosen) / 1e6,
    )
    return chosen
