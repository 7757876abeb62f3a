"""A step's schedule, expanded once: the actions of each round, the loads, offloads and arrivals.

Owns: the one expansion of a stage's schedule into what the step does in order: the pipeline actions
of a round (pipeline.py), the window's load sequence, the blocks whose gradients are offloaded, the
arrivals in the host store (a resident block's accumulator arrives once, at its last backward), and
the per-block use counts the residency ranking reads. Pure: no torch, no threads. Does not own what
an action does (stage.py) or when a unit is final (readiness.py reads :attr:`StepPlan.arrivals`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from nodetrain.engine.pipeline import Action, build_schedule, step_rounds
from nodetrain.engine.stage import stage_loads, stage_offloads

__all__ = ["StepPlan", "arrival_order"]


def arrival_order(backwards: list[int], resident) -> list[int]:
    """Blocks in the order their gradients reach the host store in a step: a streamed block at every
    backward, a resident one once, at its last backward (its device accumulator is shipped then).

    Args:
        backwards: block indices in the order their backwards offload (the step's offload sequence).
        resident: the resident blocks.
    """
    resident = set(resident)
    last = {b: k for k, b in enumerate(backwards) if b in resident}
    return [b for k, b in enumerate(backwards) if b not in last or last[b] == k]


@dataclass(frozen=True)
class StepPlan:
    """What one step (or one evaluation) of a stage does, in order.

    Attributes:
        actions: one pipeline round's actions (``build_schedule``).
        rounds: how many rounds the step runs (``step_rounds``).
        loads: block indices in the order the actions use them through the window (row blocks
            included: :meth:`window_loads` leaves them out).
        offloads: block indices in the order their gradients are offloaded (empty for evaluation).
    """

    actions: tuple[Action, ...]
    rounds: int
    loads: tuple[int, ...]
    offloads: tuple[int, ...]

    @classmethod
    def of(cls, actions, rounds: int, blocks, is_last: bool, train: bool = True) -> StepPlan:
        """Expand ``rounds`` × ``actions`` for a stage of ``blocks`` (``is_last``: it holds the head;
        ``train=False``: an evaluation, nothing offloaded)."""
        blocks, every = list(blocks), list(actions) * rounds
        loads = [b for a in every for b in stage_loads(blocks, is_last, (), a.kind)]
        offloads = [b for a in every for b in stage_offloads(blocks, is_last, a.kind)] if train else []
        return cls(tuple(actions), rounds, tuple(loads), tuple(offloads))

    @classmethod
    def step(cls, schedule: str, num_stages: int, stage: int, grad_accum: int, microbatches: int, blocks,
             is_last: bool) -> StepPlan:  # fmt: skip
        """A training step of ``grad_accum × microbatches`` micro-batches (``step_rounds``)."""
        rounds, per_round = step_rounds(schedule, grad_accum, microbatches)
        return cls.of(build_schedule(schedule, num_stages, stage, per_round), rounds, blocks, is_last)

    @classmethod
    def evaluation(cls, num_microbatches: int, blocks, is_last: bool) -> StepPlan:
        """A forward-only pass over ``num_microbatches`` micro-batches, one round."""
        return cls.of([Action("F", i) for i in range(num_microbatches)], 1, blocks, is_last, train=False)

    def window_loads(self, rows=()) -> list[int]:
        """The window's load sequence: :attr:`loads` without the row blocks (``Window.rows``)."""
        rows = set(rows)
        return [b for b in self.loads if b not in rows]

    def arrivals(self, resident=()) -> list[int]:
        """Blocks in the order their gradients reach the host store (:func:`arrival_order`)."""
        return arrival_order(list(self.offloads), resident)

    @property
    def backward_microbatches(self) -> tuple[int, ...]:
        """The step's micro-batches (numbered across its rounds) in the order of their backwards."""
        per_round = sum(a.kind == "F" for a in self.actions)
        return tuple(r * per_round + a.mb for r in range(self.rounds) for a in self.actions if a.kind == "B")

    @property
    def backwards(self) -> Counter:
        """Block -> its offloads (backwards) in the step (``Window.begin``'s count)."""
        return Counter(self.offloads)

    def uses(self, blocks) -> dict[int, tuple[int, int]]:
        """Block -> (loads, backwards) in the step, the embedding counted as if it streamed whole
        (residency's ranking: whether it goes by rows depends on that ranking)."""
        loads, backwards = Counter(self.loads), self.backwards
        return {b: (loads[b], backwards[b]) for b in blocks}
