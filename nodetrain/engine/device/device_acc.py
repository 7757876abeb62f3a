"""Device gradient accumulators: the fp32 buffers a block's gradients add into on the device across a
step's backwards, and their one ship per sequence into the host store.

Owns: the adds on the device (the same elementwise fp32 += compute-dtype sums, in the same order, as the
host accumulation, accumulate.py), the count of a block's backwards left, and the ship of a finished
accumulator through a staging buffer's two halves (staging.py) into the store's fp32 gradient. Used by
:class:`~nodetrain.engine.device.window.Window` (a mixin: the window owns the buffers, the staging and
the byte counts) for its resident blocks and for the streamed blocks of ``stream.grad_on_device``
(core/placement.py). Does not own which blocks accumulate on the device (core/) or the buffers' memory.
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

    def _ship(self, block: int) -> None:
        """Queue the D2H copy of ``block``'s fp32 accumulator into the store (first write: a copy).

        It takes the next staging buffer of the rotation and counts as an offload in flight, so a
        later offload's copy waits for it (``_free_staging``); it need not wait itself: its buffer is
        written only inside its job, after the buffer's previous job on the in-order D2H worker.
        It streams the accumulator through the buffer's two halves in chunks (``GradStaging.ship``)."""
        acc, targets = self._grad_acc[block], self._grad_targets[block]
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
