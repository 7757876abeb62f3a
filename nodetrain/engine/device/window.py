"""Streaming window: the device buffers a stage's blocks pass through, and the copies in and out.

Owns: ``slots`` device buffers (one block's weights each), one buffer per resident block (loaded
once per sequence), the H2D prefetch of the next blocks of a known load sequence, the D2H offload of
gradients into the host store's fp32 accumulators through host staging buffers (staging.py, one per
slot), and the bytes and busy seconds of both directions. Each direction runs on its own copy worker
thread (on CUDA on its own stream, ordered against compute with events; on CPU the same protocol on
separate tensors, with ``Faults.before_copy`` to slow the workers in tests). The gradient sums kept
on the device (resident blocks, ``grad_acc``, DeviceAdamW's, waves') are ``sums`` (device_acc.py).

Protocol (the j-th streamed load of the sequence uses slot ``j % slots``; consecutive equal entries
of the sequence share one load: the later ones reuse its slot, with no H2D and no second slot):
    acquire()  waits until the next load is in its slot (or resident buffer), returns the views;
    release()  marks compute on it issued and issues the next streamed load into the freed slot;
    offload()  copies the block's gradients into staging buffer ``n % slots`` (async on CUDA) and
               queues their accumulation, at most ``slots`` in flight (the first into an accumulator
               since begin() overwrites it), or adds them into the block's device sum, which ships
               once complete (DESIGN invariant 8; ``begin(..., backwards=)`` counts);
    flush()    waits for every queued offload (before the optimizer reads the accumulators).
    gate(block) (optional) returns futures a load must wait for before copying (the optimizer's
               updates of the block's units); a reused load is not gated again.
Row blocks (``rows``: the embedding, one [V, D] binding) never enter a slot: ``gather_rows`` copies
the rows a micro-batch uses (U × D) and ``offload_rows`` scatter-adds their gradient rows into the
fp32 accumulator (zeroed at the sequence's first offload). Host-side adds go through
``HostAccumulator`` (accumulate.py); the waits enter ``timeline``'s phases (breakdown.py).

Why, with the timeline and which loads a schedule reuses: docs/design.md#the-window.
"""

from __future__ import annotations

import itertools
import math
import time
from concurrent.futures import Future

import torch

from nodetrain.core.step_plan import reuses
from nodetrain.engine.device.copy_worker import CopyWorker, done_copy, wait_copy
from nodetrain.engine.device.device_acc import DeviceSums, slot_layout
from nodetrain.engine.device.staging import GradStaging, rows_to_device
from nodetrain.engine.host.accumulate import CHUNK_PER_THREAD, HostAccumulator
from nodetrain.engine.threads import check_writer
from nodetrain.run.breakdown import NULL_TIMELINE
from nodetrain.run.inject import NO_FAULTS, Faults
from nodetrain.store import HostStore

__all__ = ["Window"]


class Window:
    """``slots`` device buffers through which a stage's blocks stream, plus resident blocks.

    Args:
        store: the host store (source of ``compute`` copies, target of gradients).
        bindings: per block index, the parameters it binds (see ``HFModel.bindings``).
        blocks: block indices of this stage (only these are ever loaded).
        slots: number of device buffers (≥ 1).
        device: compute device.
        owned_units: units whose optimizer runs on this stage (default: the stage's own, unit i of
            block i); a binding to any other unit (the tied embedding on the last stage) accumulates
            into that unit's ``grad_tied``.
        resident: blocks held in buffers of their own for the whole sequence.
        device_grads: resident blocks with their optimizer on the device (device_adamw.py): block ->
            local name -> fp32 device view its gradients add into; never shipped nor reloaded.
        grad_acc: streamed blocks (a row block too) with a device fp32 gradient accumulator
            (``stream.grad_on_device``): loaded per pass, their gradient shipped once per sequence.
        rows: blocks of a single [V, D] binding (the embedding) that travel as the rows a
            micro-batch uses (:meth:`gather_rows`, :meth:`offload_rows`), never through a slot.
        accum_threads: OpenMP team of the D2H worker, which adds the offloaded gradients into the
            host store (``stream.accum_threads``, split by ``host_threads.split_cores``); 0 = torch's.
        wave: W, micro-batches per item (``pipeline.wave``): with W > 1 each streamed slotted block's W
            offloads of an item are summed in an fp32 wave-sum buffer and shipped once (device_acc.py).
        gate: ``gate(block) -> list[Future]``, the updates a load of ``block`` waits for (called on
            the training thread when the load is issued; ``UnitUpdates.gate``); default none.
        on_arrival: ``on_arrival(block)``, called on the D2H worker once a block's gradients are in
            the host store; it must only post a message (``UnitUpdates.arrived``); default none.
        helper: the idle optimizer thread that shares the D2H worker's adds (``UnitUpdates.helper``,
            helper.py; ``stream.accum_help``); default none.
        timeline: where the waits are timed (breakdown.py); faults: test-only injection.

    Memory: ``slots × max streamed block numel × compute itemsize`` bytes (row blocks are not
    streamed: their gathered rows and row gradients are per micro-batch) plus each resident block's
    ``numel × (compute itemsize + 4)`` bytes (its weights and its fp32 gradient accumulator) on the
    device (``nbytes``; ``resident_nbytes`` the latter), each ``grad_acc`` block's ``numel × 4``
    (``grad_acc_nbytes``), with W > 1 ``slots × 4 × max wave-summed block numel`` (``sums.wave_nbytes``);
    ``slots × max block numel × compute itemsize`` bytes of host staging (``staging_nbytes``; pinned
    on CUDA: ``staging_pinned_nbytes``) and the D2H worker's ``accumulate.CHUNK_PER_THREAD`` scratch
    (the helper's too, on its thread).
    """

    def __init__(
        self,
        store: HostStore,
        bindings,
        blocks,
        slots: int,
        device,
        *,
        owned_units=None,
        resident=(),
        device_grads=None,
        grad_acc=(),
        rows=(),
        accum_threads: int = 0,
        wave: int = 1,
        gate=None,
        on_arrival=None,
        helper=None,
        timeline=NULL_TIMELINE,
        faults: Faults = NO_FAULTS,
    ):
        self.store, self.bindings, self.device = store, bindings, torch.device(device)
        dtype = store.layout.compute_dtype
        self.resident = sorted(set(resident))
        assert set(self.resident) <= set(blocks), f"resident blocks {self.resident} not in {list(blocks)}"
        self.rows = sorted(set(rows))
        assert not set(self.rows) & set(self.resident), "a block is either resident or gathered as rows"
        assert all(len(bindings[i]) == 1 and len(bindings[i][0].shape) == 2 for i in self.rows), self.rows
        self._views = {i: slot_layout(bindings[i]) for i in blocks}
        self._gate, self._on_arrival, self.timeline = gate, on_arrival, timeline
        self._make_buffers(blocks, slots, dtype, dict(device_grads or {}), grad_acc, wave)
        owned = set(blocks if owned_units is None else owned_units)
        self._grad_targets = {i: self._grad_views(bindings[i], owned) for i in blocks}
        self._check_targets()
        self._written: set[int] = set()  # data_ptr of accumulators offloaded into since begin()
        h2d_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.h2d = CopyWorker("h2d", h2d_stream, self.device, faults=faults)
        """The H2D copy worker: the loads, and the saved inputs' prefetch (activations.py), in order."""
        # copies on the staging's stream; the accumulation adds on a team of accum_threads
        self._d2h = CopyWorker("d2h", None, self.device, accum_threads, faults)
        self._staging = GradStaging(slots, max(self._numel(i) for i in blocks), dtype, self.device)
        chunk = faults.accum_chunk_per_thread or CHUNK_PER_THREAD  # a test may make it small
        self._accum = HostAccumulator(chunk, helper)  # used on the D2H worker only (its scratch, its team)
        self._seq: list[int] = []
        self._reuse: list[bool] = []  # per position of the sequence: shares the previous load (core)
        self._loads: dict[int, tuple[Future, list[Future]]] = {}  # position -> (load, its gate)
        self._slot_at: dict[int, torch.Tensor] = {}  # position -> buffer of a streamed load
        self._resident_loads: dict[int, tuple[Future, list[Future]]] = {}  # block -> this sequence's
        self._last_load: tuple[tuple[Future, list[Future]], torch.Tensor] | None = None  # latest streamed
        self._next = self._cursor = self._streamed = self._in_flight = self._num_offloads = 0
        self._offloads: list[Future] = []  # staged offloads and ships, each holding a staging buffer
        self.stall_s = 0.0
        """Seconds compute waited for H2D since the last :meth:`begin`."""
        self.h2d_bytes = self.d2h_bytes = 0
        """Bytes copied each way since the last :meth:`take_stats`."""
        self.accum_host_bytes = 0
        """Host bytes read and written by the gradient accumulation since the last take_stats: per
        element, a staged first write ``e + 4`` (read staging, write fp32), a staged add ``e + 8``, a
        resident accumulator's ship ``8`` (read its fp32 staging, write), its add into a shared target
        ``12``."""

    def _make_buffers(
        self, blocks, slots: int, dtype: torch.dtype, device_grads: dict, grad_acc, wave: int
    ) -> None:
        """The device buffers: ``slots`` slots sized by the largest streamed block, each resident
        block's weights and its fp32 gradient accumulator (or ``device_grads``' views), each
        ``grad_acc`` block's fp32 gradient accumulator and, with ``wave`` > 1, the wave-sum buffers."""
        assert set(device_grads) <= set(self.resident), "a block keeps its optimizer only when resident"
        self.grad_acc = sorted(set(grad_acc))
        assert not set(self.grad_acc) & set(self.resident), "a resident block has its accumulator already"
        self._kept = device_grads  # block -> its gradients' device views (DeviceAdamW)
        streamed = [i for i in blocks if i not in self.resident and i not in self.rows]
        numel = max((self._numel(i) for i in streamed), default=0)
        self._slots = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(slots)]
        self._resident = {
            i: torch.empty(self._numel(i), dtype=dtype, device=self.device) for i in self.resident
        }
        summed = [i for i in [*self.resident, *self.grad_acc] if i not in self._kept]
        waved = [i for i in streamed if i not in self.grad_acc]
        self.sums = DeviceSums(
            self._views, self.device, summed, self._kept, wave, waved, slots, self._ship, self.timeline
        )
        """The fp32 gradient sums on the device (device_acc.py): accumulators, DeviceAdamW's, waves'."""

    def _split(self, block: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Local name -> the flat view of ``flat`` where ``block``'s binding of that name lies."""
        return {n: flat[p : p + math.prod(s)] for n, p, s in slot_layout(self.bindings[block])}

    def resident_views(self, block: int) -> dict[str, torch.Tensor]:
        """A resident block's weights: local name -> flat view of its buffer (compute dtype, device)."""
        return self._split(block, self._resident[block])

    def _numel(self, block: int) -> int:
        return sum(b.numel for b in self.bindings[block])

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots, the resident blocks, the ``grad_acc`` accumulators, the wave sums."""
        slots = sum(s.numel() * s.element_size() for s in self._slots)
        return slots + self.resident_nbytes + self.grad_acc_nbytes + self.sums.wave_nbytes

    @property
    def grad_acc_nbytes(self) -> int:
        """Device bytes of the streamed blocks' fp32 gradient accumulators (``grad_acc``)."""
        return self.sums.nbytes(self.grad_acc)

    @property
    def staging_nbytes(self) -> int:
        """Host bytes of the gradient staging buffers (page-locked on CUDA)."""
        return self._staging.nbytes

    @property
    def staging_pinned_nbytes(self) -> int:
        """Host bytes page-locked for the staging buffers (whole pages; 0 on CPU)."""
        return self._staging.pinned_nbytes

    @property
    def resident_nbytes(self) -> int:
        """Device bytes held by the resident blocks: weights (compute dtype) and fp32 accumulators."""
        weights = sum(s.numel() * s.element_size() for s in self._resident.values())
        return weights + self.sums.nbytes(self.resident)

    def _grad_views(self, bindings, owned: set[int]) -> dict[str, torch.Tensor]:
        out = {}
        for b in bindings:
            field = "grad" if b.unit in owned else "grad_tied"
            out[b.local_name] = self.store.buffer(b.unit, field)[b.offset : b.offset + b.numel]
        return out

    def _check_targets(self) -> None:
        """Gradient targets are disjoint or identical ranges (first-write tracking relies on it)."""
        targets = [t for views in self._grad_targets.values() for t in views.values()]
        spans = sorted({(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in targets})
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two bindings' gradient ranges overlap partially"

    def begin(self, sequence: list[int], backwards: dict[int, int] | None = None) -> None:
        """Start a new load sequence (block indices in compute order) and prefetch its head.

        Args:
            sequence: block indices in the order they are acquired.
            backwards: block -> offloads (backwards) it gets in this sequence; a resident block
                listed here accumulates on the device and is shipped at its last one. A resident
                block not listed offloads each backward through staging, as a streamed one does.
        """
        check_writer("training", "the window's sequence")
        assert not self._loads, "previous sequence not drained"
        self._seq, self.stall_s = list(sequence), 0.0
        self._reuse = reuses(self._seq, self._resident)
        self._written.clear()
        self.sums.begin(backwards)
        self._next = self._cursor = self._streamed = self._in_flight = 0
        self._slot_at.clear()
        self._resident_loads.clear()
        self._last_load = None
        self._fill()

    def _fill(self) -> None:
        """Issue loads in sequence order while a slot is free (resident first uses need none)."""
        while self._cursor < len(self._seq):
            k, block = self._cursor, self._seq[self._cursor]
            if block in self._resident:
                if block in self._kept:  # written on the device by its optimizer: no load
                    self._resident_loads[block] = done_copy(), []
                elif block not in self._resident_loads:
                    self._resident_loads[block] = self._load(block, self._resident[block])
            elif self._reuses(k):  # the previous position's slot, still held: no copy, no new slot
                self._loads[k], self._slot_at[k] = self._last_load
            elif self._in_flight < len(self._slots):
                self._slot_at[k] = self._slots[self._streamed % len(self._slots)]
                self._loads[k] = self._load(block, self._slot_at[k])
                self._last_load = self._loads[k], self._slot_at[k]
                self._streamed += 1
                self._in_flight += 1
            else:
                return
            self._cursor += 1

    def _reuses(self, k: int) -> bool:
        """Position ``k`` uses the same streamed block as ``k - 1`` and so shares its load and slot
        (``core.step_plan.reuses``, the rule the cost model counts loads by)."""
        return 0 < k < len(self._seq) and self._reuse[k]

    def _load(self, block: int, buf: torch.Tensor) -> tuple[Future, list[Future]]:
        pieces, pos = [], 0
        for b in self.bindings[block]:
            src = self.store.compute(b.unit)[b.offset : b.offset + b.numel]
            pieces.append((buf[pos : pos + b.numel], src))
            pos += b.numel
        self.h2d_bytes += pos * buf.element_size()

        def copy():
            for dst, src in pieces:
                dst.copy_(src, non_blocking=True)

        gate = self._gate(block) if self._gate is not None else []
        return self.h2d.submit(copy, gate), gate

    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        """Wait for the next load (which must be ``block``) and return its parameter views.

        Returns:
            local name -> view of the slot, shaped as the parameter (compute dtype, device).
        """
        k = self._next
        assert self._seq[k] == block, f"load order broken: expected block {self._seq[k]}, got {block}"
        if block in self._resident:
            (load, gate), buf = self._resident_loads[block], self._resident[block]
        else:
            (load, gate), buf = self._loads.pop(k), self._slot_at.pop(k)
        if not all(f.done() for f in gate):
            with self.timeline.phase("optim"):  # the load waits for the unit's AdamW update
                for f in gate:
                    f.result()
        t0 = time.perf_counter()
        with self.timeline.phase("stall"):
            wait_copy(load)
        self.stall_s += time.perf_counter() - t0
        views = self._views[block]
        return {name: buf[pos : pos + math.prod(shape)].view(shape) for name, pos, shape in views}

    def release(self) -> None:
        """Compute on the current load is issued; its slot (if streamed and not reused by the next
        position) takes the next load."""
        k = self._next
        self._next += 1
        if self._seq[k] not in self._resident and not self._reuses(k + 1):
            self._in_flight -= 1
        self._fill()

    def offload(self, block: int, grads: dict[str, torch.Tensor]) -> None:
        """Queue D2H of ``grads`` (local name -> gradient, device) added into the host accumulators.

        The gradients are copied into staging buffer ``n % slots`` (``n`` counts offloads; on CUDA
        asynchronously on the D2H stream, after the compute queued so far); the D2H worker waits
        for that copy and accumulates the buffer into the store. At most ``slots`` offloads are in
        flight, so the buffer's previous offload has been accumulated before it is written again.
        """
        if self.sums.takes(block):
            self.sums.add(block, grads)
            return
        check_writer("training", "the window's sequence")
        if self.sums.sums_wave(block, self._resident):
            self.sums.add_wave(block, grads)
            return
        self._free_staging()
        targets = self._grad_targets[block]
        jobs = []
        for name, g in grads.items():
            dst = targets[name]
            first = dst.data_ptr() not in self._written
            jobs.append((dst, first))
            self._written.add(dst.data_ptr())
            self.accum_host_bytes += dst.numel() * (g.element_size() + (4 if first else 8))
        self.d2h_bytes += sum(g.numel() * g.element_size() for g in grads.values())
        staged = self._staging.issue(self._num_offloads % len(self._staging), list(grads.values()))
        self._num_offloads += 1

        def accumulate():
            for (dst, first), src in zip(jobs, staged.wait(), strict=True):
                # first: overwrite (no zeroing pass, no read of the stale accumulator); else fp32 +=
                # compute dtype, widened chunk by chunk (accumulate.py)
                self._accum.write(dst, first, src)
            if self._on_arrival is not None:
                self._on_arrival(block)

        self._offloads.append(self._d2h.submit(accumulate))

    def _ship(self, block: int, acc: torch.Tensor) -> Future:
        """Queue the D2H copy of ``acc``, a complete fp32 device sum of ``block`` laid out as its slot
        (``self.sums`` calls it), into the store (first write: a copy); returns its Future.

        It takes the next staging buffer of the rotation and counts as an offload in flight, so a
        later offload's copy waits for it (``_free_staging``); it need not wait itself: its buffer is
        written only inside its job, after the buffer's previous job on the in-order D2H worker.
        It streams the sum through the buffer's two halves in chunks (``GradStaging.ship``)."""
        targets, jobs = self._grad_targets[block], []
        for name, pos, shape in self._views[block]:
            dst = targets[name]
            first = dst.data_ptr() not in self._written
            jobs.append((dst, first, acc[pos : pos + math.prod(shape)]))
            self._written.add(dst.data_ptr())
            self.accum_host_bytes += dst.numel() * (8 if first else 12)
        self.d2h_bytes += acc.numel() * acc.element_size()
        cuda = self.device.type == "cuda"
        ready = torch.cuda.current_stream(self.device).record_event() if cuda else None
        halves = self._staging.halves(self._num_offloads % len(self._staging), torch.float32)
        self._num_offloads += 1

        def ship():
            self._staging.ship(jobs, halves, ready, self._accum.write)
            if self._on_arrival is not None:
                self._on_arrival(block)

        self._offloads.append(self._d2h.submit(ship))
        return self._offloads[-1]

    def _free_staging(self) -> None:
        """Bound gradient memory in flight: wait until a staging buffer is free."""
        if len(self._offloads) >= len(self._staging):
            with self.timeline.phase("d2h_wait"):
                while len(self._offloads) >= len(self._staging):
                    self._offloads.pop(0).result()

    def gather_rows(self, block: int, index: torch.Tensor) -> torch.Tensor:
        """The rows ``index`` of a row block's transfer copy, on the device.

        Waits for the block's pending AdamW updates (``gate``) first, as a load does.

        Args:
            block: one of ``rows``.
            index: [U] int64 row indices on the host (unique: each row crosses once).

        Returns:
            [U, D] compute dtype on the device.
        """
        (b,) = self.bindings[block]
        gate = self._gate(block) if self._gate is not None else []
        with self.timeline.phase("optim"):
            for f in gate:
                f.result()
        t0 = time.perf_counter()
        with self.timeline.phase("stall"):
            table = self.store.compute(b.unit)[b.offset : b.offset + b.numel].view(b.shape)  # [V, D]
            rows = rows_to_device(table, index, self.device)  # [U, D]
        self.stall_s += time.perf_counter() - t0
        self.h2d_bytes += rows.numel() * rows.element_size()
        return rows

    def offload_rows(self, block: int, index: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """Queue D2H of a row block's gradient rows, scatter-added into its host accumulator.

        The first offload into the accumulator since :meth:`begin` zeroes it before adding (rows
        no micro-batch used have zero gradient), the later ones only add, as :meth:`offload` does; with
        a device accumulator (``grad_acc``) the same adds run on the device, shipped at the last one.

        Args:
            block: one of ``rows``.
            index: [U] int64 row indices on the host, unique.
            grad_rows: [U, D] compute dtype on the device, the gradient of those rows.
        """
        (b,) = self.bindings[block]
        if self.sums.takes(block):
            self.sums.add_rows(block, b.shape, index, grad_rows)
            return
        self._free_staging()
        dst = self._grad_targets[block][b.local_name].view(b.shape)  # [V, D] fp32, host
        first = dst.data_ptr() not in self._written
        self._written.add(dst.data_ptr())
        self.d2h_bytes += grad_rows.numel() * grad_rows.element_size()
        # host bytes: the zeroing pass (4 B per element of [V, D]) once, then per row element the
        # staged gradient read and the accumulator's read and write
        self.accum_host_bytes += dst.numel() * 4 * first + grad_rows.numel() * (grad_rows.element_size() + 8)
        staged = self._staging.issue(self._num_offloads % len(self._staging), [grad_rows])
        self._num_offloads += 1
        shape = grad_rows.shape  # not the device tensor: its memory goes back once the copy landed

        def accumulate():
            (src,) = staged.wait()
            if first:
                dst.zero_()
            self._accum.index_add(dst, index, src.view(shape))
            if self._on_arrival is not None:
                self._on_arrival(block)

        self._offloads.append(self._d2h.submit(accumulate))

    def flush(self) -> None:
        """Wait for every queued offload; the host accumulators are then complete."""
        with self.timeline.phase("d2h_wait"):
            while self._offloads:
                self._offloads.pop(0).result()
        assert self._next == len(self._seq) and not self._loads, "load sequence not fully consumed"
        self.sums.check_drained()

    def take_stats(self) -> dict[str, float]:
        """Bytes and busy seconds of both directions since the last call (after :meth:`flush`)."""
        out = {
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "accum_host_bytes": self.accum_host_bytes,
            "accum_helped_bytes": int(self._accum.helped.take()["bytes"]),
            "h2d_busy_s": self.h2d.take_busy_s(),
            "d2h_busy_s": self._d2h.take_busy_s(),
        }
        self.h2d_bytes = self.d2h_bytes = self.accum_host_bytes = 0
        return out

    def run_host(self, fn):
        """Run ``fn()`` on the D2H worker, after every job queued there, and return its result.

        For host work on the gradients once the accumulation is done (the norm², overlap.py): that
        thread's OpenMP team is ``accum_threads``, idle after :meth:`flush`, where the training
        thread's is what torchrun sets (``OMP_NUM_THREADS=1``). Re-raises ``fn``'s exception."""
        return self._d2h.call(fn)

    def close(self) -> None:
        """Stop the copy workers (after their jobs) and let go of the staging and the store's views."""
        self.h2d.shutdown()
        self._d2h.shutdown()
        self._staging.close()
        self._grad_targets.clear()
