"""Host staging of gradient offloads: one buffer per window slot, page-locked on CUDA.

Owns: the host buffers a block's gradients land in on their way from the device to the host store's
fp32 accumulators, the D2H CUDA stream their copies run on, and the event that tells the D2H worker
a copy has landed. Does not own: which buffer is free (``Window.offload`` bounds the offloads in
flight to the number of buffers, so buffer ``n % num_buffers`` is reused only after offload
``n - num_buffers`` was accumulated) nor the accumulation itself (window.py).

Why: a device→host copy into pageable memory goes through the driver's own bounce buffer and
blocks the issuing thread (a few GB/s); into page-locked memory it is a DMA that runs on its
stream at link speed (tens of GB/s) while the host does other work. See PyTorch's "pinned memory
buffers" note (docs.pytorch.org/docs/stable/notes/cuda.html) and ``torch.Tensor.copy_`` /
``torch.cuda.Event``.

Flow of one offload (the same calls on CPU and CUDA; on CPU the copy is a plain synchronous copy,
there is no stream and no event, so the buffer rotation is exercised by the CPU tests as well):
    issue()      caller's thread: the D2H stream waits for the compute queued so far (a GPU-side
                 wait, the host does not block), then ``copy_(non_blocking=True)`` of each
                 gradient into the buffer and an event after the copies;
    wait()       D2H worker: blocks on that event, drops the device gradients (their memory goes
                 back to the compute stream only after the copy finished), returns the host views.
"""

from __future__ import annotations

import torch

__all__ = ["GradStaging", "Staged"]


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One gradient into its staging view (a hook point: tests slow the D2H stream here)."""
    dst.view(src.shape).copy_(src, non_blocking=True)


class Staged:
    """The gradients of one offload, in flight to (or landed in) a staging buffer.

    Args:
        views: flat host views ``[numel]`` (compute dtype) of the staging buffer, one per gradient.
        grads: the device gradients, kept alive until the copy has finished (CUDA only).
        event: recorded on the D2H stream after the copies (CUDA), or None (CPU: already copied).
    """

    def __init__(self, views: list[torch.Tensor], grads: tuple[torch.Tensor, ...], event):
        self._views, self._grads, self._event = views, grads, event

    def wait(self) -> list[torch.Tensor]:
        """Block until the copies landed; returns the host views (flat, compute dtype)."""
        if self._event is not None:
            self._event.synchronize()
        self._grads = ()  # their device memory may now be reused by the compute stream
        return self._views


class GradStaging:
    """``num_buffers`` host buffers of ``numel`` elements; pinned when ``device`` is a CUDA device.

    Args:
        num_buffers: buffers (one per window slot: ``Window.offload`` keeps that many in flight).
        numel: elements of the largest block's gradients (all blocks, resident ones included).
        dtype: the compute dtype (the gradients' dtype).
        device: the compute device; CUDA: page-locked buffers and a D2H stream of its own.

    Memory: ``num_buffers × numel × dtype.itemsize`` bytes of host memory (``nbytes``).
    """

    def __init__(self, num_buffers: int, numel: int, dtype: torch.dtype, device: torch.device):
        assert num_buffers >= 1, num_buffers
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        """The D2H stream (CUDA), or None."""
        self._buffers = [torch.empty(numel, dtype=dtype, pin_memory=cuda) for _ in range(num_buffers)]

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        """Host bytes of the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def pinned(self) -> bool:
        """Whether every buffer is page-locked (True only on CUDA)."""
        return all(b.is_pinned() for b in self._buffers)

    def issue(self, index: int, grads: list[torch.Tensor]) -> Staged:
        """Copy ``grads`` into buffer ``index``, asynchronously on CUDA.

        The buffer must be free: its previous :class:`Staged` was waited for and its views consumed.

        Args:
            index: the buffer, ``0 <= index < len(self)``.
            grads: gradients (compute dtype, on the compute device; any shape), whose total numel
                fits a buffer. On CUDA they may still be being computed: the copy is ordered after
                the work queued on the current stream.

        Returns:
            the in-flight copy; its :meth:`Staged.wait` gives one flat view per gradient, in order.
        """
        buf = self._buffers[index]
        views, pos = [], 0
        for g in grads:
            assert g.dtype == buf.dtype, f"gradient dtype {g.dtype} is not the staging dtype {buf.dtype}"
            views.append(buf[pos : pos + g.numel()])
            pos += g.numel()
        assert pos <= buf.numel(), f"{pos} gradient elements exceed the staging buffer's {buf.numel()}"
        if self.stream is None:
            for dst, src in zip(views, grads, strict=True):
                _copy_in(dst, src)
            return Staged(views, (), None)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in zip(views, grads, strict=True):
                _copy_in(dst, src)
            event = self.stream.record_event()
        return Staged(views, tuple(grads), event)
