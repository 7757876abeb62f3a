"""Overlapped CPU optimizer: when each owned unit's AdamW runs, on which thread, and who waits for it.

One step of a stage holding units u0 u1 u2 (time →), the two main modes:

    training thread   | F u0 | F u1 | F u2 | B u2 | B u1 | B u0 | all-reduce | next F u0 | F u1 ...
    D2H worker        |      |      |      |  +acc u2 | +acc u1 | +acc u0 |
    optimizer thread  in-backward:          | AdamW u2 | AdamW u1 | AdamW u0 |    (norm² finite)
                      deferred:                                    | AdamW u0 | AdamW u1 | AdamW u2 |
    next step's load of u0 waits (gate) for u0's update only; u1's for u1's, and so on.

Owns: one background optimizer thread per rank (with its own OpenMP team of ``optim.threads``),
deciding when a unit's update is submitted, the per-unit non-finite guard of in-backward updates,
and the futures that make a load of a unit wait for its update (DESIGN invariant 3: overlap, never
staleness). Does not own: the AdamW arithmetic (optim/adamw.py), the loads (window.py calls
:meth:`UnitUpdates.gate` when it issues one) or the step's all-reduce and skip decision (engine.py).

When a unit is updated (:func:`update_mode` decides, the engine logs its reason at start-up):
    in-backward (``optim.overlap``, ``optim.max_grad_norm=0``, ``optim.update_in_backward``)  as
        soon as its gradient is final, i.e. after the last offload of the step of every block
        binding it (counted on the D2H worker), so updates run during the rest of the backward.
        The optimizer thread then, per unit and in the order the units became final: calls the
        ``on_final`` hook (test-only NaN injection), sums the gradient over the replicas (several
        nodes: an all-reduce in the stage's group, which only this thread uses during the
        backward), takes its norm², and applies AdamW only if that norm² is finite.
    speculative (clipping, ``optim.speculative``; SuperOffload's speculation-then-validation,
        arXiv:2509.21271)  as in-backward, with coefficient 1 and a backup of the unit first
        (``StoreAdamW.backup_unit``). Once the all-reduce gives the clip coefficient: 1, the updates
        stand; < 1, each speculated unit is rolled back from its backup and redone with it (on the
        optimizer thread, in forward order, gated like a deferred update); NaN/inf, they are rolled
        back and the step is skipped whole, as deferred. Once the stage's own norm so far exceeds
        ``max_grad_norm`` the step surely clips: the rest of its units are held for the all-reduce.
        Rollback is a copy (bit-exact, 12 B/param of private RAM), not AdamW's closed-form inverse,
        whose ~1 ulp error in ``exp_avg_sq`` a small clip coefficient c magnifies by 1/c².
    deferred (clipping, or ``optim.update_in_backward=false``)  after the step's all-reduce gives
        the clip coefficient (and says whether the step is finite), unit by unit in the order the
        next step's forward loads them; the forward of unit i waits only for unit i. The engine
        sums gradients over the replicas on its training thread before that all-reduce.
    A unit another stage also reads (the tied embedding, owned by stage 0 and bound by the last
    stage's head) is always updated after the all-reduce (its gradient is final only after the tied
    sum) and waited for before the step ends, so the engine's barrier publishes it.
With ``optim.overlap=false`` every unit is updated at the end of the step on the training thread.

NaN/inf semantics (issue: faults; no non-finite value ever reaches master weights or AdamW state):
    deferred  the whole step is skipped on every stage: no unit is updated, AdamW's step counts
        stay, gradients are dropped (engine.py).
    speculative  as deferred: the speculative updates are rolled back (``UnitUpdates.rollback``).
    in-backward  a unit whose gradient is NaN/inf is not updated (its accumulators are zeroed, its
        master weights, ``exp_avg``, ``exp_avg_sq`` and step count stay) and shows in
        :attr:`UnitUpdates.nonfinite`; the finite units of that step were already updated. The
        step's totals are still non-finite, so the engine reports it skipped (``train.max_bad_steps``
        counts it) and does not update the units left for after the all-reduce (the tied embedding).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nodetrain.config.schema import OptimConfig
from nodetrain.engine.host_threads import limit_thread
from nodetrain.optim.adamw import StoreAdamW

__all__ = ["UnitUpdates", "update_kind", "update_mode", "final_order", "update_host_bytes"]

log = logging.getLogger(__name__)


def _init_thread(threads: int, device: torch.device | None) -> None:
    """The optimizer thread's set-up: its OpenMP team and, on CUDA, the rank's device and a stream of
    its own (the cross-replica sum stages gradients through the device, replicas.py; the current
    device and stream are per thread)."""
    limit_thread(threads)
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


def update_kind(cfg: OptimConfig) -> str:
    """Which update mode ``cfg`` runs: ``serial`` (``optim.overlap=false``), ``speculative``,
    ``deferred``, ``in_backward`` (``plan/exposure.py`` prices each), or ``auto``: ``optim.speculative=auto``
    where speculation applies (clipping, overlap, ``update_in_backward``), which the engine resolves
    to speculative or deferred at start-up (``engine/update_choice.py``)."""
    if not cfg.overlap:
        return "serial"
    if cfg.max_grad_norm > 0 and cfg.update_in_backward and cfg.speculative in (True, "auto"):
        return "speculative" if cfg.speculative is True else "auto"
    if cfg.max_grad_norm > 0 or not cfg.update_in_backward:
        return "deferred"
    return "in_backward"


def update_mode(cfg: OptimConfig) -> tuple[bool, str]:
    """Whether units are updated during the backward, and why (one line for the start-up log).

    Args:
        cfg: the optimizer config (``overlap``, ``max_grad_norm``, ``update_in_backward``,
            ``speculative``: true or false; ``auto`` is resolved first, ``engine/update_choice.py``).

    Returns:
        (in_backward, reason).

    Raises:
        ValueError: ``optim.speculative=auto`` not yet resolved where it applies.
    """
    kind = update_kind(cfg)
    if kind == "auto":
        raise ValueError(
            "optim.speculative=auto: resolve it to true or false first (engine/update_choice.py)"
        )
    if kind == "serial":
        return False, "optim.overlap=false: every unit is updated at the step's end on the training thread"
    if kind == "speculative":
        return True, (
            f"optim.max_grad_norm={cfg.max_grad_norm} with optim.speculative=true: each unit is updated "
            "during the backward as if the step were not clipped; a step that clips has those updates "
            "rolled back and redone with the clip coefficient, a NaN/inf step has them rolled back "
            "(skipped whole)"
        )
    if cfg.max_grad_norm > 0:
        return False, (
            f"optim.max_grad_norm={cfg.max_grad_norm}: the clip needs the global norm, so updates run after "
            "the step's all-reduce, overlapped with the next step's forward; a NaN/inf step is skipped whole"
        )
    if kind == "deferred":
        return False, (
            "optim.update_in_backward=false: updates run after the step's all-reduce, overlapped with the "
            "next step's forward; a NaN/inf step is skipped whole"
        )
    return True, (
        "no clipping and optim.update_in_backward=true: each unit is updated during the backward as soon "
        "as its gradient is final; a unit with a NaN/inf gradient is left out, the finite ones applied"
    )


def update_host_bytes(numel: int, itemsize: int, scaled: bool) -> int:
    """Host bytes one unit's update reads and writes (``StoreAdamW.step_unit`` and the norm²).

    Per element: the norm² reads the gradient (4); the fused AdamW reads master, gradient,
    ``exp_avg``, ``exp_avg_sq`` (16) and writes master and both moments (12); the transfer-copy
    refresh reads master (4) and writes ``itemsize``; a clip (``scaled``) reads and writes the
    gradient (8). No zeroing: the next step's first offload overwrites the accumulator.
    """
    return numel * (4 + 28 + 4 + itemsize + (8 if scaled else 0))


def final_order(offload_blocks, units_of: dict[int, list[int]]) -> list[int]:
    """The order in which units' gradients become final, given the blocks in offload order.

    A unit is final at the last offload of any block binding it; units final at the same offload
    come in ``units_of[block]`` order (as :meth:`UnitUpdates.offloaded` visits them). A pure function
    of the schedule, so it is the same on every replica of a stage: the replicas' per-unit
    all-reduces pair up.

    Args:
        offload_blocks: block indices in the order their gradients are offloaded in a step.
        units_of: per block, the units whose gradients it offloads (counted ones only).
    """
    last: dict[int, tuple[int, int]] = {}
    for pos, block in enumerate(offload_blocks):
        for k, u in enumerate(units_of.get(block, ())):
            last[u] = (pos, k)
    return sorted(last, key=last.__getitem__)


class UnitUpdates:
    """Runs a stage's per-unit AdamW updates, overlapped with compute, and gates loads on them.

    Args:
        optimizer: the stage's AdamW over the host store.
        bindings: per block, the bindings it loads (``HFModel.bindings``).
        blocks: this stage's blocks.
        shared_units: owned units that another stage also reads (the tied embedding on stage 0).
        overlap: run updates on the background thread (else on the caller, at the step's end).
        clip: global-norm clipping is on (updates wait for the step's all-reduce, unless
            ``speculative``).
        threads: OpenMP threads of the optimizer thread (≥ 1).
        delay_s: test-only sleep before each update, to expose a missing wait.
        defer: no update starts during the backward; all wait for the engine's all-reduce
            (``optim.update_in_backward=false``: a NaN/inf step is then skipped whole).
        grad_sum: in-backward only: ``grad_sum([grad])`` sums one unit's flat fp32 gradient over
            the replicas in place (``ReplicaGradSum``); called on the optimizer thread.
        on_final: in-backward only: ``on_final(unit)`` is called on the optimizer thread when the
            unit's gradient is final, before the replica sum and its norm² (test-only NaN injection).
        device: the compute device; on CUDA the optimizer thread selects it (``grad_sum`` stages
            through it).
        speculative: with ``clip``: update in the backward as if unclipped, backing each unit up
            first; :meth:`finish_step` rolls back and redoes them when the step clipped,
            :meth:`rollback` when it was NaN/inf (``optim.speculative``).
        max_grad_norm: the clip threshold (speculative only): once this stage's own norm exceeds
            it, the step surely clips and the remaining units are held for :meth:`finish_step`.
    """

    def __init__(self, optimizer: StoreAdamW, bindings, blocks, shared_units=(), *, overlap: bool,
                 clip: bool, threads: int, delay_s: float = 0.0, defer: bool = False, grad_sum=None,
                 on_final=None, device: torch.device | None = None, speculative: bool = False,
                 max_grad_norm: float = 0.0):  # fmt: skip
        self.opt, self.overlap, self.clip, self.defer = optimizer, overlap, clip, defer
        self.speculative = speculative and clip and overlap and not defer
        self._max_norm = max_grad_norm
        self._speculated: list[int] = []  # units updated as if unclipped this step (backed up first)
        self._held: list[int] = []  # units held for finish_step: the step surely clips
        self._stage_sq = 0.0  # Σ norm² of this step's units measured so far (a lower bound)
        self._rollbacks = 0
        self._dots: dict[int, list[torch.Tensor]] = {}  # speculative: each unit's fp32 Σ g² terms
        self._owned = [u.index for u in optimizer.units]
        self._shared = set(shared_units)
        self._units_of = {b: sorted({x.unit for x in bindings[b]} & set(self._owned)) for b in blocks}
        self._users = {u: [b for b in blocks if u in self._units_of[b]] for u in self._owned}
        self._delay_s = delay_s
        self._grad_sum, self._on_final = grad_sum, on_final
        self._pool = None
        if overlap:
            self._pool = ThreadPoolExecutor(1, "optim", initializer=_init_thread, initargs=(threads, device))
        self._pending: dict[int, Future] = {}
        self._measured: dict[int, Future] = {}  # in-backward unit -> its norm², once measured
        self._remaining: dict[int, int] = {}
        self._grad_sq: dict[int, float] = {}
        self._order: list[int] | None = None  # the expected order of in-backward units (final_order)
        self._num_final = 0
        self._lr = 0.0
        self._lock = threading.Lock()
        self._step_id = 0
        self._backward_done = False
        self._in_backward_count = 0
        self.nonfinite: list[int] = []
        """In-backward units of the current step left out because their gradient was NaN/inf."""
        self.busy_s = 0.0
        """Seconds the optimizer spent updating units (overlapped or not) since the last take."""
        self.host_bytes = 0
        """Host bytes of the updates submitted since the last take (:func:`update_host_bytes`;
        counted when submitted, so a step's figure does not depend on how far its overlapped
        updates got; an in-backward unit left out for a NaN/inf gradient is still counted)."""

    # ---- gating ------------------------------------------------------------------------------

    def gate(self, block: int) -> list[Future]:
        """Updates a load of ``block`` must wait for (called when the load is issued)."""
        return [self._pending[u] for u in self._units_of.get(block, ()) if u in self._pending]

    def wait(self, units) -> None:
        """Block until the submitted updates of ``units`` are done (re-raises their errors)."""
        for u in units:
            fut = self._pending.get(u)
            if fut is not None:
                fut.result()

    def wait_all(self) -> None:
        self.wait(self._owned)

    # ---- one step ----------------------------------------------------------------------------

    @property
    def in_backward(self) -> bool:
        """Whether units are updated during the backward (overlap, not deferred, and no clipping or
        speculative)."""
        return self.overlap and not self.defer and (not self.clip or self.speculative)

    @property
    def later_units(self) -> list[int]:
        """Owned units whose gradient the engine finalises after the flush (tied sum, replica sum)
        and which are updated after the all-reduce: all of them, or in-backward the shared ones."""
        return [u for u in self._owned if not self.in_backward or u in self._shared]

    def begin_step(self, lr: float, offloads_per_block: int | dict[int, int], offload_order=None) -> None:
        """Arm the final-gradient count: a unit is final after every offload of the blocks binding it.

        Args:
            lr: this step's learning rate.
            offloads_per_block: offloads (arrivals in the host store) of each of this stage's blocks
                in the step: one count for all, or block -> count (a resident block arrives once a
                step, its device accumulator; window.py).
            offload_order: optional, the step's blocks in offload order; the units must then become
                final in :func:`final_order` (asserted on the optimizer thread).
        """
        counts = offloads_per_block
        if isinstance(counts, int):
            counts = dict.fromkeys(self._units_of, counts)
        self._lr = lr
        self._grad_sq.clear()
        self._measured.clear()
        self.nonfinite = []
        self._speculated, self._held, self._stage_sq = [], [], 0.0
        self._dots.clear()
        self._remaining = {
            u: sum(counts.get(b, 0) for b in self._users[u]) for u in self._owned if u not in self._shared
        }
        self._order = None
        if offload_order is not None:
            units_of = {b: [u for u in us if u in self._remaining] for b, us in self._units_of.items()}
            self._order = final_order(offload_order, units_of)
        self._num_final = 0
        with self._lock:
            self._step_id += 1
            self._backward_done = False
            self._in_backward_count = 0

    def offloaded(self, block: int) -> None:
        """The D2H worker accumulated one gradient of ``block``; a unit whose count reaches zero is
        final and goes to the optimizer thread (only when :attr:`in_backward`)."""
        if not self.in_backward:
            return
        for u in self._units_of[block]:
            if u not in self._remaining:
                continue
            self._remaining[u] -= 1
            if self._remaining[u] == 0:
                self._measured[u] = Future()
                self._pending[u] = self._pool.submit(self._finalize, u, self._lr, self._step_id)
                with self._lock:
                    self.host_bytes += self._update_bytes(u, 1.0)

    def _finalize(self, unit: int, lr: float, step_id: int) -> None:
        """Optimizer thread, in-backward: hook → replica sum → norm² → AdamW if finite."""
        measured = self._measured[unit]
        try:
            if self._order is not None:
                want = self._order[self._num_final]
                assert unit == want, f"unit {unit} became final where the schedule puts unit {want}"
                self._num_final += 1
            if self._on_final is not None:
                self._on_final(unit)
            if self._grad_sum is not None:
                self._grad_sum([self.opt.store.grad(unit)])
            if self.speculative:  # its terms kept: the step's norm then adds them as deferred does
                self._dots[unit] = self.opt.unit_grad_dots(unit)
                sq = sum(float(d) for d in self._dots[unit])
            else:
                sq = self.opt.unit_grad_sq(unit)
            if not math.isfinite(sq):  # left out: no NaN/inf into the master weights or AdamW's state
                self.opt.drop_unit_grads(unit)
                self.nonfinite.append(unit)
            self._grad_sq[unit] = sq
            speculate = self._speculate(unit, sq)
        except BaseException as e:
            measured.set_exception(e)
            raise
        measured.set_result(sq)
        if speculate:
            self._update(unit, lr, 1.0, step_id, backup=self.speculative)

    def _speculate(self, unit: int, sq: float) -> bool:
        """Whether a final unit with norm² ``sq`` is updated now (coefficient 1). Speculative, a unit
        is held for :meth:`finish_step` once this stage's norm so far says the step clips
        (``clip_coef`` < 1 for sure: the global norm² is at least this stage's), else recorded as
        speculated (before the training thread can see its norm², so finish_step knows it)."""
        if not math.isfinite(sq):
            return False
        if not self.speculative:
            return True
        self._stage_sq += sq
        if math.sqrt(self._stage_sq) + 1e-6 > self._max_norm:
            self._held.append(unit)
            return False
        self._speculated.append(unit)
        return True

    def wait_measured(self) -> None:
        """Block until every in-backward unit's replica sum and norm² are done (after the flush, all
        are submitted); its update may still run. Afterwards no other thread runs a collective."""
        for fut in list(self._measured.values()):
            fut.result()

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
        missing = [u for u in self._owned if u not in self._shared and u not in self._grad_sq]
        assert not missing, f"units {missing} never became final; offload count mismatch"
        if self.speculative:  # the deferred sum's own fp32 terms and order: the same clip coefficient
            for u in self._shared:
                self._dots[u] = run(lambda u=u: self.opt.unit_grad_dots(u))
            return float(sum(d for u in self._owned for d in self._dots[u]))
        for u in self._shared:
            self._grad_sq[u] = run(lambda u=u: self.opt.unit_grad_sq(u))
        return sum(self._grad_sq[u] for u in self._owned)

    def end_backward(self) -> None:
        """The training thread finished the step's last backward (issued it, on CUDA)."""
        with self._lock:
            self._backward_done = True

    def take_in_backward_count(self) -> int:
        """Updates of the current step whose AdamW started before :meth:`end_backward`."""
        with self._lock:
            return self._in_backward_count

    def finish_step(self, lr: float, grad_scale: float, wait_all: bool = False) -> None:
        """Submit (or, without overlap, run) the updates not yet started, in forward order; wait for
        the shared units' updates (another stage reads them after the engine's barrier) and, with
        ``wait_all``, for every update (the run's last step: the store is then final)."""
        if not self.overlap:
            t0 = time.perf_counter()
            self.opt.step(lr, grad_scale)
            self.busy_s += time.perf_counter() - t0
            self.host_bytes += sum(self._update_bytes(u, grad_scale) for u in self._owned)
            return
        if self.speculative:
            self._validate(lr, grad_scale)
        else:
            for u in self.later_units:
                self._submit(u, lr, grad_scale)
        self.wait(self._owned if wait_all else self._shared)

    def _validate(self, lr: float, grad_scale: float) -> None:
        """Speculative: the step's coefficient is known. Submit, in forward order, the units not yet
        updated (shared, held) and, if the step clipped (``grad_scale`` < 1), a rollback and redo of
        every speculated unit; an unclipped step keeps the speculative updates as they are."""
        redo = set(self._speculated) if grad_scale != 1.0 else set()
        later = set(self.later_units) | set(self._held)
        for u in self._owned:
            if u in later:
                self._submit(u, lr, grad_scale)
            elif u in redo:
                self._pending[u] = self._pool.submit(self._redo, u, lr, grad_scale)
        self._rollbacks += len(redo)

    def rollback(self) -> list[int]:
        """Speculative, a NaN/inf step: wait for every update, then undo the step's speculative
        updates (master weights, AdamW state, step counts, transfer copies), so the step is skipped
        whole. Returns the units rolled back."""
        self.wait_all()
        units = self._speculated if self.speculative else []
        for u in units:
            self.opt.rollback_unit(u)
        self._rollbacks += len(units)
        self._speculated = []
        return units

    def take_rollbacks(self) -> int:
        """Units rolled back (and redone, unless the step was NaN/inf) since the last take."""
        n, self._rollbacks = self._rollbacks, 0
        return n

    def _submit(self, unit: int, lr: float, grad_scale: float) -> None:
        assert self._pool is not None
        self._pending[unit] = self._pool.submit(self._update, unit, lr, grad_scale, self._step_id)
        with self._lock:
            self.host_bytes += self._update_bytes(unit, grad_scale)

    def _update(self, unit: int, lr: float, grad_scale: float, step_id: int, backup: bool = False) -> None:
        if self._delay_s:
            time.sleep(self._delay_s)
        with self._lock:
            if step_id == self._step_id and not self._backward_done:
                self._in_backward_count += 1
        t0 = time.perf_counter()
        if backup:
            self.opt.backup_unit(unit)
        self.opt.step_unit(unit, lr, grad_scale)
        with self._lock:
            self.busy_s += time.perf_counter() - t0

    def _redo(self, unit: int, lr: float, grad_scale: float) -> None:
        """Optimizer thread: undo a speculative update and apply the clipped one (its gradient, the
        unscaled sum, is still in the accumulator); step_unit refreshes the transfer copy."""
        if self._delay_s:
            time.sleep(self._delay_s)
        t0 = time.perf_counter()
        self.opt.rollback_unit(unit, refresh=False)
        self.opt.step_unit(unit, lr, grad_scale)
        with self._lock:
            self.busy_s += time.perf_counter() - t0

    def _update_bytes(self, unit: int, grad_scale: float) -> int:
        store = self.opt.store
        itemsize = torch.empty(0, dtype=store.layout.compute_dtype).element_size()
        return update_host_bytes(store.layout.unit_numels[unit], itemsize, grad_scale != 1.0)

    def take_busy_s(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

    def take_host_bytes(self) -> int:
        """Host bytes of the updates submitted since the last call."""
        with self._lock:
            out, self.host_bytes = self.host_bytes, 0
        return out

    def close(self) -> None:
        """Finish every submitted update and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
