"""The NVMe tier (``store.tier=nvme``): the optimizer's own state below host RAM, read ahead of each
unit's update and written back behind it.

Owns: :class:`TieredOptimizer`, which wraps the stage's AdamW (full or lean) so that every
:meth:`~TieredOptimizer.step_unit` finds the unit's tier fields (cost/tier.py :data:`TIER_FIELDS`:
``full`` fp32 master, ``exp_avg``, ``exp_avg_sq``; ``lean`` the quantized moments and their absmax) in
RAM, and the bounded pool that holds them; the two I/O threads (one reads, one writes back); the reads
other components make of tier state (:meth:`~TieredOptimizer.read_fields`: checkpoint save, tests).
Does not own the arithmetic (adamw.py, lean.py), the file's bytes (tier_files.py) or when a unit is
updated (core/update.py, engine/host/overlap.py: the tier only follows the updates it is handed).

Design (see docs/tier.md):
    - Where the bytes live: the tier fields keep their place in the host store's layout, so every
      view the optimizer built stays valid; while a unit is read, updated or written back, one of
      the pool's ``store.tier_buffers`` page-aligned slots is mapped over those ranges (tier_files.py),
      otherwise they hold no memory and the file holds the state. RAM keeps the transfer copy, the
      gradient accumulator and the pool.
    - Order: the first step reads in owned (forward) order; afterwards the order the updates came in
      (learned over one cycle of every owned unit), cyclically: after unit i's update the reads of the
      units that follow it are issued while slots are free, so the next step's first units are read
      during the forward and backward. A unit out of that order is read on demand (a clean read-ahead
      unit is dropped for it when the pool is full): order only moves time, never bytes.
    - Exactness: an update runs on the same bytes as with ``store.tier=ram`` (a read completes
      before the update, a write-back completes before the unit's next read), so runs are bit-equal.
    - Hand-offs (engine.py's thread table): the updating thread (``optimizer``; ``training`` with
      ``optim.overlap=false``) alone writes the pool's bookkeeping and hands reads and write-backs to
      the ``tier`` threads as futures; the tier threads write only the unit's bytes (store range or
      file). The training thread reads the file (:meth:`read_fields`) only after every update is done.
    - Failure: an I/O error ends the update that waits for it (a read) or the next update of the
      stage (a write-back, reaped after every update), and so the step and the rank, as any error of
      the optimizer thread; a unit whose write-back failed is never read back.
    - Speculative updates are refused with the tier (config/tier_checks.py): their backups would hold
      12 B/param of fp32 state in RAM, the bytes the tier exists to keep out of it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nodetrain.optim.tier_files import TierFile

__all__ = ["TieredOptimizer"]


def _no_check(owner: str, what: str) -> None:
    return None


class TieredOptimizer:
    """The stage's AdamW with its tier fields in a :class:`TierFile`; every other attribute is the
    wrapped optimizer's.

    Args:
        inner: the stage's ``StoreAdamW`` or ``LeanAdamW`` over the host store.
        tier: this rank's open tier file (over the same store).
        buffers: ``store.tier_buffers``: units whose tier fields may be in RAM at once (≥ 2).
        owner: the thread that runs updates (``optimizer``, or ``training`` without overlap).
        thread_init: initializer of the I/O threads (gives them their role); check_writer: the
            debug writer check (engine/threads.py's), called on each update.
    """

    def __init__(
        self,
        inner,
        tier: TierFile,
        buffers: int,
        owner: str = "optimizer",
        thread_init=None,
        check_writer=_no_check,
    ):
        assert buffers >= 2, buffers
        self.inner, self.tier, self.buffers, self._owner = inner, tier, buffers, owner
        self._check = check_writer
        self._reader = ThreadPoolExecutor(1, "tier-read", initializer=thread_init)
        self._writer = ThreadPoolExecutor(1, "tier-write", initializer=thread_init)
        owned = [u.index for u in inner.units]
        tier.open_pool(buffers, owned)
        # the updating thread only
        self._order, self._seen = owned, []
        self._reads: dict[int, Future] = {}  # units holding a slot: being read, or read (clean)
        self._writes: dict[int, Future] = {}  # units being written back (their slot frees when done)
        self._slots: dict[int, int] = {}  # unit -> its pool slot (units in _reads or _writes)
        self._free = list(range(buffers))
        self.read_bytes = self.write_bytes = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # ---- the updating thread -----------------------------------------------------------------

    def step_unit(self, unit: int, lr: float, grad_scale: float = 1.0, found_inf=None) -> None:
        """The wrapped ``step_unit`` between the read of ``unit``'s tier fields and their write-back
        (which is left running); then the read-ahead of the units that follow it.

        Raises:
            TierIOError: a read or a write-back of this stage's tier failed (file, offset, errno).
        """
        self._check(self._owner, "the tier's pool")
        self._acquire(unit)
        self.inner.step_unit(unit, lr, grad_scale, found_inf)
        self._writes[unit] = self._writer.submit(self.tier.write_unit, unit)
        del self._reads[unit]
        self.write_bytes += self.tier.layout.unit_nbytes(unit)
        self._reap()
        self._learn(unit)
        self._read_ahead(unit)

    def step(self, lr: float, grad_scale: float) -> None:
        """Update every owned unit, in order (see :meth:`step_unit`)."""
        for u in self.inner.units:
            self.step_unit(u.index, lr, grad_scale)

    def fill(self, unit: int, init) -> None:
        """Start-up: ``init()`` writes ``unit``'s state into the store (import, resume, random init),
        then it is written to the file and its pages released. Raises as :meth:`step_unit`."""
        self._acquire(unit, read=False)
        self.tier.zero_unit(unit)
        init()
        self._writes[unit] = self._writer.submit(self.tier.write_unit, unit)
        del self._reads[unit]
        self.wait_written()

    def backup_unit(self, unit: int) -> None:
        raise NotImplementedError("speculative updates are refused with store.tier=nvme (tier_checks.py)")

    rollback_unit = backup_unit

    def _acquire(self, unit: int, read: bool = True) -> None:
        if unit in self._reads:
            self._reads[unit].result()
            return
        if unit in self._writes:
            self._written(unit)  # the unit's next read follows its write-back
        while not self._free:
            self._free_slot()
        if read:
            self._start_read(unit)
        else:
            self._slots[unit] = self._free.pop()
            self.tier.map_unit(unit, self._slots[unit])
            self._reads[unit] = Future()
            self._reads[unit].set_result(None)
        self._reads[unit].result()

    def _start_read(self, unit: int) -> None:
        self._slots[unit] = self._free.pop()
        self.tier.map_unit(unit, self._slots[unit])
        self._reads[unit] = self._reader.submit(self.tier.read_unit, unit)
        self.read_bytes += self.tier.layout.unit_nbytes(unit)

    def _written(self, unit: int) -> None:
        """Wait for ``unit``'s write-back (re-raising its error); its slot is free again."""
        self._writes.pop(unit).result()
        self._free.append(self._slots.pop(unit))

    def _free_slot(self) -> None:
        """Wait for the oldest write-back, else drop the read-ahead unit due last (clean: no write)."""
        if self._writes:
            self._written(next(iter(self._writes)))
            return
        pos = {u: i for i, u in enumerate(self._order)}
        unit = max(self._reads, key=lambda u: pos.get(u, -1))
        self._reads.pop(unit).result()
        self.tier.unmap_unit(unit)
        self._free.append(self._slots.pop(unit))

    def _reap(self) -> None:
        """Collect finished write-backs (re-raising a failed one) and free their slots."""
        for unit in [u for u, f in self._writes.items() if f.done()]:
            self._written(unit)

    def _learn(self, unit: int) -> None:
        self._seen.append(unit)
        if len(set(self._seen)) == len(self._order):
            if len(self._seen) == len(self._order):
                self._order = self._seen
            self._seen = []

    def _read_ahead(self, unit: int) -> None:
        if unit not in self._order:
            return
        i, n = self._order.index(unit), len(self._order)
        for k in range(1, n + 1):
            if not self._free:
                return
            nxt = self._order[(i + k) % n]
            if nxt in self._reads:
                continue
            if nxt in self._writes:
                return  # wait for its write-back before reading it again
            self._start_read(nxt)

    # ---- after every update ---------------------------------------------------------------------

    def wait_written(self) -> None:
        """Block until every write-back is in the file (re-raises a failed one). Call when no update
        runs (after ``UnitUpdates.wait_all``)."""
        for unit in list(self._writes):
            self._written(unit)

    def read_fields(self, unit: int) -> dict[str, torch.Tensor]:
        """``unit``'s tier fields as private copies read from the file (name -> flat tensor, the
        store's dtype): what a checkpoint saves. Call when no update runs."""
        self.wait_written()
        return self.tier.read_copy(unit)

    def close(self) -> None:
        """Finish the I/O in flight (its errors are not raised: the run is ending) and close the file."""
        for fut in [*self._reads.values(), *self._writes.values()]:
            fut.exception()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.tier.close()
        self.inner.close()  # the wrapped optimizer lets go of its store views
