"""Streaming window: the device buffers a stage's blocks pass through, and the copies in and out.

Owns: ``slots`` device buffers (one block's weights each), one buffer per resident block (loaded
once per sequence instead of at every use), the H2D prefetch of the next blocks of a known load
sequence, the D2H offload of gradients into the host store's fp32 accumulators, and the bytes
and busy seconds of both directions. Each direction runs on its own copy worker thread; on CUDA
each worker issues its copies on its own CUDA stream, ordered against the compute stream with
events. On CPU the "device" buffers are separate tensors and the workers copy asynchronously, so
the protocol below is exercised for real (``delay_s`` slows the workers to expose a missing wait).
Gradients leave the device through host staging buffers, one per slot (staging.py: page-locked
on CUDA, copied on a D2H stream of their own; the D2H worker waits for the copy, then accumulates).

Protocol (the j-th streamed load of the sequence uses slot ``j % slots``):
    acquire()  waits until the next load is in its slot (or resident buffer), returns the views;
    release()  marks compute on it issued and issues the next streamed load into the freed slot;
    offload()  copies the block's gradients into staging buffer ``n % slots`` (async on CUDA) and
               queues their accumulation; at most ``slots`` in flight, so a buffer is rewritten
               only after its last accumulation; the first offload into an accumulator since
               begin() overwrites it, so the optimizer never spends a pass zeroing it;
    flush()    waits for every queued offload (before the optimizer reads the accumulators).
A resident block's one load per sequence is issued when the prefetch reaches its first use, so
the in-order H2D worker never blocks a needed load behind it. ``gate(block)`` (optional) returns
futures a load must wait for before copying (the optimizer's updates of the block's units).
The waits enter the ``stall``, ``d2h_wait`` and ``optim`` phases of ``timeline`` (breakdown.py).
"""

from __future__ import annotations

import itertools
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nodetrain.breakdown import NULL_TIMELINE
from nodetrain.host_threads import limit_thread
from nodetrain.model import Binding
from nodetrain.staging import GradStaging
from nodetrain.store import HostStore

__all__ = ["Window"]


class _CopyWorker:
    """One copy direction: a single thread (in-order), plus a CUDA stream when ``stream`` is given.

    A job first waits for its gate (host futures), then, with a stream, for the compute queued
    before it was submitted, and runs to completion before the next (``busy_s`` counts only the
    copy). Without a stream a job runs as it is (the D2H jobs wait for their own copy's event).
    On a CUDA ``device`` the thread first selects it: a thread's current device starts as GPU 0,
    and a CUDA call there (an event wait, a stream context) would create a context on GPU 0 in
    every rank's process. With ``threads`` the thread first sets its OpenMP team to that many
    (``host_threads.limit_thread``: the D2H worker's accumulation adds run on a team of their own)."""

    def __init__(self, name: str, stream: torch.cuda.Stream | None, delay_s: float, device=None,
                 threads: int = 0):  # fmt: skip
        device = torch.device(device) if device is not None else None
        cuda = device if device is not None and device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, name, initializer=_init_worker, initargs=(cuda, threads))
        self._stream = stream
        self._delay_s = delay_s
        self.busy_s = 0.0
        """Seconds spent copying since the last :meth:`take_busy_s`."""

    def submit(self, fn, gate: list[Future] = ()) -> Future:
        ready = None
        if self._stream is not None:  # the copy may start only after compute queued so far
            ready = torch.cuda.current_stream().record_event()
        return self._pool.submit(self._run, fn, ready, gate)

    def _run(self, fn, ready, gate):
        for fut in gate:
            fut.result()
        if self._delay_s:
            time.sleep(self._delay_s)
        if self._stream is None:
            t0 = time.perf_counter()
            fn()
            self.busy_s += time.perf_counter() - t0
            return None
        _wait_for_compute(ready)
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            fn()
            done = self._stream.record_event()
        done.synchronize()  # measured to completion; the consumer's wait is then free
        self.busy_s += time.perf_counter() - t0
        return done

    def take_busy_s(self) -> float:
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _init_worker(device: torch.device | None, threads: int) -> None:
    """A copy worker's set-up: the rank's CUDA device (if any), then its OpenMP team (if given)."""
    if device is not None:
        torch.cuda.set_device(device)
    if threads:
        limit_thread(threads)


def _wait_for_compute(ready: torch.cuda.Event) -> None:
    """The slot-reuse wait: block the copy worker until the compute queued before its job was
    submitted (the kernels still reading the slot the copy overwrites) has finished. A hook point:
    tests/test_gpu.py removes it to show that its check catches a missing wait."""
    ready.synchronize()


def _wait(fut: Future) -> None:
    done = fut.result()  # re-raises a worker's exception here
    if done is not None:
        torch.cuda.current_stream().wait_event(done)


class Window:
    """``slots`` device buffers through which a stage's blocks stream, plus resident blocks.

    Args:
        store: the host store (source of ``compute`` copies, target of gradients).
        bindings: per block index, the parameters it binds (see ``HFModel.bindings``).
        blocks: block indices of this stage (only these are ever loaded).
        owned_units: units whose optimizer runs on this stage; a binding to any other unit (the
            tied embedding on the last stage) accumulates into that unit's ``grad_tied``.
        slots: number of device buffers (≥ 1).
        device: compute device.
        delay_s: test-only sleep before each copy.
        resident: blocks held in buffers of their own for the whole sequence.
        accum_threads: OpenMP team of the D2H worker, which adds the offloaded gradients into the
            host store (``stream.accum_threads``, split by ``host_threads.split_cores``); 0 = torch's.

    Memory: ``slots × max streamed block numel × compute itemsize`` bytes plus each resident block's
    bytes on the device (``nbytes``; ``resident_nbytes`` the latter); ``slots × max block numel ×
    compute itemsize`` bytes of host staging (``staging_nbytes``; page-locked on CUDA).

    Hooks (set by the engine): ``gate(block) -> list[Future]``; ``on_offloaded(block)``, called on
    the D2H worker after a block's gradients are accumulated; ``timeline``.
    """

    def __init__(self, store: HostStore, bindings, blocks, owned_units, slots: int, device, delay_s=0.0,
                 resident=(), accum_threads: int = 0):  # fmt: skip
        self.store, self.bindings, self.device = store, bindings, torch.device(device)
        dtype = store.layout.compute_dtype
        self.resident = sorted(set(resident))
        assert set(self.resident) <= set(blocks), f"resident blocks {self.resident} not in {list(blocks)}"
        streamed = [i for i in blocks if i not in self.resident]
        numel = max((self._numel(i) for i in streamed), default=0)
        self._slots = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(slots)]
        self._resident = {i: torch.empty(self._numel(i), dtype=dtype, device=self.device) for i in resident}
        self._views = {i: self._slot_views(bindings[i]) for i in blocks}
        self._grad_targets = {i: self._grad_views(bindings[i], set(owned_units)) for i in blocks}
        self._check_targets()
        self._written: set[int] = set()  # data_ptr of accumulators offloaded into since begin()
        h2d_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._h2d = _CopyWorker("h2d", h2d_stream, delay_s, self.device)
        # copies on the staging's stream; the accumulation adds on a team of accum_threads
        self._d2h = _CopyWorker("d2h", None, delay_s, self.device, accum_threads)
        self._staging = GradStaging(slots, max(self._numel(i) for i in blocks), dtype, self.device)
        self._num_offloads = 0
        self.gate = None
        self.on_offloaded = None
        self.timeline = NULL_TIMELINE
        self._seq: list[int] = []
        self._loads: dict[int, tuple[Future, list[Future]]] = {}  # position -> (load, its gate)
        self._slot_at: dict[int, torch.Tensor] = {}  # position -> buffer of a streamed load
        self._resident_loads: dict[int, tuple[Future, list[Future]]] = {}  # block -> this sequence's
        self._next = self._cursor = self._streamed = self._in_flight = 0
        self._offloads: list[Future] = []
        self.stall_s = 0.0
        """Seconds compute waited for H2D since the last :meth:`begin`."""
        self.h2d_bytes = self.d2h_bytes = 0
        """Bytes copied each way since the last :meth:`take_stats`."""

    def _numel(self, block: int) -> int:
        return sum(b.numel for b in self.bindings[block])

    @property
    def nbytes(self) -> int:
        """Device bytes held by the slots and the resident blocks."""
        return sum(s.numel() * s.element_size() for s in self._slots) + self.resident_nbytes

    @property
    def staging_nbytes(self) -> int:
        """Host bytes of the gradient staging buffers (page-locked on CUDA)."""
        return self._staging.nbytes

    @property
    def resident_nbytes(self) -> int:
        """Device bytes held by the resident blocks."""
        return sum(s.numel() * s.element_size() for s in self._resident.values())

    def _slot_views(self, bindings: tuple[Binding, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
        out, pos = [], 0
        for b in bindings:
            out.append((b.local_name, pos, b.shape))
            pos += b.numel
        return out

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

    def begin(self, sequence: list[int]) -> None:
        """Start a new load sequence (block indices in compute order) and prefetch its head."""
        assert not self._loads, "previous sequence not drained"
        self._seq, self.stall_s = list(sequence), 0.0
        self._written.clear()
        self._next = self._cursor = self._streamed = self._in_flight = 0
        self._slot_at.clear()
        self._resident_loads.clear()
        self._fill()

    def _fill(self) -> None:
        """Issue loads in sequence order while a slot is free (resident first uses need none)."""
        while self._cursor < len(self._seq):
            k, block = self._cursor, self._seq[self._cursor]
            if block in self._resident:
                if block not in self._resident_loads:
                    self._resident_loads[block] = self._load(block, self._resident[block])
            elif self._in_flight < len(self._slots):
                self._slot_at[k] = self._slots[self._streamed % len(self._slots)]
                self._loads[k] = self._load(block, self._slot_at[k])
                self._streamed += 1
                self._in_flight += 1
            else:
                return
            self._cursor += 1

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

        gate = self.gate(block) if self.gate is not None else []
        return self._h2d.submit(copy, gate), gate

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
            _wait(load)
        self.stall_s += time.perf_counter() - t0
        views = self._views[block]
        return {name: buf[pos : pos + math.prod(shape)].view(shape) for name, pos, shape in views}

    def release(self) -> None:
        """Compute on the current load is issued; its slot (if streamed) takes the next load."""
        k = self._next
        self._next += 1
        if self._seq[k] not in self._resident:
            self._in_flight -= 1
        self._fill()

    def offload(self, block: int, grads: dict[str, torch.Tensor]) -> None:
        """Queue D2H of ``grads`` (local name -> gradient, device) added into the host accumulators.

        The gradients are copied into staging buffer ``n % slots`` (``n`` counts offloads; on CUDA
        asynchronously on the D2H stream, after the compute queued so far); the D2H worker waits
        for that copy and accumulates the buffer into the store. At most ``slots`` offloads are in
        flight, so the buffer's previous offload has been accumulated before it is written again.
        """
        if len(self._offloads) >= len(self._staging):  # bound gradient memory in flight, free a buffer
            with self.timeline.phase("d2h_wait"):
                while len(self._offloads) >= len(self._staging):
                    self._offloads.pop(0).result()
        targets = self._grad_targets[block]
        jobs = []
        for name in grads:
            dst = targets[name]
            jobs.append((dst, dst.data_ptr() not in self._written))
            self._written.add(dst.data_ptr())
        self.d2h_bytes += sum(g.numel() * g.element_size() for g in grads.values())
        staged = self._staging.issue(self._num_offloads % len(self._staging), list(grads.values()))
        self._num_offloads += 1

        def accumulate():
            for (dst, first), src in zip(jobs, staged.wait(), strict=True):
                if first:  # overwrite: no zeroing pass, no read of the stale accumulator
                    dst.copy_(src)
                else:  # fp32 += compute dtype, widened elementwise
                    dst.add_(src)
            if self.on_offloaded is not None:
                self.on_offloaded(block)

        self._offloads.append(self._d2h.submit(accumulate))

    def flush(self) -> None:
        """Wait for every queued offload; the host accumulators are then complete."""
        with self.timeline.phase("d2h_wait"):
            while self._offloads:
                self._offloads.pop(0).result()
        assert self._next == len(self._seq) and not self._loads, "load sequence not fully consumed"

    def take_stats(self) -> dict[str, float]:
        """Bytes and busy seconds of both directions since the last call (after :meth:`flush`)."""
        out = {
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "h2d_busy_s": self._h2d.take_busy_s(),
            "d2h_busy_s": self._d2h.take_busy_s(),
        }
        self.h2d_bytes = self.d2h_bytes = 0
        return out

    def close(self) -> None:
        self._h2d.shutdown()
        self._d2h.shutdown()
