"""Device gradient accumulators: the fp32 buffers a block's gradients add into on the device across a
step's backwards, and their one ship per sequence into the host store.

Owns: the adds on the device (the same elementwise fp32 += compute-dtype sums, in the same order, as the
host accumulation, accumulate.py), the count of a block's backwards left, and the ship of a finished
accumulator through a staging buffer's two halves (staging.py) into the store's fp32 gradient. Used by
:class:`~nodetrain.engine.device.window.Window` (a mixin: the window owns the buffers, the staging and
the byte counts) for its resident blocks and for the streamed blocks of ``stream.grad_on_device``
(core/placement.py). Does not own which blocks accumulate on the device (core/) or the buffers' memory.

Waves (``pipeline.wave`` = W > 1): every other streamed block (not resident, not a row block, no device
accumulator) sums its W micro-batches' gradients of an item in an fp32 wave-sum buffer (one per slot,
sized by the largest such block, taken in rotation) and ships that sum once per item by the same path:
the store's first arrival of the step overwrites, later ones add fp32 += fp32. A buffer is written
again only once its previous ship has landed.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DeviceAccumulation"]


class DeviceAccumulation:
    """The window's device accumulation (reads and writes the :class:`Window`'s state: ``_grad_acc``,
    ``_acc_views``, ``_backwards_left``, ``_acc_started``, ``_staging``, the byte counts)."""

    def _accumulate_on_device(self, block: int, grads: dict[str, torch.Tensor]) -> None:
        """Add a block's gradients into its device fp32 accumulator (the same elementwise
        fp32 += compute-dtype sums, in the same order, as the host accumulation); ship it at the
        block's last backward of the sequence."""
        acc, first = self._acc_views[block], block not in self._acc_started
        for name, _, shape in self._views[block]:
            view = acc[name].view(shape)
            if first:
                view.copy_(grads[name])
            else:
                view.add_(grads[name])
        self._count_backward(block)

    def _count_backward(self, block: int) -> None:
        """One backward of an accumulating block done: ship its accumulator after the last one."""
        self._acc_started.add(block)
        self._backwards_left[block] -= 1
        if self._backwards_left[block] == 0 and block not in self._kept:
            self._ship(block)

    def _make_wave_buffers(self, blocks, slots: int, wave: int) -> None:
        """``slots`` fp32 wave-sum buffers of the largest wave-summed block's numel (none when W = 1)."""
        self.wave = wave
        skip = {*self.resident, *self.rows, *self.grad_acc}
        numel = max((self._numel(i) for i in blocks if i not in skip), default=0) if wave > 1 else 0
        self._wave_bufs = [torch.empty(numel, dtype=torch.float32, device=self.device) for _ in range(slots)]
        self._wave_bufs = self._wave_bufs if numel else []
        self._wave_busy: list = [None] * len(self._wave_bufs)  # each buffer's last ship (a Future)
        self._wave_open: dict[int, list[int]] = {}  # block -> [its buffer, adds so far] in the open wave
        self._wave_next = 0

    @property
    def wave_nbytes(self) -> int:
        """Device bytes of the fp32 wave-sum buffers, ``slots × 4 × largest wave-summed block`` (0: W = 1)."""
        return sum(b.numel() * 4 for b in self._wave_bufs)

    def _sums_waves(self, block: int) -> bool:
        """Whether ``block``'s offloads add into a wave-sum buffer (W > 1, a streamed slotted block)."""
        return bool(self._wave_bufs) and block not in self._resident and block not in self._acc_views

    def _wave_add(self, block: int, grads: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's gradients of ``block`` (local name -> compute dtype, device) into the
        wave-sum buffer of its open wave (the first copies: no zeroing); after the W-th, ship the fp32
        sum once (:meth:`_ship`). A buffer's first add of a wave waits for its previous ship."""
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
            self._wave_busy[k] = self._ship(block, acc[: self._numel(block)])

    def _ship(self, block: int, acc: torch.Tensor | None = None):
        """Queue the D2H copy of ``block``'s fp32 accumulator (or of ``acc``, a flat fp32 device sum laid
        out as the block's slot) into the store (first write: a copy); returns its Future.

        It takes the next staging buffer of the rotation and counts as an offload in flight, so a
        later offload's copy waits for it (``_free_staging``); it need not wait itself: its buffer is
        written only inside its job, after the buffer's previous job on the in-order D2H worker.
        It streams the accumulator through the buffer's two halves in chunks (``GradStaging.ship``)."""
        acc, targets = self._grad_acc[block] if acc is None else acc, self._grad_targets[block]
        jobs = []
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
            self._staging.ship(jobs, halves, ready, self._land)
            if self._on_arrival is not None:
                self._on_arrival(block)

        self._offloads.append(self._d2h.submit(ship))
        return self._offloads[-1]

    def _land(self, dst: torch.Tensor, first: bool, half: torch.Tensor) -> None:
        """D2H worker: write a landed ship chunk into its fp32 target."""
        if first:
            self._accum.copy(dst, half)
        else:  # a target shared with another block (the tied embedding of one stage)
            self._accum.add(dst, half)

    def _accumulate_rows_on_device(self, block: int, index: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """A row block's gradient rows ([U, D] compute dtype, device; ``index`` [U] int64, host, unique)
        added into its [V, D] fp32 device accumulator, zeroed at the sequence's first; shipped at the
        last, as the host's ``HostAccumulator.index_add`` would have added them."""
        (b,) = self.bindings[block]
        acc = self._grad_acc[block].view(b.shape)
        if block not in self._acc_started:
            acc.zero_()
        acc.index_add_(0, index.to(self.device, non_blocking=True), grad_rows.to(torch.float32))
        self._count_backward(block)
