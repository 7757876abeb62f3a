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

__all__ = ["resident_blocks", "choose_resident", "auto_device_budget", "activation_bytes", "MARGIN_BYTES"]

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


def activation_bytes(hf_config, micro_batch_size: int, seq_len: int, itemsize: int, num_blocks: int,
                     in_flight: int, last_stage: bool) -> int:  # fmt: skip
    """Rough device bytes of activations: what the automatic budget keeps free for them.

    Saved block inputs of the micro-batches in flight (``in_flight × num_blocks × B·T·D``), one
    block's recompute + backward working set (``B·T·(16·D + 4·I)`` elements, attention by SDPA
    without a T×T matrix) and, on the last stage, the fp32 logits with their gradient and softmax
    (``3 × B·T·V × 4`` bytes); everything × 2 for allocator fragmentation.
    """
    b_t = micro_batch_size * seq_len
    d, inter, vocab = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    saved = in_flight * num_blocks * b_t * d * itemsize
    working = b_t * (16 * d + 4 * inter) * itemsize
    logits = 3 * b_t * vocab * 4 if last_stage else 0
    return 2 * (saved + working + logits)


def auto_device_budget(device: torch.device, activations: int, window_bytes: int) -> int:
    """``stream.device_budget=-1``: on CUDA the free device memory minus the window's slots, the
    activations and :data:`MARGIN_BYTES`; on CPU 0 (the "device" is host memory, streaming is what
    the CPU path exists to exercise)."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, free - window_bytes - activations - MARGIN_BYTES)


def resident_blocks(cfg, model, blocks, stage: int, num_stages: int, device) -> list[int]:
    """The blocks of this stage to keep resident under ``cfg.stream.device_budget`` (see module doc).

    Args:
        cfg: the run config (``stream``, ``train``, ``pipeline``).
        model: the HF adapter (``bindings``, ``config``).
        blocks: this stage's blocks.
        stage, num_stages: this rank's place in the pipeline (its activations in flight).
        device: the compute device.
    """
    itemsize = torch.empty(0, dtype=getattr(torch, cfg.train.dtype)).element_size()
    block_bytes = {i: sum(b.numel for b in model.bindings[i]) * itemsize for i in blocks}
    budget = cfg.stream.device_budget
    if budget < 0:
        m = cfg.pipeline.microbatches
        in_flight = m if cfg.pipeline.schedule == "gpipe" else min(num_stages - stage, m)
        last = stage == num_stages - 1
        t = cfg.train
        acts = activation_bytes(
            model.config, t.micro_batch_size, t.seq_len, itemsize, len(blocks), in_flight, last
        )
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
