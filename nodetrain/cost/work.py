"""What one stage does in a step, as the cost model counts it: the input every price here starts from.

Owns: :class:`StageWork`, the counts of a stage's step (its actions, the loads the window copies, what
stays on the device, the peaks its schedule implies). Built by the one rule of the step
(``core/step_plan.py``: ``StepPlan.work``), so the engine runs and the cost model prices the same
sequence. Does not own deciding any of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["StageWork"]


@dataclass(frozen=True)
class StageWork:
    """One stage's step as counts.

    Attributes:
        stage: the stage's index in its pipeline.
        blocks: its blocks (contiguous unit indices).
        actions: every action of the step in order (objects with ``kind`` "F"/"B" and ``mb``), each over
            one item of ``wave`` micro-batches.
        loads: the blocks the window copies H2D into slots, in order (reused loads, resident blocks and
            rows left out).
        resident: blocks kept on the device for the whole step (loaded once, fp32 gradient on it).
        on_device: resident blocks whose units' optimizer runs on the device (``optim.on_device``: fp32
            master, moments and gradient there; no D2H, no host accumulation, no host update).
        rows: stage 0's embedding travels as the rows a micro-batch uses.
        in_flight: most micro-batches whose block inputs the stage keeps at once.
        p2p_buffers: most [B, T, D] P2P buffers alive at once.
        kept: decoder layers whose activations stay from the forward to the backward (not
            recomputed: ``core/recompute.py``).
        grad_acc: streamed blocks whose fp32 gradient accumulates on the device across the step
            and leaves once per step (``stream.grad_on_device``): loaded per pass as any streamed
            block, D2H ``4 × numel`` bytes and one host copy per step.
        wave: W, micro-batches per item (``pipeline.wave``): each streamed block (not a row block, not
            one of ``grad_acc``) is loaded once per item and ships its wave-summed fp32 gradient once per
            backward item (D2H ``4 × numel``); ``in_flight`` and ``p2p_buffers`` count micro-batches.
    """

    stage: int
    blocks: range
    actions: tuple
    loads: tuple[int, ...]
    resident: frozenset[int]
    rows: bool
    in_flight: int
    p2p_buffers: int
    on_device: frozenset[int] = frozenset()
    kept: frozenset[int] = frozenset()
    grad_acc: frozenset[int] = frozenset()
    wave: int = 1

    @functools.cached_property
    def num_items(self) -> int:
        """Items (waves of ``wave`` micro-batches) of the step (forward actions)."""
        return sum(1 for a in self.actions if a.kind == "F")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of the step (forwards × ``wave``)."""
        return self.num_items * self.wave
