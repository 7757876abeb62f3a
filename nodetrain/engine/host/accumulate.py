"""Host gradient accumulation: fp32 accumulators += staged gradients, with no temporaries.

Owns: the arithmetic that lands a staged gradient in the host store's fp32 accumulator (a first
write copies, later ones add, the embedding's rows scatter-add) and the one reused fp32 scratch it
goes through. Does not own: the staging buffers (staging.py) nor which offload writes which
accumulator (window.py, whose D2H worker calls this on its OpenMP team of ``accum_threads``).

Why a scratch: on the CPU, ``fp32.add_(bf16)`` promotes the bf16 operand by materialising
``src.to(float32)`` (TensorIterator casts a CPU input to the common dtype with a copy): numel × 4
bytes allocated, page-faulted and freed at every add (50M elements: 48,829 minor faults and
166-191 ms, against 18 ms for fp32 += fp32). Here each chunk of ``threads × CHUNK_PER_THREAD``
elements is widened into the scratch (``copy_`` converts in its kernel, no temporary) and added from
there while it is still in cache. bf16/fp16 → fp32 is exact and each add is one fp32 rounding, so
the sums are those of ``fp32(dst) + fp32(src)`` bit for bit, as before.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_PER_THREAD", "HostAccumulator"]

CHUNK_PER_THREAD = 1 << 18
"""Elements per thread of a chunk: 1 MiB of fp32 scratch and 512 KiB of bf16 source, about one core's
L2 (1-2 MiB on current server CPUs), so the widened chunk is added while it is still in cache. Smaller
chunks pay the per-op dispatch (~10 µs) too often: on 100M bf16 elements and 2 threads, 2^15 per thread
took 77 ms, 2^17 35 ms, 2^18 26 ms, 2^20 23 ms, one whole-tensor scratch 34 ms, fp32 += fp32 21 ms
and the old ``add_`` of bf16 195 ms."""


class HostAccumulator:
    """fp32 host accumulators += staged gradients, through one reused fp32 scratch.

    Call from one thread only (the D2H worker): the chunk is ``torch.get_num_threads()`` (that
    thread's OpenMP team) × ``chunk_per_thread`` elements, so each op of a chunk gives every thread of
    the team ``chunk_per_thread`` elements. The scratch is allocated at the first use and grows only
    (to a row of the largest row block if that is longer), so a step's steady state allocates nothing.

    Args:
        chunk_per_thread: elements per thread of a chunk (≥ 1).
    """

    def __init__(self, chunk_per_thread: int = CHUNK_PER_THREAD):
        assert chunk_per_thread >= 1, chunk_per_thread
        self.chunk_per_thread = chunk_per_thread
        self._scratch = torch.empty(0)

    @property
    def scratch_nbytes(self) -> int:
        """Host bytes of the scratch (fp32)."""
        return self._scratch.numel() * 4

    def _chunk(self, at_least: int = 1) -> int:
        """The chunk in elements; the scratch holds at least ``max(chunk, at_least)`` of them."""
        chunk = torch.get_num_threads() * self.chunk_per_thread
        need = max(chunk, at_least)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        return chunk

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst = src`` widened (a first write: the accumulator's old contents are not read).

        Args:
            dst: [N] fp32, host (a flat accumulator range).
            src: N elements of any float dtype, host (a staging view; any shape).
        """
        dst.copy_(src.view(dst.shape))  # the copy kernel converts elementwise: no temporary

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst += fp32(src)`` elementwise, chunk by chunk.

        Args:
            dst: [N] fp32, host, contiguous.
            src: N elements of any float dtype, host, contiguous (any shape).
        """
        src = src.view(-1)
        assert dst.dim() == 1 and dst.numel() == src.numel(), (dst.shape, src.shape)
        if src.dtype == torch.float32:
            dst.add_(src)
            return
        chunk = self._chunk()
        for lo in range(0, dst.numel(), chunk):
            hi = min(lo + chunk, dst.numel())
            wide = self._scratch[: hi - lo]
            wide.copy_(src[lo:hi])
            dst[lo:hi].add_(wide)

    def index_add(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[r]] += fp32(src[r])`` for each row ``r``, a chunk of rows at a time.

        Args:
            dst: [V, D] fp32, host (the embedding's accumulator).
            index: [U] int64, host, unique row indices (so the row order does not change a sum).
            src: [U, D] any float dtype, host, contiguous.
        """
        if src.dtype == torch.float32:
            dst.index_add_(0, index, src)
            return
        width = src.shape[1]
        rows = max(1, self._chunk(at_least=width) // max(width, 1))
        for lo in range(0, src.shape[0], rows):
            hi = min(lo + rows, src.shape[0])
            wide = self._scratch[: (hi - lo) * width].view(hi - lo, width)
            wide.copy_(src[lo:hi])
            dst.index_add_(0, index[lo:hi], wide)
