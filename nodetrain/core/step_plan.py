"""A stage's step, expanded once: the one rule of when a block is loaded, offloaded and final.

Owns: the expansion of a stage's schedule into what its step does in order: the pipeline actions of a
round (schedule.py), the blocks each action loads through the window and offloads gradients of
(:func:`stage_loads`, :func:`stage_offloads`), which loads reuse the previous one's slot
(:func:`reuses`), which block travels as gathered rows (:func:`row_blocks`), the order gradients
reach the host store (:func:`arrival_order`) and the order units become final (:func:`final_order`).
The engine's window and readiness run these sequences; the cost model counts them
(:meth:`StepPlan.work`). Pure: no torch, no threads.

Terms: a *block* is what one window slot holds (a unit's bindings: the embedding, one decoder layer,
the head with its final norm and, when tied, the embedding matrix); a unit's gradient is *final* once
no later backward of the step adds to it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from nodetrain.core.schedule import Action, build_schedule, in_flight_peak, p2p_live_peak, step_rounds
from nodetrain.cost.work import StageWork

__all__ = [
    "StepPlan",
    "arrival_order",
    "final_order",
    "reuses",
    "row_blocks",
    "stage_loads",
    "stage_offloads",
    "stage_works",
]


def stage_loads(blocks: list[int], is_last: bool, rows, kind: str) -> list[int]:
    """Blocks an action of ``kind`` ("F"/"B") of a stage with ``blocks`` loads through the window, in
    order: a forward every block, a backward every block but the last stage's head, last first
    (the head's gradients are taken in its forward); row blocks (``rows``) never go through it."""
    recomputed = blocks[:-1] if is_last else blocks
    order = blocks if kind == "F" else recomputed[::-1]
    return [b for b in order if b not in rows]


def stage_offloads(blocks: list[int], is_last: bool, kind: str) -> list[int]:
    """Blocks whose gradients an action of ``kind`` offloads, in order: the head's at its forward,
    every other block's at the backward, last block first."""
    if kind == "F":
        return blocks[-1:] if is_last else []
    return (blocks[:-1] if is_last else blocks)[::-1]


def row_blocks(blocks, resident) -> list[int]:
    """Blocks that travel as the rows a micro-batch uses instead of through a slot: stage 0's
    embedding when it streams (a resident embedding is bound whole)."""
    return [0] if 0 in blocks and 0 not in set(resident) else []


def reuses(sequence: list[int], resident) -> list[bool]:
    """Per position of a load sequence, whether it shares the previous position's load and slot: the
    same streamed block twice in a row (no H2D, no second slot). A resident block is loaded once per
    sequence and never reuses a slot."""
    resident = set(resident)
    return [k > 0 and b == sequence[k - 1] and b not in resident for k, b in enumerate(sequence)]


def arrival_order(backwards: list[int], resident, wave: int = 1, rows=()) -> list[int]:
    """Blocks in the order their gradients reach the host store in a step: a streamed block at every
    backward (with waves: once per item, its wave's fp32 sum), a row block at every micro-batch's
    backward (``wave`` per item: its rows are offloaded per micro-batch), one with a device accumulator
    once, at its last backward (the accumulator is shipped then).

    Args:
        backwards: block indices in the order their items' backwards offload (the step's offload
            sequence, one entry per item).
        resident: the blocks with a device accumulator: the resident ones and the streamed ones of
            ``stream.grad_on_device`` (``StageWork.grad_acc``).
        wave: micro-batches per item (``pipeline.wave``, W ≥ 1).
        rows: the row blocks (a streamed embedding, :func:`row_blocks`).
    """
    resident, rows = set(resident), set(rows)
    last = {b: k for k, b in enumerate(backwards) if b in resident}
    kept = [b for k, b in enumerate(backwards) if b not in last or last[b] == k]
    return [b for b in kept for _ in range(wave if b in rows and b not in resident else 1)]


def final_order(arrivals, units_of: dict[int, list[int]]) -> list[int]:
    """The order in which units' gradients become final, given the blocks in arrival order.

    A unit is final at the last arrival of any block binding it; units final at the same arrival
    come in ``units_of[block]`` order (as ``GradReadiness.arrived`` returns them).

    Args:
        arrivals: block indices in the order their gradients reach the host store in a step.
        units_of: per block, the units whose gradients it carries (counted ones only).
    """
    last: dict[int, tuple[int, int]] = {}
    for pos, block in enumerate(arrivals):
        for k, u in enumerate(units_of.get(block, ())):
            last[u] = (pos, k)
    return sorted(last, key=last.__getitem__)


@dataclass(frozen=True)
class StepPlan:
    """What one step (or one evaluation) of a stage does, in order.

    Attributes:
        actions: one pipeline round's actions (``build_schedule``), each over one item: a wave of
            ``wave`` consecutive micro-batches (``Action.mb`` numbers items; 1 micro-batch when W = 1).
        rounds: how many rounds the step runs (``step_rounds``).
        loads: block indices in the order the actions use them through the window (row blocks
            included: :meth:`window_loads` leaves them out).
        offloads: block indices in the order their gradients are offloaded (empty for evaluation).
        blocks: the stage's blocks; stage, num_stages: its place in the pipeline.
        wave: W, micro-batches per item (``pipeline.wave``): a load, a streamed block's wave-summed
            gradient ship, a P2P message each cover W micro-batches.
    """

    actions: tuple[Action, ...]
    rounds: int
    loads: tuple[int, ...]
    offloads: tuple[int, ...]
    blocks: tuple[int, ...] = ()
    stage: int = 0
    num_stages: int = 1
    wave: int = 1

    @classmethod
    def of(
        cls,
        actions,
        rounds: int,
        blocks,
        is_last: bool,
        train: bool = True,
        stage: int = 0,
        num_stages: int = 1,
        wave: int = 1,
    ) -> StepPlan:
        """Expand ``rounds`` × ``actions`` (items of ``wave`` micro-batches) for a stage of ``blocks``
        (``is_last``: it holds the head; ``train=False``: an evaluation, nothing offloaded)."""
        blocks, every = list(blocks), list(actions) * rounds
        loads = [b for a in every for b in stage_loads(blocks, is_last, (), a.kind)]
        offloads = [b for a in every for b in stage_offloads(blocks, is_last, a.kind)] if train else []
        return cls(
            tuple(actions), rounds, tuple(loads), tuple(offloads), tuple(blocks), stage, num_stages, wave
        )

    @classmethod
    def step(
        cls,
        schedule: str,
        num_stages: int,
        stage: int,
        grad_accum: int,
        microbatches: int,
        blocks,
        is_last: bool,
        wave: int = 1,
    ) -> StepPlan:
        """A training step of ``grad_accum × microbatches`` micro-batches (``step_rounds``), scheduled
        as items of ``wave`` consecutive micro-batches (item k of a round: micro-batches kW … kW+W−1).

        Raises:
            ValueError: ``wave`` does not divide a round's micro-batches.
        """
        rounds, per_round = step_rounds(schedule, grad_accum, microbatches)
        if wave < 1 or per_round % wave:
            raise ValueError(f"pipeline.wave={wave} does not divide a round's {per_round} micro-batches")
        actions = build_schedule(schedule, num_stages, stage, per_round // wave)
        return cls.of(actions, rounds, blocks, is_last, stage=stage, num_stages=num_stages, wave=wave)

    @classmethod
    def evaluation(cls, num_microbatches: int, blocks, is_last: bool) -> StepPlan:
        """A forward-only pass over ``num_microbatches`` micro-batches, one round."""
        return cls.of([Action("F", i) for i in range(num_microbatches)], 1, blocks, is_last, train=False)

    def window_loads(self, rows=()) -> list[int]:
        """The window's load sequence: :attr:`loads` without the row blocks (``Window.rows``)."""
        rows = set(rows)
        return [b for b in self.loads if b not in rows]

    def streamed_loads(self, resident=()) -> list[int]:
        """The blocks the H2D worker copies into slots, in order: the window's load sequence without
        the reused positions (:func:`reuses`) and the resident blocks (each loaded once per step)."""
        seq = self.window_loads(row_blocks(self.blocks, resident))
        return [
            b for b, again in zip(seq, reuses(seq, resident), strict=True) if not again and b not in resident
        ]

    def arrivals(self, resident=(), rows=()) -> list[int]:
        """Blocks in the order their gradients reach the host store (:func:`arrival_order`; ``rows``:
        the window's row blocks, which arrive once per micro-batch)."""
        return arrival_order(list(self.offloads), resident, self.wave, rows)

    @property
    def step_actions(self) -> list[Action]:
        """Every action of the step in order: :attr:`rounds` × :attr:`actions`."""
        return list(self.actions) * self.rounds

    @property
    def num_items(self) -> int:
        """Items (waves) of the step (all rounds)."""
        return self.rounds * sum(a.kind == "F" for a in self.actions)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of the step (all rounds): items × :attr:`wave`."""
        return self.num_items * self.wave

    def microbatches_of(self, item: int) -> list[int]:
        """The micro-batches (numbered across the step) of item ``item`` (numbered across the step)."""
        return [item * self.wave + j for j in range(self.wave)]

    @property
    def backward_microbatches(self) -> tuple[int, ...]:
        """The step's micro-batches (numbered across its rounds) in the order of their backwards."""
        per_round = sum(a.kind == "F" for a in self.actions)
        items = [r * per_round + a.mb for r in range(self.rounds) for a in self.actions if a.kind == "B"]
        return tuple(mb for i in items for mb in self.microbatches_of(i))

    @property
    def backwards(self) -> Counter:
        """Block -> its backwards in the step, one per micro-batch (``Window.begin``'s count of a device
        accumulator's adds): :attr:`wave` per offload entry."""
        return Counter({b: n * self.wave for b, n in Counter(self.offloads).items()})

    def uses(self, blocks=None) -> dict[int, tuple[int, int]]:
        """Block -> (loads, backwards) in the step, the embedding counted as if it streamed whole
        (the placement's ranking: whether it goes by rows depends on that ranking)."""
        loads, backwards = Counter(self.loads), self.backwards
        return {b: (loads[b], backwards[b]) for b in (self.blocks if blocks is None else blocks)}

    def work(self, resident=(), on_device=(), kept=(), grad_acc=()) -> StageWork:
        """What the cost model counts of this step with ``resident`` blocks kept on the device, those of
        ``on_device`` with their optimizer there too, the ``kept`` layers' activations kept from
        forward to backward (not recomputed) and the streamed blocks of ``grad_acc`` accumulating their
        gradient on the device (``stream.grad_on_device``; resident blocks left out). Its peaks count
        micro-batches: ``in_flight`` and ``p2p_buffers`` are W × the items' (an item's saved inputs and
        its P2P message cover W micro-batches)."""
        resident, actions = frozenset(resident), list(self.actions)
        return StageWork(
            stage=self.stage,
            blocks=range(self.blocks[0], self.blocks[-1] + 1),
            actions=tuple(self.step_actions),
            loads=tuple(self.streamed_loads(resident)),
            resident=resident,
            rows=bool(row_blocks(self.blocks, resident)),
            in_flight=self.wave * in_flight_peak(list(self.actions)),
            p2p_buffers=self.wave * p2p_live_peak(actions, self.rounds, self.stage, self.num_stages),
            on_device=frozenset(on_device) & resident,
            kept=frozenset(kept),
            grad_acc=frozenset(grad_acc) - resident,
            wave=self.wave,
        )


def stage_works(
    schedule: str, stage_blocks, grad_accum: int, microbatches: int, resident=None
) -> list[StageWork]:
    """Per stage of a pipeline of ``stage_blocks``, its training step as the cost model counts it
    (:meth:`StepPlan.work`), with ``resident`` (per stage, default none) blocks kept on the device.

    Args:
        schedule: ``pipeline.schedule``; stage_blocks: each stage's blocks (``schedule.partition``);
        grad_accum, microbatches: rounds per step and micro-batches per round.
    """
    last = len(stage_blocks) - 1
    return [
        StepPlan.step(schedule, last + 1, k, grad_accum, microbatches, blocks, k == last).work(
            resident[k] if resident else ()
        )
        for k, blocks in enumerate(stage_blocks)
    ]
