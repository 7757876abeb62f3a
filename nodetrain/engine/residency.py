"""Residency: which of a stage's blocks stay in device memory instead of streaming.

Owns: the device budget for resident blocks (``stream.device_budget``, or the automatic one) and
the choice of blocks that fit it. Does not own: the buffers or the loads (window.py).

A resident block costs ``numel × (e + 4)`` device bytes (its compute-dtype weights and an fp32
gradient accumulator, ``costs.resident_bytes_per_param``) and saves, per step, every load of it but
one (``(loads − 1) × numel × e`` H2D) and every gradient offload but one fp32 copy
(``backwards × numel × e − 4 × numel`` D2H; the accumulator leaves once per step, window.py).
Both directions run at the host link's speed, so transfer time saved per device byte is
``saved bytes / cost bytes``; the choice is greedy in that order (ties: block order), after the
last stage's head, which goes first (the stage's largest block, loaded at every use).
"""

from __future__ import annotations

import logging
import os

import torch

from nodetrain.config.schema import PipelineConfig, StreamConfig, TrainConfig
from nodetrain.plan.costs import (
    GRAD_ACC_ITEMSIZE,
    StageMemory,
    resident_bytes_per_param,
    shape_of,
    stage_memory,
)

__all__ = [
    "resident_blocks",
    "choose_resident",
    "saved_transfer_bytes",
    "auto_device_budget",
    "device_budget_bytes",
    "stage_activation_bytes",
    "stage_memory_of",
    "ranks_on_device",
    "MARGIN_BYTES",
    "NCCL_MARGIN_BYTES",
    "CUBLAS_MARGIN_BYTES",
    "ALLOCATOR_MARGIN_BYTES",
]

log = logging.getLogger(__name__)

NCCL_MARGIN_BYTES = 1 << 30
"""NCCL's device buffers, not yet allocated when the budget reads the free memory (a communicator
connects a peer at its first P2P or collective). Per connection and channel NCCL keeps one buffer
per protocol: Simple ``NCCL_BUFFSIZE`` (default 4 MiB, NCCL's environment-variable docs), LL128
120 × 640 threads × 8 steps × 8 B = 4.7 MiB and LL 8 × 512 × 8 × 16 B = 0.5 MiB (NVIDIA/nccl
``src/init.cc``, ``src/include/device.h``); the channels grow with the link's bandwidth
(NVIDIA/nccl#986). Measured: 544-688 MB per communicator on 4 × A100 with NVLink (NVIDIA/nccl#964).
The engine's default group carries the P2P and the all-reduce: 1 GiB, an assumption for one
communicator (NVLink SHARP, ``NCCL_NVLS_ENABLE``, takes more: NVIDIA/nccl#864)."""
CUBLAS_MARGIN_BYTES = 128 << 20
"""cuBLAS and cuBLASLt workspaces: 32 MiB each per (handle, stream) on Hopper and newer, 4 MiB
before (cuBLAS docs, ``cublasSetWorkspace``; PyTorch's defaults since pytorch/pytorch#120925),
for the compute stream and one more."""
ALLOCATOR_MARGIN_BYTES = (2 << 30) - NCCL_MARGIN_BYTES - CUBLAS_MARGIN_BYTES
"""PyTorch's caching allocator: sizes rounded up (512 B; above 10 MiB to 2 MiB multiples; 1-10 MiB
requests carved from 20 MiB segments: ``c10/cuda/CUDACachingAllocator.cpp``) and fragmentation
between activations of varied sizes; an assumption (0.875 GiB) that keeps the margin at 2 GiB."""
MARGIN_BYTES = NCCL_MARGIN_BYTES + CUBLAS_MARGIN_BYTES + ALLOCATOR_MARGIN_BYTES
"""Device bytes the automatic budget leaves free beyond what ``costs.stage_memory`` counts."""


def saved_transfer_bytes(numel: int, itemsize: int, loads: int, backwards: int) -> int:
    """Link bytes per step a block saves by being resident (see the module docstring).

    Args:
        numel: elements the block binds; itemsize: compute-dtype bytes (e).
        loads: its uses in the step's load sequence; backwards: its gradient offloads in the step.
    """
    h2d = max(loads - 1, 0) * numel * itemsize
    d2h = backwards * numel * itemsize - (numel * GRAD_ACC_ITEMSIZE if backwards else 0)
    return h2d + d2h


def choose_resident(
    cost_bytes: dict[int, int], saved_bytes: dict[int, int], budget: int, first=()
) -> list[int]:
    """Blocks to keep resident within ``budget`` device bytes, in block order.

    Greedy: the ``first`` blocks (the last stage's head), then the others by saved bytes per device
    byte, highest first (ties: lower block first); a block that does not fit is skipped.

    Args:
        cost_bytes: block index -> device bytes if resident (weights + fp32 accumulator).
        saved_bytes: block index -> link bytes per step it saves (:func:`saved_transfer_bytes`).
        budget: bytes available; ≤ 0 keeps nothing resident.
        first: blocks tried before the ranking.
    """
    rest = sorted(
        (b for b in cost_bytes if b not in first), key=lambda b: (-saved_bytes[b] / max(cost_bytes[b], 1), b)
    )
    chosen, left = [], budget
    for block in [b for b in first if b in cost_bytes] + rest:
        if 0 < cost_bytes[block] <= left:
            chosen.append(block)
            left -= cost_bytes[block]
    return sorted(chosen)


def stage_memory_of(
    train: TrainConfig, pipeline: PipelineConfig, slots: int, model, blocks, stage: int, num_stages: int,
    grad_accum: int, device, offload_activations: bool = False,
) -> StageMemory:  # fmt: skip
    """This stage's device bytes as the planner counts them (``costs.stage_memory``: window slots,
    saved block inputs of the micro-batches in flight, live P2P buffers, one block's recompute +
    backward and the gradients queued for D2H), so the budget and ``python -m nodetrain.plan``
    agree; no block resident (the budget is what residency may take). ``slots``: ``stream.slots``;
    ``offload_activations``: ``stream.offload_activations`` (two micro-batches' saved inputs)."""
    return stage_memory(
        shape_of(model),
        range(blocks[0], blocks[-1] + 1),
        stage,
        num_stages,
        b=train.micro_batch_size,
        t=train.seq_len,
        m=pipeline.microbatches,
        g=grad_accum,
        schedule=pipeline.schedule,
        slots=slots,
        itemsize=torch.empty(0, dtype=getattr(torch, train.dtype)).element_size(),
        on_cpu=torch.device(device).type != "cuda",
        offload_activations=offload_activations,
    )


def stage_activation_bytes(
    train: TrainConfig, pipeline: PipelineConfig, slots: int, model, blocks, stage: int, num_stages: int,
    grad_accum: int, device, offload_activations: bool = False,
) -> int:  # fmt: skip
    """Peak activation bytes of this stage (:func:`stage_memory_of`'s ``activation_bytes``)."""
    mem = stage_memory_of(
        train, pipeline, slots, model, blocks, stage, num_stages, grad_accum, device, offload_activations
    )
    return mem.activation_bytes


def device_budget_bytes(free: int, window_bytes: int, activations: int, ranks: int = 1) -> int:
    """The automatic resident budget: this rank's share of ``free`` device bytes (``free // ranks``
    when ``ranks`` processes share the device) minus the window's slots, the activations
    (``costs.stage_memory``) and :data:`MARGIN_BYTES`, at least 0. The planner predicts the same
    figure from the profile's device memory (planner.py), the engine from the memory free at start-up."""
    return max(0, free // max(ranks, 1) - window_bytes - activations - MARGIN_BYTES)


def ranks_on_device(index: int, local_world_size: int, device_count: int) -> int:
    """How many of the node's ranks compute on CUDA device ``index``: train.py gives local rank r
    the device ``r mod device_count`` (with ``dist.backend=gloo`` several ranks may share one;
    NCCL refuses that), so the ranks r < ``local_world_size`` with r ≡ ``index``. (A launcher showing
    each rank only its own GPU: NCCL is refused by train.py, gloo ranks would count as sharing.)"""
    if device_count < 1:
        return 1
    return max(1, len(range(index, max(local_world_size, 1), device_count)))


def auto_device_budget(device: torch.device, activations: int, window_bytes: int) -> int:
    """``stream.device_budget=-1``: on CUDA this rank's share of the free device memory (read now:
    call it after the process group, the peak measurement and their cached blocks are settled;
    split evenly among the node's ranks on the same device, :func:`ranks_on_device`) minus the
    window's slots, the activations and :data:`MARGIN_BYTES`, each logged; on CPU 0 (the "device"
    is host memory, streaming is what the CPU path exists to exercise).

    A rank sharing the device that reads the free memory after another allocated takes a smaller
    share, never a larger one, so the ranks together stay within what was free."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ranks = ranks_on_device(device.index or 0, local, torch.cuda.device_count())
    budget = device_budget_bytes(free, window_bytes, activations, ranks)
    log.info(
        "automatic device budget: %.2f GB free / %d rank(s) on %s - %.2f GB window - %.2f GB activations "
        "- %.2f GB margin (NCCL buffers %.2f + cuBLAS workspaces %.2f + allocator %.2f) = %.2f GB",
        free / 1e9,
        ranks,
        device,
        window_bytes / 1e9,
        activations / 1e9,
        MARGIN_BYTES / 1e9,
        NCCL_MARGIN_BYTES / 1e9,
        CUBLAS_MARGIN_BYTES / 1e9,
        ALLOCATOR_MARGIN_BYTES / 1e9,
        budget / 1e9,
    )
    return budget


def resident_blocks(
    train: TrainConfig, pipeline: PipelineConfig, stream: StreamConfig, model, blocks, stage: int,
    num_stages: int, device, grad_accum: int = 1, uses=None,
) -> list[int]:  # fmt: skip
    """The blocks of this stage to keep resident under ``stream.device_budget`` (see module doc).

    Args:
        train, pipeline, stream: the run's ``train`` (dtype, micro-batch shape), ``pipeline``
            (micro-batches, schedule) and ``stream`` (``device_budget``, ``slots``) sections.
        model: the HF adapter (``bindings``, ``config``).
        blocks: this stage's blocks.
        stage, num_stages: this rank's place in the pipeline (its activations in flight).
        device: the compute device.
        grad_accum: rounds per step (the P2P buffers of the activation model).
        uses: block -> (loads, backwards) in one step (the engine's load and offload sequences);
            default ``2 × M × grad_accum`` loads and ``M × grad_accum`` backwards each.
    """
    itemsize = torch.empty(0, dtype=getattr(torch, train.dtype)).element_size()
    numel = {i: sum(b.numel for b in model.bindings[i]) for i in blocks}
    if uses is None:
        mbs = pipeline.microbatches * grad_accum
        uses = {i: (2 * mbs, mbs) for i in blocks}
    cost = {i: n * resident_bytes_per_param(itemsize) for i, n in numel.items()}
    saved = {i: saved_transfer_bytes(n, itemsize, *uses[i]) for i, n in numel.items()}
    budget = stream.device_budget
    if budget == "auto" or budget < 0:
        mem = stage_memory_of(
            train, pipeline, stream.slots, model, blocks, stage, num_stages, grad_accum, device,
            stream.offload_activations,
        )  # fmt: skip
        budget = auto_device_budget(torch.device(device), mem.activation_bytes, mem.window_bytes)
    head = len(model.units) - 1
    chosen = choose_resident(cost, saved, budget, first=(head,) if head in numel else ())
    log.info(
        "stage %d: device budget %.1f MB, %d of %d blocks resident (%.1f MB with their fp32 gradient "
        "accumulators; chosen by link bytes saved per device byte, the head first)",
        stage,
        budget / 1e6,
        len(chosen),
        len(numel),
        sum(cost[i] for i in chosen) / 1e6,
    )
    return chosen
