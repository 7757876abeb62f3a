"""Saved block inputs of in-flight micro-batches, offloaded to host RAM between forward and backward.

A GPipe stage of 2 layers, 3 micro-batches (time →; x = the saved inputs of a micro-batch):

    compute   | F0        | F1        | F2        | B0        | B1        | B2        |
    D2H       | x0 → host | x1 → host | x2 → host |           |           |           |
    H2D       |           | x0 → dev  ·····  wait ↑ | x1 → dev  | x2 → dev  |           |
    device    | x0 (going)| x1 + x0   | x2 + x0   | x0 + x1   | x1 + x2   | x2        |
    put() copies each block's input into a host buffer as the forward saves it (its device memory is
    let go); done() ends a micro-batch's forward; take() waits for the micro-batch's inputs at its
    backward and issues the H2D of the next micro-batch in backward order, whose forward is done.

Owns: the host buffers the saved inputs wait in (a ``GradStaging`` of their own: page-locked on
CUDA, its D2H stream; on CPU plain host memory and a copy at once), their prefetch back to the
device as jobs on the window's H2D worker (on CUDA its H2D stream, ordered with events), the order
of backwards they are prefetched in, and the count of saved inputs alive on the device
(:class:`LiveBytes`). Device memory then holds the saved inputs of about two micro-batches: the one
whose backward runs and the next one's, whatever the number in flight. Does not own which tensors a
forward saves (stage.py) or the order of actions (step_plan.py). Exact: the values come back bit
for bit. Where it pays and what it costs on the link: docs/activation_offload.md.

The training thread alone calls :class:`SavedOffload` (its free buffers, its prefetch state); the
H2D worker writes only the device tensors of a prefetch, handed over by the job's future.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from nodetrain.core.schedule import in_flight_peak
from nodetrain.engine.device.copy_worker import CopyWorker, wait_copy
from nodetrain.engine.device.staging import GradStaging, Staged
from nodetrain.engine.threads import check_writer
from nodetrain.run.breakdown import NULL_TIMELINE

__all__ = ["LiveBytes", "Offloaded", "SavedOffload", "saved_offload", "saved_per_microbatch"]


class LiveBytes:
    """Device tensors noted alive (a weak reference each) and their bytes' high-water mark."""

    def __init__(self) -> None:
        self._live: list[tuple[weakref.ref, int]] = []
        self.peak_bytes = 0
        """Most bytes of noted tensors alive at once since construction or :meth:`reset_peak`."""

    def note(self, t: torch.Tensor) -> None:
        """Count ``t`` while it is alive (the count only grows at a note, so the peak is exact)."""
        self._live = [(r, n) for r, n in self._live if r() is not None]
        self._live.append((weakref.ref(t), t.numel() * t.element_size()))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    @property
    def live_bytes(self) -> int:
        return sum(n for r, n in self._live if r() is not None)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


@dataclass(frozen=True)
class Offloaded:
    """A saved input waiting in host RAM: the ``k``-th :meth:`SavedOffload.put` of its micro-batch."""

    k: int


def saved_per_microbatch(blocks, is_last: bool) -> int:
    """Tensors a training forward of a stage of ``blocks`` saves on the device per micro-batch:
    the input of every block its backward recomputes, but the embedding's (token ids, or the rows
    it gathered: the step's, not a micro-batch's), and on the last stage the head's input gradient."""
    recomputed = list(blocks)[:-1] if is_last else list(blocks)
    return sum(1 for b in recomputed if b != 0) + int(is_last)


class SavedOffload:
    """Host copies of a stage's saved inputs, brought back before each backward.

    Args:
        num_buffers: host buffers, one per saved input waiting at once (micro-batches in flight ×
            :func:`saved_per_microbatch`).
        numel: elements of one saved input ([B, T, D]); dtype: the compute dtype.
        device: the compute device (CUDA: page-locked buffers and a D2H stream of their own).
        order: the step's micro-batches in the order of their backwards
            (``StepPlan.backward_microbatches``); every step repeats it.
        h2d: the window's H2D copy worker (``Window.h2d``), which runs the prefetches in order with
            its weight loads.
        timeline: the wait for a prefetch enters its ``stall`` phase (breakdown.py).

    Memory: ``num_buffers × numel × itemsize`` bytes of host memory (``host_nbytes``), page-locked
    on CUDA; on the device the saved inputs of the backward running and of the next (``live``).

    Raises:
        RuntimeError: on CUDA, page-locking a buffer failed.
    """

    def __init__(
        self,
        num_buffers: int,
        numel: int,
        dtype: torch.dtype,
        device,
        order,
        h2d: CopyWorker,
        timeline=NULL_TIMELINE,
    ):
        self.device, self.dtype = torch.device(device), dtype
        self._staging = GradStaging(num_buffers, numel, dtype, self.device)
        self._free = list(range(num_buffers))[::-1]  # host buffers not holding an input
        self._host: dict[int, list[tuple[int, Staged, torch.Size]]] = {}  # mb -> (buffer, copy, shape)
        self._complete: set[int] = set()  # micro-batches whose forward is done, not yet prefetched
        self._fetch: tuple[int, Future, list[torch.Tensor], list[int]] | None = None  # mb, job, out, bufs
        self._order, self._next = list(order), 0  # _order[_next]: the next backward's micro-batch
        self._h2d, self.timeline = h2d, timeline
        self.live = LiveBytes()
        """The saved inputs on the device: each prefetch's tensors from their allocation on."""
        self.d2h_bytes = self.h2d_bytes = 0
        """Bytes copied each way since the last :meth:`take_stats`."""
        self.stall_s = 0.0
        """Seconds backwards waited for a prefetch since the last :meth:`take_stats`."""

    @property
    def host_nbytes(self) -> int:
        """Host bytes of the buffers the saved inputs wait in (page-locked on CUDA)."""
        return self._staging.nbytes

    def put(self, mb: int, x: torch.Tensor) -> Offloaded:
        """Copy ``x`` (a saved input of micro-batch ``mb``: compute dtype on the device) into a free
        host buffer: on CUDA asynchronously on the D2H stream, after the compute queued so far, and
        ``x``'s memory is reused only after that copy; on CPU at once. The caller drops ``x``."""
        check_writer("training", "the saved inputs")
        assert self._free, "more saved inputs waiting than host buffers (saved_per_microbatch is off)"
        i = self._free.pop()
        stored = self._host.setdefault(mb, [])
        stored.append((i, self._staging.issue(i, [x], hold=False), x.shape))
        self.d2h_bytes += x.numel() * x.element_size()
        return Offloaded(len(stored) - 1)

    def done(self, mb: int) -> None:
        """Micro-batch ``mb``'s forward has put every input: it may be prefetched."""
        check_writer("training", "the saved inputs")
        self._complete.add(mb)
        self._prefetch()

    def take(self, mb: int) -> list[torch.Tensor]:
        """Micro-batch ``mb``'s saved inputs on the device, in :meth:`put` order (waits for their
        H2D); then prefetches the next backward's, if its forward is done.

        Returns:
            one tensor per put, as it was put (compute dtype, on the device).
        """
        check_writer("training", "the saved inputs")
        want = self._order[self._next]
        assert mb == want, f"backward of micro-batch {mb}, but {want} is next in the step's order"
        self._prefetch()
        assert self._fetch is not None and self._fetch[0] == mb, f"micro-batch {mb} was not saved"
        _, job, out, buffers = self._fetch
        self._fetch = None
        t0 = time.perf_counter()
        with self.timeline.phase("stall"):
            wait_copy(job)
        self.stall_s += time.perf_counter() - t0
        self._free += buffers  # the H2D finished: the buffers may take new inputs
        self._next = (self._next + 1) % len(self._order)
        self._prefetch()
        return out

    def _prefetch(self) -> None:
        """Issue the H2D of the next backward's inputs once its forward is done (one at a time)."""
        mb = self._order[self._next]
        if self._fetch is not None or mb not in self._complete:
            return
        self._complete.discard(mb)
        stored = self._host.pop(mb)
        out = [torch.empty(shape, dtype=self.dtype, device=self.device) for _, _, shape in stored]
        for t in out:
            self.live.note(t)
        pairs = [(dst, staged) for dst, (_, staged, _) in zip(out, stored, strict=True)]

        def copy():
            for dst, staged in pairs:
                (src,) = staged.wait()  # CUDA: the D2H has landed
                dst.copy_(src.view(dst.shape), non_blocking=True)

        self.h2d_bytes += sum(t.numel() * t.element_size() for t in out)
        self._fetch = (mb, self._h2d.submit(copy), out, [i for i, _, _ in stored])

    def take_stats(self) -> dict[str, float]:
        """The step's figures (bytes each way, the device high-water mark, the host buffers, the
        wait), reset for the next step."""
        out = {
            "act_d2h_bytes": self.d2h_bytes,
            "act_h2d_bytes": self.h2d_bytes,
            "act_stall_s": self.stall_s,
            "saved_peak_bytes": self.live.peak_bytes,
            "saved_host_bytes": self.host_nbytes,
        }
        self.d2h_bytes = self.h2d_bytes = 0
        self.stall_s = 0.0
        self.live.reset_peak()
        return out

    def close(self) -> None:
        """Release the page-locks (CUDA); no input may be waiting."""
        self._staging.close()


def saved_offload(stream, plan, blocks, is_last: bool, window, shape) -> SavedOffload | None:
    """The stage's :class:`SavedOffload` when ``stream.offload_activations`` (else None; also None
    for a stage that saves nothing, the embedding alone).

    Args:
        stream: the ``stream`` config; plan: the stage's ``StepPlan``; blocks, is_last: the stage.
        window: the stage's window (its device, compute dtype, H2D worker and timeline).
        shape: [B, T, D] of a saved input.
    """
    per_mb = saved_per_microbatch(blocks, is_last)
    if not stream.offload_activations or per_mb == 0:
        return None
    numel = shape[0] * shape[1] * shape[2]
    dtype = window.store.layout.compute_dtype
    buffers = in_flight_peak(list(plan.actions)) * per_mb
    return SavedOffload(
        buffers, numel, dtype, window.device, plan.backward_microbatches, window.h2d, window.timeline
    )
