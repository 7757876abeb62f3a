"""Traffic: the bytes one stage's step moves over the host link and through host DRAM.

Owns: H2D and D2H bytes per step, the host's accumulation and optimizer bytes, and the private host
RAM of speculative backups. Does not own which loads happen (``core/step_plan.py``, handed over as a
:class:`~nodetrain.cost.work.StageWork`), the seconds they cost (``step_time.py``) or device memory
(``memory.py``).

Shapes: n = B·T tokens per micro-batch, D = hidden size, e = compute-dtype bytes, P = a block's
elements (``ModelShape.load_numels``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nodetrain.cost.memory import device_optimizer_bytes_per_param, saved_per_micro_batch
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.work import StageWork

__all__ = [
    "optimizer_bytes_per_param",
    "speculative_backup_bytes",
    "StageTraffic",
    "stage_traffic",
    "block_traffic",
    "wave_offload_bytes",
    "speculative_bytes_per_param",
    "speculative_traffic",
]


def optimizer_bytes_per_param(itemsize: int) -> int:
    """Host memory traffic of one CPU AdamW update per parameter: the fused AdamW reads master,
    grad, exp_avg, exp_avg_sq (16) and writes master, exp_avg, exp_avg_sq (12); the global norm
    reads the grad (4); refreshing the transfer copy reads master (4) and writes ``itemsize``;
    zeroing the grad writes 4. (An active clip adds 8 more.)"""
    return 40 + itemsize


def speculative_backup_bytes(shape: ModelShape, speculative: bool) -> int:
    """Private host RAM of ``optim.speculative``'s backups, all ranks of a node together: master
    weights, ``exp_avg`` and ``exp_avg_sq`` of every unit updated during the backward, 12 bytes per
    parameter (StoreAdamW.backup_unit); 0 without speculation."""
    return 12 * shape.num_params if speculative else 0


@dataclass(frozen=True)
class StageTraffic:
    """What one stage moves in one optimizer step (bytes), under the engine's transfer rules."""

    loads: int
    """H2D loads of blocks (a resident block's one load counted once)."""
    h2d_bytes: int
    """Host → device: every load's bytes (the embedding's: the gathered rows only)."""
    d2h_bytes: int
    """Device → host: streamed blocks' gradients per backward (e bytes), resident ones' and those with a
    device accumulator (``work.grad_acc``) once (fp32)."""
    accum_bytes: int
    """Host DRAM bytes the D2H worker touches adding gradients into the fp32 accumulators (reads of
    the staged gradients, reads and writes of the accumulators; not the DMA itself)."""
    optimizer_bytes: int
    """Host DRAM bytes of the CPU AdamW over the stage's units (``optimizer_bytes_per_param``)."""
    tier_bytes: int = 0
    """NVMe bytes of the stage's tier fields per step (``store.tier=nvme``): each read and written once,
    through host DRAM."""
    device_optimizer_bytes: int = 0
    """Device memory bytes of the fused AdamW of the units whose optimizer is on the device
    (``optim.on_device``, ``cost.memory.device_optimizer_bytes_per_param``): not host bytes."""

    @property
    def host_bytes(self) -> int:
        """Everything through host DRAM: the DMA reads (H2D) and writes (D2H), the host's passes and the
        tier's NVMe reads and writes."""
        return self.h2d_bytes + self.d2h_bytes + self.accum_bytes + self.optimizer_bytes + self.tier_bytes


def stage_traffic(
    shape: ModelShape, work: StageWork, *, n: int, itemsize: int, offload_activations: bool = False
) -> StageTraffic:
    """Bytes one stage moves per step.

    Loads: each of ``work.loads`` (the window's H2D copies into slots) moves its block (P·e), each
    resident block once per step. Gradients: a streamed block offloads ``P × e`` after each of its
    backwards (the last stage's head after each forward) and the D2H worker adds it into the fp32
    accumulator: it reads the staged copy (e) and the accumulator (4) and writes the accumulator (4),
    except that the step's first offload overwrites it (no read). A resident block accumulates on the
    device and offloads its fp32 gradient once per step, copied into the accumulator (read 4 + write
    4). A streamed block with a device accumulator (``work.grad_acc``, ``stream.grad_on_device``) loads
    as a streamed one and ships as a resident one: ``4 × P`` D2H and ``8 × P`` host bytes per step. Stage
    0's embedding when it travels as rows (``work.rows``) gathers only the n used rows
    (n·D·e in) and offloads an n-row gradient (n·D·e and the 8-byte ids out) that is scatter-added
    into an accumulator zeroed once per step. A resident block with its optimizer on the device
    (``work.on_device``) moves nothing and its units add no host optimizer bytes: their update's
    device bytes are ``device_optimizer_bytes``.

    In waves (``work.wave`` = W > 1, ``pipeline.wave``) the loads are those of the step's M/W items
    and a streamed block (the head too) ships its wave-summed fp32 gradient once per item
    (:func:`wave_offload_bytes`); resident, device-accumulating and row blocks are unchanged.

    With ``offload_activations`` every micro-batch's saved block inputs (``saved_per_micro_batch``) go
    D2H after its forward and come back H2D before its backward.

    Args:
        work: the stage's step (``StepPlan.work``); n: tokens per micro-batch (B·T); itemsize:
            compute-dtype bytes (e).
    """
    e, kept = itemsize, work.on_device  # resident with their optimizer: loaded once, never shipped
    per_block = [block_traffic(shape, work, i, n=n, itemsize=e) for i in work.blocks]
    h2d, d2h, accum = (sum(x[j] for x in per_block) for j in range(3))
    if offload_activations:
        saved = work.num_microbatches * saved_per_micro_batch(shape, work.blocks, n, e)
        h2d, d2h = h2d + saved, d2h + saved
    owned = sum(shape.unit_numels[i] for i in work.blocks if i not in kept)
    on_device = sum(shape.unit_numels[i] for i in kept)
    return StageTraffic(
        len(work.loads) + len(work.resident - kept),
        h2d,
        d2h,
        accum,
        owned * optimizer_bytes_per_param(e),
        device_optimizer_bytes=on_device * device_optimizer_bytes_per_param(e),
    )


def block_traffic(
    shape: ModelShape, work: StageWork, block: int, *, n: int, itemsize: int
) -> tuple[int, int, int]:
    """(H2D, D2H, accumulation) bytes of one of ``work.blocks`` in the step, by :func:`stage_traffic`'s
    rules, which sums them (without the activation offload); the per-block overlap model
    (``blocks.py``) spreads them over the block's passes. A block with its optimizer on the device
    (``work.on_device``) moves nothing; a streamed one with a device accumulator (``work.grad_acc``)
    its loads, ``4 × P`` D2H and ``8 × P`` host bytes; a streamed one in waves of W > 1 micro-batches
    (``work.wave``) :func:`wave_offload_bytes`, the streamed embedding's rows still per micro-batch."""
    e, p, num_mb = itemsize, shape.load_numels[block], work.num_microbatches
    if block in work.on_device:
        return 0, 0, 0
    if block in work.resident:
        return p * e, 4 * p, 8 * p
    if block == 0 and work.rows:
        h2d, out = num_mb * n * shape.hidden * e, num_mb * (n * shape.hidden * e + 8 * n)
        if block in work.grad_acc:  # the rows added on the device, the [V, D] accumulator shipped once
            return h2d, 4 * p, 8 * p
        return h2d, out, 4 * p + out + num_mb * 8 * n * shape.hidden
    loads = work.loads.count(block) * p * e
    if block in work.grad_acc:
        return loads, 4 * p, 8 * p
    if work.wave > 1:
        return (loads, *wave_offload_bytes(p, work.num_items))
    return loads, num_mb * p * e, num_mb * p * e + 4 * p + (num_mb - 1) * 8 * p


def wave_offload_bytes(numel: int, items: int) -> tuple[int, int]:
    """(D2H, host accumulation) bytes per step of a streamed block of ``numel`` elements whose weight
    gradients are summed on the device over each wave (``pipeline.wave`` > 1) and shipped once per
    item in fp32: ``items × 4·P`` D2H; the host reads each staged fp32 copy (4·P), the step's first
    arrival overwrites the accumulator (write 4·P) and each later one adds fp32 += fp32 (read and write
    8·P): ``items·4·P + 4·P + (items − 1)·8·P``. One item per step (W = M): 4·P D2H and 8·P host bytes,
    as a device accumulator's (``stream.grad_on_device``). Source: issue 31 (the engine's wave rule)."""
    return items * 4 * numel, items * 4 * numel + 4 * numel + (items - 1) * 8 * numel


def speculative_bytes_per_param(rolled_back: bool) -> int:
    """Extra host memory traffic of ``optim.speculative`` per parameter and step, over
    :func:`optimizer_bytes_per_param`: the backup reads and writes 12 (24); a step that clipped
    adds the restore (24) and a second AdamW update and transfer-copy refresh (36)."""
    return 24 + (24 + 36 if rolled_back else 0)


def speculative_traffic(shape: ModelShape, stage_blocks, traffic, clip_fraction: float) -> list[StageTraffic]:
    """``traffic`` with speculation's optimizer bytes added: backups every step, a rollback and a
    redo on the ``clip_fraction`` of steps that clip."""
    extra = speculative_bytes_per_param(False) + clip_fraction * (
        speculative_bytes_per_param(True) - speculative_bytes_per_param(False)
    )
    return [
        replace(x, optimizer_bytes=x.optimizer_bytes + int(extra * sum(shape.unit_numels[i] for i in blocks)))
        for x, blocks in zip(traffic, stage_blocks, strict=True)
    ]
