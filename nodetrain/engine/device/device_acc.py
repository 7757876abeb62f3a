"""Device gradient sums: the fp32 buffers a block's gradients add into on the device, and when each
sum is complete and leaves.

Owns: the per-step accumulators of the resident blocks and of the streamed blocks of
``stream.grad_on_device`` (core/placement.py), the views of the blocks whose optimizer runs on the
device (DeviceAdamW's, never shipped), the wave-sum buffers (``pipeline.wave`` > 1), the adds (the same
elementwise fp32 += compute-dtype sums, in the same order, as the host accumulation, accumulate.py), the
count of a block's backwards left and the hand-over of a complete sum to ``ship``. Does not own how a
sum crosses to the host (the window's ``_ship``: staging, the D2H worker, byte counts) nor which blocks
sum on the device (core/).

Waves (``pipeline.wave`` = W > 1): every other streamed block (not resident, not a row block, no per-step
accumulator) sums its W micro-batches' gradients of an item in an fp32 wave-sum buffer (one per slot,
sized by the largest such block, taken in rotation) and ships that sum once per item by the same path:
the store's first arrival of the step overwrites, later ones add fp32 += fp32. A buffer is written
again only once its previous ship has landed.

Written by the training thread only (DESIGN invariant 9).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future

import torch

from nodetrain.run.breakdown import NULL_TIMELINE

__all__ = ["DeviceSums", "slot_layout"]

Layout = list[tuple[str, int, tuple[int, ...]]]
"""(local name, offset in elements, shape) of each binding in a block's flat buffer (a window slot)."""


def slot_layout(bindings) -> Layout:
    """A block's flat layout: its bindings (``model.Binding``: local_name, numel, shape) back to back."""
    out, pos = [], 0
    for b in bindings:
        out.append((b.local_name, pos, b.shape))
        pos += b.numel
    return out


class DeviceSums:
    """A stage's fp32 gradient sums on the device.

    Args:
        views: each block's flat layout (the window's slot layout).
        device: the compute device.
        accumulate: blocks with a per-step fp32 accumulator (resident ones and ``grad_acc``), less
            those in ``kept``; each gets ``numel × 4`` bytes.
        kept: blocks whose gradients add into their optimizer's device views (DeviceAdamW): block ->
            local name -> fp32 flat view; summed like the others, never shipped.
        wave: W; wave_blocks: the blocks that sum per wave (W > 1), ``slots`` buffers of the largest.
        ship: ``ship(block, flat) -> Future``, queue a complete fp32 sum (laid out as ``views[block]``)
            for the host store; the Future resolves once it has landed.
        timeline: where a wave buffer's wait for its previous ship is timed (``d2h_wait``).
    """

    def __init__(
        self,
        views: dict[int, Layout],
        device: torch.device,
        accumulate,
        kept: dict,
        wave: int,
        wave_blocks,
        slots: int,
        ship: Callable[[int, torch.Tensor], Future],
        timeline=NULL_TIMELINE,
    ):
        self._views, self._ship, self.timeline, self.wave = views, ship, timeline, wave
        numel = {b: sum(math.prod(s) for _, _, s in v) for b, v in views.items()}
        self._acc = {b: torch.empty(numel[b], dtype=torch.float32, device=device) for b in accumulate}
        self._named = {b: self._split(b, a) for b, a in self._acc.items()} | dict(kept)
        self._left: dict[int, int] = {}  # accumulating block -> backwards left in the sequence
        self._started: set[int] = set()  # blocks written since begin()
        size = max((numel[b] for b in wave_blocks), default=0) if wave > 1 else 0
        self._wave_bufs = (
            [torch.empty(size, dtype=torch.float32, device=device) for _ in range(slots)] if size else []
        )
        self._wave_busy: list[Future | None] = [None] * len(self._wave_bufs)  # each buffer's last ship
        self._wave_open: dict[int, list[int]] = {}  # block -> [its buffer, adds so far] in the open wave
        self._wave_next = 0

    def _split(self, block: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: flat[p : p + math.prod(s)] for n, p, s in self._views[block]}

    def nbytes(self, blocks) -> int:
        """Device bytes of the per-step accumulators of ``blocks`` (those that have one)."""
        return sum(self._acc[b].numel() * 4 for b in blocks if b in self._acc)

    @property
    def wave_nbytes(self) -> int:
        """Device bytes of the fp32 wave-sum buffers, ``slots × 4 × largest wave-summed block`` (0: W = 1)."""
        return sum(b.numel() * 4 for b in self._wave_bufs)

    def begin(self, backwards: dict[int, int] | None) -> None:
        """A new sequence: ``backwards`` block -> backwards it gets; the blocks listed that have a sum
        (an accumulator or kept views) add into it and ship at their last."""
        assert not self._wave_open, f"waves left open: {self._wave_open}"
        self._left = {b: n for b, n in (backwards or {}).items() if b in self._named and n > 0}
        self._started.clear()

    def takes(self, block: int) -> bool:
        """Whether ``block``'s gradients add into its per-step sum in this sequence."""
        return block in self._left

    def sums_wave(self, block: int, resident) -> bool:
        """Whether ``block``'s offloads add into a wave-sum buffer (W > 1, a streamed slotted block)."""
        return bool(self._wave_bufs) and block not in resident and block not in self._named

    def add(self, block: int, grads: dict[str, torch.Tensor]) -> None:
        """Add a block's gradients (local name -> compute dtype, device) into its per-step sum; ship it
        at the block's last backward of the sequence."""
        first = block not in self._started
        for name, _, shape in self._views[block]:
            view = self._named[block][name].view(shape)
            if first:
                view.copy_(grads[name])
            else:
                view.add_(grads[name])
        self._count(block)

    def add_rows(self, block: int, shape, index: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """A row block's gradient rows ([U, D] compute dtype, device; ``index`` [U] int64, host, unique)
        added into its [V, D] (``shape``) fp32 accumulator, zeroed at the sequence's first; shipped at the
        last, as the host's ``HostAccumulator.index_add`` would have added them."""
        acc = self._acc[block].view(shape)
        if block not in self._started:
            acc.zero_()
        acc.index_add_(0, index.to(acc.device, non_blocking=True), grad_rows.to(torch.float32))
        self._count(block)

    def _count(self, block: int) -> None:
        self._started.add(block)
        self._left[block] -= 1
        if self._left[block] == 0 and block in self._acc:
            self._ship(block, self._acc[block])

    def add_wave(self, block: int, grads: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's gradients of ``block`` into the wave-sum buffer of its open wave (the
        first copies: no zeroing); after the W-th, ship the fp32 sum once. A buffer's first add of a
        wave waits for its previous ship."""
        if block not in self._wave_open:
            k = self._wave_next % len(self._wave_bufs)
            self._wave_next += 1
            busy = self._wave_busy[k]
            if busy is not None and not busy.done():
                with self.timeline.phase("d2h_wait"):
                    busy.result()
            self._wave_open[block] = [k, 0]
        k, n = self._wave_open[block]
        acc = self._wave_bufs[k]
        for name, pos, shape in self._views[block]:
            view = acc[pos : pos + math.prod(shape)].view(shape)
            if n == 0:
                view.copy_(grads[name])
            else:
                view.add_(grads[name])
        self._wave_open[block][1] = n + 1
        if n + 1 == self.wave:
            del self._wave_open[block]
            numel = sum(math.prod(s) for _, _, s in self._views[block])
            self._wave_busy[k] = self._ship(block, acc[:numel])

    def check_drained(self) -> None:
        """Every sum of the sequence shipped (after the last backward)."""
        left = {b: n for b, n in self._left.items() if n}
        assert not left, f"accumulating blocks' backwards left unshipped: {left}"
        assert not self._wave_open, f"waves left unshipped: {self._wave_open}"
