"""When each unit's gradient is final in a step: the one place that says "unit u is final".

Owns: the count of a step's gradient arrivals per unit (from the step's one expansion of the
schedule, ``StepPlan.arrivals``) and the check that units become final in the order
``core.step_plan.final_order`` says (a pure function of the schedule, so the replicas of a stage pair
their per-unit all-reduces). A unit bound by several blocks (the tied embedding on one stage) is
final at the last arrival of any of them. Units another stage also reads (the tied embedding owned
by stage 0 and bound by the last stage's head) and, when nothing is updated in the backward, every
unit are *settled* instead: final after the flush, the tied sum and the replica sum
(:meth:`GradReadiness.settled`).

One thread owns a :class:`GradReadiness` (the optimizer thread when units are updated in the
backward; overlap.py): the D2H worker reports an arrival as a message to that thread, never by
writing the counts. Does not own what happens to a final unit (core/update.py, overlap.py).
"""

from __future__ import annotations

from nodetrain.core.step_plan import final_order
from nodetrain.engine.threads import check_writer

__all__ = ["GradReadiness"]


class GradReadiness:
    """A step's arrival counts: which units an arrival makes final.

    Args:
        units_of: per block, the owned units whose gradients it carries (sorted).
        counted: the units that become final by arrivals (owned, not shared with another stage;
            empty when nothing is updated in the backward).
        settled: the units that are final only after the flush, tied sum and replica sum.
        owner: the thread role that arms it and reports arrivals (threads.py).
    """

    def __init__(self, units_of: dict[int, list[int]], counted, settled, owner: str = "optimizer"):
        self._counted = [u for u in sorted(counted)]
        self._units_of = {b: [u for u in us if u in set(counted)] for b, us in units_of.items()}
        self.settled = [u for u in sorted(settled)]
        """Units final after the flush, the tied sum and the replica sum (updated after the all-reduce)."""
        self._owner = owner
        self._remaining: dict[int, int] = {}
        self._order: list[int] = []
        self._num_final = 0

    def expected_order(self, arrivals) -> list[int]:
        """The counted units in the order ``arrivals`` makes them final (pure)."""
        return final_order(arrivals, self._units_of)

    def arm(self, arrivals) -> None:
        """Start a step whose gradients arrive in block order ``arrivals`` (``StepPlan.arrivals``)."""
        check_writer(self._owner, "a unit's readiness")
        self._remaining = dict.fromkeys(self._counted, 0)
        for block in arrivals:
            for u in self._units_of.get(block, ()):
                self._remaining[u] += 1
        self._order, self._num_final = self.expected_order(arrivals), 0

    def arrived(self, block: int) -> list[int]:
        """One arrival of ``block``'s gradients; returns the units it makes final, in order.

        Raises:
            AssertionError: a unit became final out of the schedule's order (a count mismatch).
        """
        check_writer(self._owner, "a unit's readiness")
        final = []
        for u in self._units_of.get(block, ()):
            self._remaining[u] -= 1
            if self._remaining[u] == 0:
                want = self._order[self._num_final]
                assert u == want, f"unit {u} became final where the schedule puts unit {want}"
                self._num_final += 1
                final.append(u)
        return final

    def missing(self) -> list[int]:
        """Counted units not yet final (after the flush: none, else the counts were wrong)."""
        return [u for u, n in self._remaining.items() if n > 0]
