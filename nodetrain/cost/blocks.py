"""Per-block overlap: one stage's forward and backward passes as its window runs them, block by block.

Owns: :class:`BlockCost` (one block's seconds for one micro-batch: compute, H2D, the D2H worker's
offload, a resident block's ship) and :func:`pass_times` (a micro-batch's forward and backward on one
stage, and the step's flush). Pure arithmetic on seconds: ``step_time.py`` turns bytes and FLOPs into
the costs and plays the passes out on the schedule (``exposure.pipeline_times``). Does not own the
bytes (``traffic.py``), the FLOPs (``compute.py``) or what each stage loads (``core/step_plan.py``).

The model (issue 33; measured against the first GPU run, a copy of its files in
tests/data/gpu-runs/2026-12-04-h200, docs/planner.md):

- forward: the H2D worker loads block i into the slot block i − ``slots`` freed, so (2 slots) it
  crosses while block i − 1 computes; nothing is offloaded (but the head's gradients), so a forward
  takes about Σ max(F_(i−1), H2D_i), a load's excess being the compute's ``stall`` (a big block
  after a small one: the tied head behind the last layer);
- backward (blocks in reverse): the same on the compute with B_i, and each block's offload (its
  gradient's D2H copy and the host's fp32 accumulation, max of the two: the worker lands chunk k
  while chunk k+1 crosses) queued to the D2H worker in order; block j's offload waits for offload
  j − ``slots`` (at most ``slots`` staging buffers in flight, ``engine/device/window.py``): the
  compute's wait for that is ``d2h_wait``, so a backward takes about Σ max(B_i, H2D_i, offload_i),
  and a micro-batch at least its offloads' seconds (the worker's backlog carries over);
- a resident block accumulates on the device and ships its fp32 gradient once, at the step's last
  backward: that pass carries the ships, and the offloads left when its compute ends are the step's
  flush (``d2h_wait`` too); a backward's tail otherwise overlaps the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockCost", "PassTimes", "pass_times"]


@dataclass(frozen=True)
class BlockCost:
    """One block of a stage for one micro-batch, seconds."""

    forward_s: float
    """Its forward compute (the head's includes its gradients: ``compute.block_work``)."""
    backward_s: float
    """Its recompute and backward compute (0 for the head)."""
    load_s: float = 0.0
    """H2D per pass, the step's loads of the block spread over its passes (reused loads cost none)."""
    offload_s: float = 0.0
    """The D2H worker's seconds for one offload of its gradient (streamed blocks; the head's come
    with its forward)."""
    ship_s: float = 0.0
    """A resident block's once-per-step ship of its fp32 gradient (D2H and the host's copy), or a
    streamed one's with a device accumulator (``stream.grad_on_device``)."""
    head: bool = False
    """The last stage's head: offloads at its forward, no backward."""


@dataclass(frozen=True)
class PassTimes:
    """A stage's micro-batch, seconds: wall time of its passes and what the compute waited for."""

    forward_s: float
    backward_s: float
    """A backward pass of a micro-batch but the step's last (no ships)."""
    compute_s: float
    """Forward + backward compute of one micro-batch."""
    stall_s: float
    """Per micro-batch, the compute's waits for H2D loads."""
    d2h_wait_s: float
    """Per micro-batch, the compute's waits for offload slots."""
    last_extra_s: float
    """The step's last backward beyond an ordinary one (its ships' waits), plus the flush: the
    offloads left when its compute ends."""


def _sweep(blocks: list[BlockCost], slots: int, backward: bool, last: bool = False) -> tuple[float, ...]:
    """(compute end, the D2H worker's end, stall, d2h wait) of one pass from 0, ``blocks`` in the
    pass's order. Block j's load (in order on the H2D worker) waits for its slot: the compute of
    block j − ``slots`` (the pass's first loads were prefetched during the previous pass). In a
    backward, block j's offload waits for offload j − ``slots`` (its staging buffer); ``last``: the
    step's last backward, where resident blocks ship and the head's ship is queued first."""
    head = [b for b in blocks if b.head] if backward else []
    worker = sum(b.offload_s + (b.ship_s if last else 0.0) for b in head)  # queued at the forward's end
    done: list[float] = [worker] if worker > 0 else []
    ends: list[float] = []
    t = stall = wait = 0.0
    loader = float("-inf")
    for j, b in enumerate(x for x in blocks if not (backward and x.head)):
        k = j - slots
        slot_free = ends[k] if k >= 0 else (0.0 if k == -1 else float("-inf"))
        loader = max(loader, slot_free) + b.load_s if b.load_s > 0 else loader
        ready = loader if b.load_s > 0 else 0.0
        stall += max(0.0, ready - t)
        t = max(t, ready) + (b.backward_s if backward else b.forward_s)
        ends.append(t)
        work = b.offload_s + (b.ship_s if last else 0.0) if backward else 0.0
        if work <= 0:
            continue
        if len(done) >= slots and done[-slots] > t:  # its offload waits for a staging buffer
            wait += done[-slots] - t
            t = done[-slots]
            ends[-1] = t
        worker = max(worker, t) + work
        done.append(worker)
    return t, max(worker, t), stall, wait


def pass_times(blocks: list[BlockCost], slots: int) -> PassTimes:
    """A micro-batch's forward and backward on one stage with ``slots`` window slots (the module's model).

    Args:
        blocks: the stage's blocks in forward order.
        slots: ``stream.slots`` (offloads in flight at most; ≥ 1).
    """
    slots = max(1, slots)
    forward, _, fwd_stall, _ = _sweep(blocks, slots, backward=False)
    order = blocks[::-1]
    end, _, bwd_stall, wait = _sweep(order, slots, backward=True)
    last_end, last_worker, _, _ = _sweep(order, slots, backward=True, last=True)
    compute = sum(b.forward_s + b.backward_s for b in blocks)
    # the worker's backlog carries into the next micro-batch: over the step it keeps pace only if a
    # micro-batch takes its offloads' seconds; what the last backward's flush already waits for is
    # not waited for twice
    carry = max(0.0, sum(b.offload_s for b in blocks) - forward - end)
    return PassTimes(
        forward_s=forward,
        backward_s=end + carry,
        compute_s=compute,
        stall_s=fwd_stall + bwd_stall,
        d2h_wait_s=wait + carry,
        last_extra_s=max(0.0, (last_end - end) + (last_worker - last_end) - carry),
    )
