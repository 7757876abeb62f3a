"""Overlapped CPU optimizer: when each owned unit's AdamW runs, on which thread, and who waits for it.

Owns: one background optimizer thread per rank (with its own OpenMP team of ``optim.threads``),
deciding when a unit's update is submitted, and the futures that make a load of a unit wait for
its update (DESIGN invariant 3: overlap, never staleness). Does not own: the AdamW arithmetic
(optim.py) or the loads (stream.py calls :meth:`UnitUpdates.gate` when it issues one).

When a unit is updated:
    no clipping (``optim.max_grad_norm=0``)  as soon as its gradient is final, i.e. after the
        last offload of the step of every block binding it (counted on the D2H worker), so
        updates run during the rest of the backward;
    clipping  after the step's all-reduce gives the clip coefficient, unit by unit in the order
        the next step's forward loads them; the forward of unit i waits only for unit i.
    several replicas (nodes)  as with clipping: the engine sums every owned unit's gradient across
        the nodes after the flush, from its training thread in the same order on every replica, and
        only then are updates submitted.
    A unit another stage also reads (the tied embedding, owned by stage 0 and bound by the last
    stage's head) is updated after the tied gradient sum and waited for before the step ends, so
    the engine's barrier publishes it.
With ``optim.overlap=false`` every unit is updated at the end of the step on the training thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from nodetrain.optim import StoreAdamW

__all__ = ["UnitUpdates", "fair_share_threads"]

log = logging.getLogger(__name__)


def fair_share_threads() -> int:
    """The node's usable cores divided by the ranks on it (``LOCAL_WORLD_SIZE``), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp/libiomp), found in this process's mappings (Linux)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5")) and ".so" in name:
            return ctypes.CDLL(path)
    return None


def _limit_thread(threads: int) -> None:
    """Give the calling thread an OpenMP team of ``threads``.

    ``torch.set_num_threads`` would also change MKL's process-wide count (the training thread's
    matmuls); ``omp_set_num_threads`` sets only the calling thread's team size, which is what
    torch's ``parallel_for`` (and so the fused AdamW kernel) reads.
    """
    torch.get_num_threads()  # torch's lazy per-thread init first, so it does not undo ours
    runtime = _openmp_runtime()
    if runtime is None:
        log.warning("no OpenMP runtime found; the optimizer thread uses torch's thread count")
        return
    runtime.omp_set_num_threads(threads)


class UnitUpdates:
    """Runs a stage's per-unit AdamW updates, overlapped with compute, and gates loads on them.

    Args:
        optimizer: the stage's AdamW over the host store.
        bindings: per block, the bindings it loads (``HFModel.bindings``).
        blocks: this stage's blocks.
        shared_units: owned units that another stage also reads (the tied embedding on stage 0).
        overlap: run updates on the background thread (else on the caller, at the step's end).
        clip: global-norm clipping is on (updates wait for the step's all-reduce).
        threads: OpenMP threads of the optimizer thread (≥ 1).
        delay_s: test-only sleep before each update, to expose a missing wait.
        defer: no update starts during the backward; all wait for the engine's all-reduce. The
            engine defers because a gradient is final only after the cross-node sum (several
            replicas) and because a NaN/inf step must be skipped on every stage (issue: faults), which
            is known only after that all-reduce. Updates still overlap the next step's forward.
    """

    def __init__(self, optimizer: StoreAdamW, bindings, blocks, shared_units=(), *, overlap: bool,
                 clip: bool, threads: int, delay_s: float = 0.0, defer: bool = False):  # fmt: skip
        self.opt, self.overlap, self.clip, self.defer = optimizer, overlap, clip, defer
        self._owned = [u.index for u in optimizer.units]
        self._shared = set(shared_units)
        self._units_of = {b: sorted({x.unit for x in bindings[b]} & set(self._owned)) for b in blocks}
        self._users = {u: [b for b in blocks if u in self._units_of[b]] for u in self._owned}
        self._delay_s = delay_s
        self._pool = None
        if overlap:
            self._pool = ThreadPoolExecutor(1, "optim", initializer=_limit_thread, initargs=(threads,))
        self._pending: dict[int, Future] = {}
        self._remaining: dict[int, int] = {}
        self._grad_sq: dict[int, float] = {}
        self._lr = 0.0
        self._lock = threading.Lock()
        self.busy_s = 0.0
        """Seconds the optimizer spent updating units (overlapped or not) since the last take."""

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
        """Whether units are updated during the backward (overlap, no clipping, not deferred)."""
        return self.overlap and not self.clip and not self.defer

    def begin_step(self, lr: float, offloads_per_block: int) -> None:
        """Arm the final-gradient count: every block gets ``offloads_per_block`` offloads a step."""
        self._lr = lr
        self._grad_sq.clear()
        self._remaining = {
            u: offloads_per_block * len(self._users[u]) for u in self._owned if u not in self._shared
        }

    def offloaded(self, block: int) -> None:
        """The D2H worker accumulated one gradient of ``block``; a unit whose count reaches zero is
        final: its norm² is taken now and its update submitted (only when :attr:`in_backward`)."""
        if not self.in_backward:
            return
        for u in self._units_of[block]:
            if u not in self._remaining:
                continue
            self._remaining[u] -= 1
            if self._remaining[u] == 0:
                self._grad_sq[u] = self.opt.unit_grad_sq(u)
                self._submit(u, self._lr, 1.0)

    def grad_sq_sum(self) -> float:
        """This stage's Σ gradient² (after the flush and the tied sum), without racing the updates
        already running: in-backward units were measured when they became final."""
        if not self.in_backward:
            return self.opt.grad_sq_sum()
        missing = [u for u in self._owned if u not in self._shared and u not in self._grad_sq]
        assert not missing, f"units {missing} never became final; offload count mismatch"
        for u in self._shared:
            self._grad_sq[u] = self.opt.unit_grad_sq(u)
        return sum(self._grad_sq[u] for u in self._owned)

    def finish_step(self, lr: float, grad_scale: float, wait_all: bool = False) -> None:
        """Submit (or, without overlap, run) the updates not yet started, in forward order; wait for
        the shared units' updates (another stage reads them after the engine's barrier) and, with
        ``wait_all``, for every update (the run's last step: the store is then final)."""
        if not self.overlap:
            t0 = time.perf_counter()
            self.opt.step(lr, grad_scale)
            self.busy_s += time.perf_counter() - t0
            return
        for u in self._owned:
            if not self.in_backward or u in self._shared:
                self._submit(u, lr, grad_scale)
        self.wait(self._owned if wait_all else self._shared)

    def _submit(self, unit: int, lr: float, grad_scale: float) -> None:
        assert self._pool is not None
        self._pending[unit] = self._pool.submit(self._update, unit, lr, grad_scale)

    def _update(self, unit: int, lr: float, grad_scale: float) -> None:
        if self._delay_s:
            time.sleep(self._delay_s)
        t0 = time.perf_counter()
        self.opt.step_unit(unit, lr, grad_scale)
        with self._lock:
            self.busy_s += time.perf_counter() - t0

    def take_busy_s(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

    def close(self) -> None:
        """Finish every submitted update and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
