"""Host gradient accumulation: fp32 accumulators += staged gradients, with no temporaries, in chunks
that an idle optimizer thread may share.

Owns: the arithmetic that lands a staged gradient in the host store's fp32 accumulator (a first
write copies, later ones add, the embedding's rows scatter-add), cut into chunks (disjoint element
or row ranges of the target), the grow-only fp32 scratch each thread widens its chunks in
(:class:`Scratch`), and one add shared between two threads (:class:`SharedAdd`). Does not own: the
staging buffers (staging.py), which offload writes which accumulator (window.py, whose D2H worker
calls this on its OpenMP team of ``accum_threads``) nor the optimizer thread it borrows (helper.py).

Why a scratch: on the CPU, ``fp32.add_(bf16)`` promotes the bf16 operand by materialising
``src.to(float32)`` (TensorIterator casts a CPU input to the common dtype with a copy): numel × 4
bytes allocated, page-faulted and freed at every add (50M elements: 48,829 minor faults and
166-191 ms, against 18 ms for fp32 += fp32). Here each chunk of ``threads × CHUNK_PER_THREAD``
elements is widened into the scratch (``copy_`` converts in its kernel, no temporary) and added from
there while it is still in cache. bf16/fp16 → fp32 is exact and each add is one fp32 rounding, so
the sums are those of ``fp32(dst) + fp32(src)`` bit for bit, as before.

Why sharing is exact: the chunks of one add are disjoint ranges of its target (rows: the index is
unique) and every element gets the same one elementwise op whichever thread runs its chunk, so the
result is bit for bit that of one thread. The add completes (and the window reports the arrival)
only once every chunk landed: arrival order and "first write copies" are unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import torch

from nodetrain.engine.threads import Tally

__all__ = ["CHUNK_PER_THREAD", "Chunk", "HostAccumulator", "Scratch", "SharedAdd"]

CHUNK_PER_THREAD = 1 << 18
"""Elements per thread of a chunk: 1 MiB of fp32 scratch and 512 KiB of bf16 source, about one core's
L2 (1-2 MiB on current server CPUs), so the widened chunk is added while it is still in cache. Smaller
chunks pay the per-op dispatch (~10 µs) too often: on 100M bf16 elements and 2 threads, 2^15 per thread
took 77 ms, 2^17 35 ms, 2^18 26 ms, 2^20 23 ms, one whole-tensor scratch 34 ms, fp32 += fp32 21 ms
and the old ``add_`` of bf16 195 ms."""

Chunk = tuple[Callable[["Scratch"], None], int]
"""One chunk of an add: ``run(scratch)`` lands it with the calling thread's scratch, and its host
bytes (read + written: a copy ``e + 4`` per element, an add ``e + 8``; e = the source's itemsize)."""


class Scratch:
    """A grow-only fp32 host buffer one thread widens its chunks in (never shared between threads).

    Allocated at the first use and grown only, so a step's steady state allocates nothing."""

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    @property
    def nbytes(self) -> int:
        return self._buf.numel() * 4

    def take(self, numel: int) -> torch.Tensor:
        """[numel] fp32, host: the first ``numel`` elements of the buffer (grown if shorter)."""
        if self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=torch.float32)
        return self._buf[:numel]


def _copy(dst: torch.Tensor, src: torch.Tensor, scratch: Scratch) -> None:
    dst.copy_(src)  # the copy kernel converts elementwise: no temporary


def _add(dst: torch.Tensor, src: torch.Tensor, scratch: Scratch) -> None:
    if src.dtype != torch.float32:
        wide = scratch.take(src.numel())
        wide.copy_(src)
        src = wide
    dst.add_(src)


def _index_add(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, scratch: Scratch) -> None:
    if src.dtype != torch.float32:
        wide = scratch.take(src.numel()).view(src.shape)
        wide.copy_(src)
        src = wide
    dst.index_add_(0, index, src)


class SharedAdd:
    """One add's chunks, taken by its owner (the D2H worker) from the front and by a helper (the idle
    optimizer thread) from the back, each with its own :class:`Scratch`.

    Owns: the two cursors, the helper's chunk in flight and the host bytes it landed (under one lock;
    a chunk is written only by the thread that claimed it). The owner never waits for a help that has
    not started: it runs chunks until none is left, then waits only for the helper's chunk in flight.
    """

    def __init__(self, chunks: list[Chunk]):
        self._chunks = chunks
        self._front, self._back = 0, len(chunks)
        self._helping = False
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.helped_bytes = self.helped_chunks = 0
        """Host bytes and chunks the helper landed (final once :meth:`run_front` returned)."""

    def run_front(self, scratch: Scratch) -> None:
        """Owner: run chunks from the front until none is left, then wait for the helper's chunk in
        flight. Re-raises an error of a helped chunk; on an error of its own, it leaves the helper no
        chunk and waits for the one in flight before raising it."""
        try:
            while True:
                with self._cond:
                    if self._front >= self._back:
                        self._cond.wait_for(lambda: not self._helping)
                        break
                    k, self._front = self._front, self._front + 1
                self._chunks[k][0](scratch)
        except BaseException:
            with self._cond:
                self._back = self._front
                self._cond.wait_for(lambda: not self._helping)
            raise
        if self._error is not None:
            raise self._error

    def run_back(self, scratch: Scratch, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Helper: run chunks from the back while any is left and ``keep_going()``; a stale help
        (every chunk taken) returns at once. An error is kept for the owner to raise."""
        while keep_going():
            with self._cond:
                if self._front >= self._back or self._error is not None:
                    return
                self._back -= 1
                k, self._helping = self._back, True
            run, nbytes = self._chunks[k]
            error = None
            try:
                run(scratch)
            except BaseException as e:  # the owner re-raises it once it has waited for this chunk
                error = e
            with self._cond:
                self._helping, self._error = False, error
                if error is None:
                    self.helped_bytes, self.helped_chunks = self.helped_bytes + nbytes, self.helped_chunks + 1
                self._cond.notify_all()


class HostAccumulator:
    """fp32 host accumulators += staged gradients, in chunks, through the owner's :class:`Scratch`.

    Call from one thread only (the D2H worker): the chunk is ``torch.get_num_threads()`` (that
    thread's OpenMP team) × ``chunk_per_thread`` elements, so each op of a chunk gives every thread of
    the team ``chunk_per_thread`` elements. With a ``helper`` each operation of two chunks or more is
    offered to it (``helper.offer(job) -> bool``: it runs ``job.run_back`` on its own thread and
    scratch if idle, helper.py) and shared as a :class:`SharedAdd`; refused, the owner runs it alone.

    Args:
        chunk_per_thread: elements per thread of a chunk (≥ 1).
        helper: the idle optimizer thread's :class:`~nodetrain.engine.host.helper.Helper`, or None.
    """

    def __init__(self, chunk_per_thread: int = CHUNK_PER_THREAD, helper=None):
        assert chunk_per_thread >= 1, chunk_per_thread
        self.chunk_per_thread = chunk_per_thread
        self._scratch = Scratch()
        self._helper = helper
        self.helped = Tally("bytes", "chunks")
        """Host bytes and chunks the helper landed (added by the owner once each add is complete)."""

    @property
    def scratch_nbytes(self) -> int:
        """Host bytes of the owner's scratch (fp32)."""
        return self._scratch.nbytes

    def _chunk(self) -> int:
        return torch.get_num_threads() * self.chunk_per_thread

    def write(self, dst: torch.Tensor, first: bool, src: torch.Tensor) -> None:
        """A first write (:meth:`copy`) or a later one (:meth:`add`) of ``src`` into ``dst`` (a landed
        ship chunk too: ``GradStaging.ship``'s ``land``)."""
        (self.copy if first else self.add)(dst, src)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst = src`` widened (a first write: the accumulator's old contents are not read).

        Args:
            dst: [N] fp32, host (a flat accumulator range).
            src: N elements of any float dtype, host (a staging view; any shape).
        """
        self._run(self.copy_chunks(dst, src))

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst += fp32(src)`` elementwise, chunk by chunk.

        Args:
            dst: [N] fp32, host, contiguous.
            src: N elements of any float dtype, host, contiguous (any shape).
        """
        self._run(self.add_chunks(dst, src))

    def index_add(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[r]] += fp32(src[r])`` for each row ``r``, a chunk of rows at a time.

        Args:
            dst: [V, D] fp32, host (the embedding's accumulator).
            index: [U] int64, host, unique row indices (so chunks of rows are disjoint targets and
                the row order does not change a sum).
            src: [U, D] any float dtype, host, contiguous.
        """
        self._run(self.index_add_chunks(dst, index, src))

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> list[Chunk]:
        """:meth:`copy` as chunks of consecutive element ranges (``e + 4`` host bytes per element)."""
        return self._ranges(_copy, dst, src, 4 + src.element_size())

    def add_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> list[Chunk]:
        """:meth:`add` as chunks of consecutive element ranges (``e + 8`` host bytes per element)."""
        return self._ranges(_add, dst, src, 8 + src.element_size())

    def index_add_chunks(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> list[Chunk]:
        """:meth:`index_add` as chunks of consecutive rows of ``src`` (``e + 8`` host bytes per element)."""
        width, total = max(src.shape[1], 1), src.shape[0]
        rows, per_row = max(1, self._chunk() // width), width * (8 + src.element_size())
        return [
            (
                partial(_index_add, dst, index[lo : lo + rows], src[lo : lo + rows]),
                per_row * min(rows, total - lo),
            )
            for lo in range(0, total, rows)
        ]

    def _ranges(self, op, dst: torch.Tensor, src: torch.Tensor, per_element: int) -> list[Chunk]:
        """``op(dst range, src range, scratch)`` over consecutive ranges of one chunk each
        (``dst``: [N] fp32; ``src``: N elements, any shape), priced at ``per_element`` host bytes."""
        src = src.view(-1)  # never a copy: a staging view is contiguous
        assert dst.dim() == 1 and dst.numel() == src.numel(), (dst.shape, src.shape)
        n, chunk = dst.numel(), self._chunk()
        return [
            (partial(op, dst[lo : lo + chunk], src[lo : lo + chunk]), min(chunk, n - lo) * per_element)
            for lo in range(0, n, chunk)
        ]

    def _run(self, chunks: list[Chunk]) -> None:
        """Run ``chunks`` shared with the helper if it takes the offer, else alone."""
        if self._helper is not None and len(chunks) > 1:
            job = SharedAdd(chunks)
            if self._helper.offer(job):
                job.run_front(self._scratch)
                self.helped.add("bytes", job.helped_bytes)
                self.helped.add("chunks", job.helped_chunks)
                return
        for run, _ in chunks:
            run(self._scratch)
