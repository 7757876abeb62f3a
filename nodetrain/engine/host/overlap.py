"""Overlapped CPU optimizer: the optimizer thread, the futures a load of a unit waits for, and the acts
of the update policy.

Owns: one background optimizer thread per rank (with its own OpenMP team of ``optim.threads``), the
step's :class:`GradReadiness` (readiness.py, on that thread: an arrival is a message from the D2H
worker, :meth:`UnitUpdates.arrived`), carrying out what the :class:`UpdatePolicy` (core/update.py)
decides for a final unit, after the all-reduce and on a NaN/inf step, and the futures that make a
load of a unit wait for its update (DESIGN invariant 3: overlap, never staleness). Does not own the
AdamW arithmetic (optim/adamw.py), the loads (window.py asks :meth:`UnitUpdates.gate`) or the
step's all-reduce and skip decision (engine.py).

Hand-offs (engine.py's thread table): the training thread creates each step's futures (one
"measured" and one "updated" per unit final in the backward) and sends them to the optimizer thread
with the step's arrivals (:meth:`UnitUpdates.begin_step`); the optimizer thread resolves them. A
unit's in-backward update becomes the one its next load waits for at :meth:`UnitUpdates.end_backward`.
For a unit final in the backward the optimizer thread, in final order: calls the ``on_final`` hook
(test-only NaN injection), sums the gradient over the replicas (an all-reduce in the stage's group,
which only this thread uses during the backward), takes its norm², and acts on the policy's
verdict. A rollback is a copy of the backup (bit-exact, 12 B/param of private RAM). While it has
nothing queued the thread helps the D2H worker's host adds (:attr:`UnitUpdates.helper`, helper.py).

Why, with the modes' timeline: docs/optimizer.md#the-four-update-modes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nodetrain.core.update import Final, UpdatePolicy
from nodetrain.engine.host.binding import limit_thread
from nodetrain.engine.host.helper import Helper
from nodetrain.engine.host.readiness import GradReadiness
from nodetrain.engine.threads import Tally, check_writer, set_role
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.run.inject import NO_FAULTS, Faults

__all__ = ["UnitUpdates", "update_host_bytes"]

log = logging.getLogger(__name__)


def _init_thread(threads: int, device: torch.device | None) -> None:
    """The optimizer thread's set-up: its role, its OpenMP team and, on CUDA, the rank's device and a
    stream of its own (the cross-replica sum stages gradients through the device, replicas.py; the
    current device and stream are per thread)."""
    set_role("optimizer")
    limit_thread(threads)
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


def update_host_bytes(numel: int, itemsize: int, scaled: bool) -> int:
    """Host bytes one unit's update reads and writes (``StoreAdamW.step_unit`` and the norm²).

    Per element: the norm² reads the gradient (4); the fused AdamW reads master, gradient,
    ``exp_avg``, ``exp_avg_sq`` (16) and writes master and both moments (12); the transfer-copy
    refresh reads master (4) and writes ``itemsize``; a clip (``scaled``) reads and writes the
    gradient (8). No zeroing: the next step's first offload overwrites the accumulator.
    """
    return numel * (4 + 28 + 4 + itemsize + (8 if scaled else 0))


@dataclass(frozen=True)
class _Ticket:
    """One step, as the training thread hands it to the optimizer thread (read-only once sent)."""

    step: int
    lr: float
    arrivals: tuple[int, ...]
    measured: dict[int, Future] = field(default_factory=dict)
    """Unit final in the backward -> its :class:`Final` (in final order)."""
    updated: dict[int, Future] = field(default_factory=dict)
    """Unit final in the backward -> done once the optimizer thread has acted on its verdict."""
    backward_done: threading.Event = field(default_factory=threading.Event)
    """Set by the training thread when the step's last backward is issued (counts in-backward updates)."""


class UnitUpdates:
    """Runs a stage's per-unit AdamW updates, overlapped with compute, and gates loads on them.

    Args:
        optimizer: the stage's AdamW over the host store.
        bindings: per block, the bindings it loads (``HFModel.bindings``).
        blocks: this stage's blocks.
        policy: the update policy (:func:`~nodetrain.core.update.policy_for`).
        shared_units: owned units that another stage also reads (the tied embedding on stage 0):
            always updated after the all-reduce, and waited for before the step ends.
        threads: OpenMP threads of the optimizer thread (≥ 1).
        grad_sum: in-backward only: ``grad_sum([grad])`` sums one unit's flat fp32 gradient over
            the replicas in place (``ReplicaGradSum``); called on the optimizer thread.
        on_final: in-backward only: ``on_final(step, unit)`` is called on the optimizer thread when the
            unit's gradient is final, before the replica sum and its norm² (test-only NaN injection).
        device: the compute device; on CUDA the optimizer thread selects it (``grad_sum`` stages
            through it).
        faults: test-only injection (``Faults.before_update``); default none.
    """

    def __init__(
        self,
        optimizer: StoreAdamW,
        bindings,
        blocks,
        policy: UpdatePolicy,
        *,
        shared_units=(),
        threads: int = 1,
        grad_sum=None,
        on_final=None,
        device: torch.device | None = None,
        faults: Faults = NO_FAULTS,
    ):
        self.opt, self.policy, self._faults = optimizer, policy, faults
        self._owned = [u.index for u in optimizer.units]
        self._shared = [u for u in self._owned if u in set(shared_units)]
        units_of = {b: sorted({x.unit for x in bindings[b]} & set(self._owned)) for b in blocks}
        self._units_of = units_of
        counted = [u for u in self._owned if u not in self._shared] if policy.in_backward else []
        self._readiness = GradReadiness(units_of, counted, [u for u in self._owned if u not in counted])
        self._grad_sum, self._on_final = grad_sum, on_final
        self._pool = self._helper = None
        if policy.overlap:
            self._pool = ThreadPoolExecutor(1, "optim", initializer=_init_thread, initargs=(threads, device))
            self._helper = Helper(self._pool)  # every task of the pool is submitted through it
        # training thread only
        self._pending: dict[int, Future] = {}  # unit -> the update its next load waits for
        self._ticket = _Ticket(0, 0.0, ())
        self._rolled_back = False
        self._trained = Tally("host_bytes", "rollbacks")
        # optimizer thread only (armed by each step's ticket)
        self._step: _Ticket | None = None
        self._stage_sq = 0.0
        self._done = Tally("busy_s", "host_bytes", "in_backward")  # added on the optimizer thread

    # ---- asked by others ---------------------------------------------------------------------

    @property
    def in_backward(self) -> bool:
        """Whether units are updated during the backward (the policy's)."""
        return self.policy.in_backward

    @property
    def speculative(self) -> bool:
        return self.policy.kind == "speculative"

    @property
    def helper(self) -> Helper | None:
        """The optimizer thread, lent to the D2H worker's adds while idle (helper.py); None without
        an optimizer thread (a policy without overlap)."""
        return self._helper

    @property
    def later_units(self) -> list[int]:
        """Owned units the engine settles after the flush (tied sum, replica sum), updated after the
        all-reduce: all of them, or in-backward the shared ones (``GradReadiness.settled``)."""
        return self._readiness.settled

    def gate(self, block: int) -> list[Future]:
        """Updates a load of ``block`` must wait for (training thread, when the load is issued)."""
        return [self._pending[u] for u in self._units_of.get(block, ()) if u in self._pending]

    def wait(self, units) -> None:
        """Block until the submitted updates of ``units`` are done (re-raises their errors)."""
        for u in units:
            for fut in (self._ticket.updated.get(u), self._pending.get(u)):
                if fut is not None:
                    fut.result()

    def wait_all(self) -> None:
        self.wait(self._owned)

    @property
    def nonfinite(self) -> list[int]:
        """In-backward units of the current step left out because their gradient was NaN/inf."""
        return [u for u, f in self._finals().items() if f.action == "drop"]

    # ---- the training thread's step ------------------------------------------------------------

    def begin_step(self, lr: float, arrivals, step: int = 0) -> None:
        """Start (0-based) step ``step`` whose gradients arrive in block order ``arrivals``
        (``StepPlan.arrivals``: a unit is final at its last arrival); in-backward, send it to the
        optimizer thread."""
        check_writer("training", "the step's update futures")
        order = self._readiness.expected_order(arrivals) if self.in_backward else []
        ticket = _Ticket(
            step, lr, tuple(arrivals), {u: Future() for u in order}, {u: Future() for u in order}
        )
        self._ticket, self._rolled_back = ticket, False
        if self.in_backward:
            self._helper.submit(self._arm, ticket)

    def arrived(self, block: int) -> None:
        """D2H worker: ``block``'s gradients landed in the host store. Only posts the message."""
        if self.in_backward:
            self._helper.submit(self._on_arrival, block)

    def end_backward(self) -> None:
        """The step's last backward is issued: its in-backward updates become what loads wait for."""
        check_writer("training", "the update futures loads wait for")
        self._ticket.backward_done.set()
        self._pending.update(self._ticket.updated)

    def wait_measured(self) -> None:
        """Block until every in-backward unit's replica sum and norm² are done (after the flush);
        its update may still run. Afterwards no other thread runs a collective.

        Raises:
            AssertionError: a unit never became final, or out of the schedule's order.
        """
        if self.in_backward:
            self._helper.submit(self._check_complete)  # after every arrival: fails a missing unit's futures
        self._finals()

    def _finals(self) -> dict[int, Final]:
        return {u: fut.result() for u, fut in self._ticket.measured.items()}

    def grad_sq_sum(self, run=None) -> float:
        """This stage's Σ gradient² (after the flush and the tied sum), without racing the updates
        still running: in-backward units were measured when they became final.

        Args:
            run: ``run(fn) -> fn()``, the thread the norm² of the units measured now is computed on
                (the engine passes ``Window.run_host``: the D2H worker, whose OpenMP team is the
                accumulation's, idle after the flush); None = the calling thread.
        """
        run = run or (lambda fn: fn())
        if not self.in_backward:
            return run(self.opt.grad_sq_sum)
        self.wait_measured()
        finals = self._finals()
        if self.policy.keeps_dots:  # the deferred sum's own fp32 terms and order: the same clip coefficient
            dots = {u: f.dots for u, f in finals.items()}
            for u in self._shared:
                dots[u] = run(lambda u=u: self.opt.unit_grad_dots(u))
            return float(sum(d for u in self._owned for d in dots[u]))
        sq = {u: f.sq for u, f in finals.items()}
        for u in self._shared:
            sq[u] = run(lambda u=u: self.opt.unit_grad_sq(u))
        return sum(sq[u] for u in self._owned)

    def finish_step(self, lr: float, grad_scale: float, wait_all: bool = False) -> None:
        """Run what the policy decides after the all-reduce (submitted in forward order; without
        overlap, every unit here); wait for the shared units' updates (another stage reads them after
        the engine's barrier) and, with ``wait_all``, for every update (the store is then final)."""
        check_writer("training", "the update futures loads wait for")
        if not self.policy.overlap:
            t0 = time.perf_counter()
            self.opt.step(lr, grad_scale)
            self._done.add("busy_s", time.perf_counter() - t0)
            self._trained.add("host_bytes", sum(self._update_bytes(u, grad_scale) for u in self._owned))
            return
        finals = self._finals() if self.in_backward else {}
        for u, kind in self.policy.after_allreduce(self._owned, self.later_units, finals, grad_scale):
            self._pending[u] = self._helper.submit(self._apply, u, lr, grad_scale, kind)
            if kind == "update":
                self._trained.add("host_bytes", self._update_bytes(u, grad_scale))
            else:
                self._trained.add("rollbacks", 1)
        self.wait(self._owned if wait_all else self._shared)

    def rollback(self) -> list[int]:
        """A NaN/inf step: wait for every update, then undo those the policy says (speculative:
        master weights, AdamW state, step counts, transfer copies), so the step is skipped whole.
        Returns the units rolled back."""
        check_writer("training", "a rollback")
        self.wait_all()
        units = [] if self._rolled_back else self.policy.rolled_back(self._finals())
        for u in units:
            self.opt.rollback_unit(u)
        self._trained.add("rollbacks", len(units))
        self._rolled_back = True
        return units

    def take_stats(self) -> dict[str, float]:
        """Since the last take: ``optim_busy_s`` (seconds updating), ``optim_host_bytes``
        (:func:`update_host_bytes` of the updates submitted, counted when submitted; an in-backward
        unit left out for a NaN/inf gradient still counts), ``num_updates_in_backward`` (started
        before :meth:`end_backward`), ``num_rollbacks`` (units rolled back, and redone unless the step
        was NaN/inf)."""
        done, trained = self._done.take(), self._trained.take()
        return {
            "optim_busy_s": done["busy_s"],
            "optim_host_bytes": int(done["host_bytes"] + trained["host_bytes"]),
            "num_updates_in_backward": int(done["in_backward"]),
            "num_rollbacks": int(trained["rollbacks"]),
        }

    def close(self) -> None:
        """Finish every submitted update and stop the thread."""
        if self._pool is not None:
            self._helper.close()
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- the optimizer thread ------------------------------------------------------------------

    def _arm(self, ticket: _Ticket) -> None:
        check_writer("optimizer", "the optimizer thread's step")
        self._step, self._stage_sq = ticket, 0.0
        self._readiness.arm(ticket.arrivals)

    def _on_arrival(self, block: int) -> None:
        step = self._step
        try:
            for unit in self._readiness.arrived(block):
                self._finalize(step, unit)
        except BaseException as e:  # every future of the step still open fails with it: no wait hangs
            self._fail(step, e)

    def _finalize(self, step: _Ticket, unit: int) -> None:
        """A unit final in the backward: hook → replica sum → norm² → the policy's verdict, acted on."""
        if self._on_final is not None:
            self._on_final(step.step, unit)
        if self._grad_sum is not None:
            self._grad_sum([self.opt.store.grad(unit)])
        dots = self.opt.unit_grad_dots(unit) if self.policy.keeps_dots else None
        sq = sum(float(d) for d in dots) if dots is not None else self.opt.unit_grad_sq(unit)
        if math.isfinite(sq):
            self._stage_sq += sq
        action = self.policy.on_final(sq, self._stage_sq)
        if action == "drop":  # left out: no NaN/inf into the master weights or AdamW's state
            self.opt.drop_unit_grads(unit)
        self._done.add("host_bytes", self._update_bytes(unit, 1.0))
        step.measured[unit].set_result(Final(sq, dots, action))
        if action in ("update", "speculate"):
            self._apply(unit, step.lr, 1.0, action, step)
        step.updated[unit].set_result(None)

    def _apply(self, unit: int, lr: float, grad_scale: float, kind: str, step: _Ticket | None = None) -> None:
        """One unit's AdamW step; ``speculate`` backs the unit up first, ``redo`` undoes its speculative
        update first (its gradient, the unscaled sum, is still in the accumulator)."""
        check_writer("optimizer", f"unit {unit}'s update")
        self._faults.before_update()
        if step is not None and not step.backward_done.is_set():
            self._done.add("in_backward", 1)
        t0 = time.perf_counter()
        if kind == "speculate":
            self.opt.backup_unit(unit)
        elif kind == "redo":
            self.opt.rollback_unit(unit, refresh=False)
        self.opt.step_unit(unit, lr, grad_scale)
        self._done.add("busy_s", time.perf_counter() - t0)

    def _check_complete(self) -> None:
        missing = self._readiness.missing()
        if missing:
            self._fail(
                self._step, AssertionError(f"units {missing} never became final; offload count mismatch")
            )

    @staticmethod
    def _fail(step: _Ticket, error: BaseException) -> None:
        for fut in [*step.measured.values(), *step.updated.values()]:
            if not fut.done():
                fut.set_exception(error)

    def _update_bytes(self, unit: int, grad_scale: float) -> int:
        store = self.opt.store
        itemsize = torch.empty(0, dtype=store.layout.compute_dtype).element_size()
        return update_host_bytes(store.layout.unit_numels[unit], itemsize, grad_scale != 1.0)
