"""Streaming window: the device buffers a stage's blocks pass through, and the copies in and out.

Owns: ``slots`` device buffers (one block's weights each), the H2D prefetch of the next blocks
of a known load sequence, and the D2H offload of gradients into the host store's fp32
accumulators. Each direction runs on its own copy worker thread; on CUDA each worker issues
its copies on its own CUDA stream, ordered against the compute stream with events. On CPU the
"device" buffers are separate tensors and the workers copy asynchronously, so the protocol
below is exercised for real (``delay_s`` slows the workers to expose a missing wait).

Protocol (load ``k`` of the sequence uses slot ``k % slots``):
    acquire()  waits until load k is in its slot, returns the bound parameter views;
    release()  marks compute on slot k finished and issues load k + slots into it;
    offload()  queues the block's gradients for D2H + accumulate; at most ``slots`` in flight;
    flush()    waits for every queued offload (before the optimizer reads the accumulators).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nodetrain.model import Binding
from nodetrain.store import HostStore

__all__ = ["Window"]


class _CopyWorker:
    """One copy direction: a single thread (in-order), plus a CUDA stream when on GPU."""

    def __init__(self, name: str, device: torch.device, delay_s: float):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._delay_s = delay_s

    def submit(self, fn) -> Future:
        ready = None
        if self._stream is not None:  # the copy may start only after compute queued so far
            ready = torch.cuda.current_stream().record_event()
        return self._pool.submit(self._run, fn, ready)

    def _run(self, fn, ready):
        if self._delay_s:
            time.sleep(self._delay_s)
        if self._stream is None:
            fn()
            return None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            fn()
            return self._stream.record_event()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _wait(fut: Future) -> None:
    done = fut.result()  # re-raises a worker's exception here
    if done is not None:
        torch.cuda.current_stream().wait_event(done)


class Window:
    """``slots`` device buffers through which a stage's blocks stream.

    Args:
        store: the host store (source of ``compute`` copies, target of gradients).
        bindings: per block index, the parameters it binds (see ``HFModel.bindings``).
        blocks: block indices of this stage (only these are ever loaded).
        owned_units: units whose optimizer runs on this stage; a binding to any other unit (the
            tied embedding on the last stage) accumulates into that unit's ``grad_tied``.
        slots: number of device buffers (≥ 1).
        device: compute device.
        delay_s: test-only sleep before each copy.

    Memory: ``slots × max block numel × compute itemsize`` bytes on the device (``nbytes``).
    """

    def __init__(self, store: HostStore, bindings, blocks, owned_units, slots: int, device, delay_s=0.0):
        self.store, self.bindings, self.device = store, bindings, torch.device(device)
        dtype = store.layout.compute_dtype
        numel = max(sum(b.numel for b in bindings[i]) for i in blocks)
        self._slots = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(slots)]
        self._views = {i: self._slot_views(bindings[i]) for i in blocks}
        self._grad_targets = {i: self._grad_views(bindings[i], set(owned_units)) for i in blocks}
        self._h2d = _CopyWorker("h2d", self.device, delay_s)
        self._d2h = _CopyWorker("d2h", self.device, delay_s)
        self._seq: list[int] = []
        self._loads: dict[int, Future] = {}
        self._next = 0
        self._offloads: list[Future] = []
        self.stall_s = 0.0
        """Seconds compute waited for H2D since the last :meth:`begin`."""

    @property
    def nbytes(self) -> int:
        """Device bytes held by the slots."""
        return sum(s.numel() * s.element_size() for s in self._slots)

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

    def begin(self, sequence: list[int]) -> None:
        """Start a new load sequence (block indices in compute order) and prefetch its head."""
        assert not self._loads, "previous sequence not drained"
        self._seq, self._next, self.stall_s = list(sequence), 0, 0.0
        for k in range(min(len(self._slots), len(self._seq))):
            self._prefetch(k)

    def _prefetch(self, k: int) -> None:
        block, slot = self._seq[k], self._slots[k % len(self._slots)]
        pieces, pos = [], 0
        for b in self.bindings[block]:
            src = self.store.compute(b.unit)[b.offset : b.offset + b.numel]
            pieces.append((slot[pos : pos + b.numel], src))
            pos += b.numel

        def copy():
            for dst, src in pieces:
                dst.copy_(src, non_blocking=True)

        self._loads[k] = self._h2d.submit(copy)

    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        """Wait for the next load (which must be ``block``) and return its parameter views.

        Returns:
            local name -> view of the slot, shaped as the parameter (compute dtype, device).
        """
        k = self._next
        assert self._seq[k] == block, f"load order broken: expected block {self._seq[k]}, got {block}"
        t0 = time.perf_counter()
        _wait(self._loads.pop(k))
        self.stall_s += time.perf_counter() - t0
        slot = self._slots[k % len(self._slots)]
        views = self._views[block]
        return {name: slot[pos : pos + math.prod(shape)].view(shape) for name, pos, shape in views}

    def release(self) -> None:
        """Compute on the current slot is issued; reuse the slot for the load ``slots`` ahead."""
        k = self._next
        self._next += 1
        if k + len(self._slots) < len(self._seq):
            self._prefetch(k + len(self._slots))

    def offload(self, block: int, grads: dict[str, torch.Tensor]) -> None:
        """Queue D2H of ``grads`` (local name -> gradient, device) added into the host accumulators."""
        targets = self._grad_targets[block]
        pairs = [(targets[name], g) for name, g in grads.items()]

        def accumulate():
            for dst, g in pairs:
                dst.add_(g.reshape(-1).to(device="cpu", dtype=torch.float32))

        self._offloads.append(self._d2h.submit(accumulate))
        while len(self._offloads) > len(self._slots):  # bound gradient memory in flight
            self._offloads.pop(0).result()

    def flush(self) -> None:
        """Wait for every queued offload; the host accumulators are then complete."""
        while self._offloads:
            self._offloads.pop(0).result()
        assert self._next == len(self._seq) and not self._loads, "load sequence not fully consumed"

    def close(self) -> None:
        self._h2d.shutdown()
        self._d2h.shutdown()
