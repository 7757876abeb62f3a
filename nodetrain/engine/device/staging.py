"""Host staging of gradient offloads: one buffer per window slot, page-locked on CUDA.

Owns: the host buffers a block's gradients land in on their way from the device to the host store's
fp32 accumulators, the D2H CUDA stream their copies run on, and the event that tells the D2H worker
a copy has landed. A resident block's fp32 accumulator is shipped through a buffer too, as two
halves (``halves``, window.py); activations.py stages the saved block inputs of in-flight
micro-batches through a set of its own. Does not own: which buffer is free (``Window.offload``
bounds the offloads and ships in flight to the number of buffers, so buffer ``n % num_buffers`` is
reused only after job ``n - num_buffers`` was accumulated) nor the accumulation itself (accumulate.py).
The other direction's one staged copy is here too: the embedding's rows a micro-batch uses
(:func:`rows_to_device`, gathered into page-locked memory on CUDA).

Flow of one offload (the same calls on CPU and CUDA; on CPU the copy is a plain synchronous copy,
there is no stream and no event, so the buffer rotation is exercised by the CPU tests as well):
    issue()      caller's thread: the D2H stream waits for the compute queued so far (a GPU-side
                 wait, the host does not block), then ``copy_(non_blocking=True)`` of each
                 gradient into the buffer and an event after the copies;
    wait()       D2H worker: blocks on that event, drops the device gradients (their memory goes
                 back to the compute stream only after the copy finished), returns the host views.

Page-locking: each buffer is its own anonymous ``mmap`` registered with ``cudaHostRegister`` on
CUDA (store.py ``pin``), so the pinned bytes are the requested ones rounded up to a page
(``pinned_nbytes``).

Why page-locked, and why not ``torch.empty(pin_memory=True)``: docs/gpu.md#host-memory-and-cores.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref

import torch

__all__ = ["GradStaging", "Staged", "page_round", "rows_to_device"]

PAGE = mmap.PAGESIZE


def page_round(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one)."""
    return max(1, -(-nbytes // PAGE)) * PAGE


def _host_buffer(nbytes: int) -> torch.Tensor:
    """[page_round(nbytes)] uint8 of page-aligned anonymous memory (the tensor keeps the map alive)."""
    return torch.frombuffer(mmap.mmap(-1, page_round(nbytes)), dtype=torch.uint8)


def _register(buffers: list[torch.Tensor]) -> list[int]:
    """Page-lock each buffer (``cudaHostRegister``, default flags); returns the registered addresses.

    Raises:
        RuntimeError: a registration failed (those made so far are released first).
    """
    cudart, done = torch.cuda.cudart(), []
    for buf in buffers:
        addr, size = buf.data_ptr(), buf.numel()
        err = int(cudart.cudaHostRegister(addr, size, 0))
        if err != 0:
            _unregister(done)
            raise RuntimeError(
                f"cudaHostRegister of a {size / 1e6:.1f} MB gradient staging buffer failed with CUDA error "
                f"{err}: check `ulimit -l` (locked memory) and free host memory"
            )
        done.append(addr)
    return done


def _unregister(addrs: list[int]) -> None:
    """Release :func:`_register`'s page-locks (``cudaHostUnregister``); empties ``addrs``."""
    while addrs:
        torch.cuda.cudart().cudaHostUnregister(addrs.pop())


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
    """``num_buffers`` host buffers of ``numel`` elements; page-locked when ``device`` is a CUDA device.

    Args:
        num_buffers: buffers (one per window slot: ``Window.offload`` keeps that many in flight).
        numel: elements of the largest block's gradients (all blocks, resident ones included).
        dtype: the compute dtype (the gradients' dtype).
        device: the compute device; CUDA: page-locked buffers and a D2H stream of its own.

    Memory: ``num_buffers × numel × dtype.itemsize`` bytes of host memory (``nbytes``), each buffer
    rounded up to whole pages; on CUDA exactly those pages are page-locked (``pinned_nbytes``) until
    :meth:`close`.

    Raises:
        RuntimeError: on CUDA, page-locking a buffer failed.
    """

    def __init__(self, num_buffers: int, numel: int, dtype: torch.dtype, device: torch.device):
        assert num_buffers >= 1, num_buffers
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        """The D2H stream (CUDA), or None."""
        self.numel, self.dtype = numel, dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self._raw = [_host_buffer(numel * itemsize) for _ in range(num_buffers)]  # [page-rounded] uint8
        self._buffers = [raw[: numel * itemsize].view(dtype) for raw in self._raw]
        self._registered = _register(self._raw) if cuda else []
        self._release = weakref.finalize(self, _unregister, self._registered)

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        """Host bytes of the buffers as requested (``num_buffers × numel × itemsize``)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def pinned_nbytes(self) -> int:
        """Host bytes page-locked for the buffers: each rounded up to whole pages on CUDA, 0 on CPU."""
        return sum(raw.numel() for raw in self._raw) if self._registered else 0

    @property
    def pinned(self) -> bool:
        """Whether every buffer is page-locked (True only on CUDA)."""
        return all(b.is_pinned() for b in self._buffers)

    def halves(self, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer ``index``'s bytes as two equal flat ``dtype`` views (a resident block's ship
        double-buffers its fp32 accumulator through them, window.py). The buffer must be free.

        Returns:
            two disjoint [H] ``dtype`` views on the host, H ≥ 1 (a buffer is at least one page).
        """
        wide = self._raw[index].view(dtype)
        half = wide.numel() // 2
        return wide[:half], wide[half : 2 * half]

    def ship(self, jobs, halves, ready, land) -> None:
        """D2H worker: copy each (target, first, device fp32 range) of ``jobs`` through ``halves``
        (:meth:`halves` of a free buffer), landing each chunk with ``land(target chunk, first, half)``.

        Chunk k goes to half ``k % 2`` on the D2H stream (CUDA: asynchronous, after the event
        ``ready`` of the accumulator's last add) and is landed while chunk k + 1's copy runs; a half
        is rewritten only after its previous chunk was landed. On CPU the copies are synchronous,
        same order."""
        stream, size = self.stream, halves[0].numel()
        if stream is not None:
            stream.wait_event(ready)  # a device-side wait: this thread does not block on compute
        chunks = [
            (d[lo : lo + size], first, s[lo : lo + size])
            for d, first, s in jobs
            for lo in range(0, s.numel(), size)
        ]
        landing = None
        for k, (dst, first, src) in enumerate(chunks):
            half = halves[k % 2][: src.numel()]
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                _copy_in(half, src)
                event = stream.record_event() if stream is not None else None
            if landing is not None:
                self._land(land, *landing)
            landing = (dst, first, half, event)
        if landing is not None:
            self._land(land, *landing)

    @staticmethod
    def _land(land, dst: torch.Tensor, first: bool, half: torch.Tensor, event) -> None:
        if event is not None:
            event.synchronize()  # the chunk's copy (CUDA)
        land(dst, first, half)

    def close(self) -> None:
        """Release the page-locks (CUDA); idempotent. The buffers must not be in use."""
        self._release()

    def issue(self, index: int, grads: list[torch.Tensor], hold: bool = True) -> Staged:
        """Copy ``grads`` into buffer ``index``, asynchronously on CUDA.

        The buffer must be free: its previous :class:`Staged` was waited for and its views consumed.

        Args:
            index: the buffer, ``0 <= index < len(self)``.
            grads: gradients (compute dtype, on the compute device; any shape), whose total numel
                fits a buffer. On CUDA they may still be being computed: the copy is ordered after
                the work queued on the current stream.
            hold: keep the sources alive until :meth:`Staged.wait`; False: keep no reference, each
                source is marked used on the D2H stream (``record_stream``), so the caching allocator
                hands its memory out again only after the copy (saved inputs, activations.py).

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
        if not hold:
            for g in grads:
                g.record_stream(self.stream)
        return Staged(views, tuple(grads) if hold else (), event)


def rows_to_device(table: torch.Tensor, index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table[index]`` ([V, D] host, [U] int64 host -> [U, D] on ``device``) without a host sync.

    On CUDA the rows are gathered into page-locked memory from torch's caching host allocator and
    copied with ``non_blocking=True`` on the current stream (the allocator keeps the block until that
    copy has run); a pageable ``.to(device)`` would block the host once per micro-batch. On CPU the
    same calls return the gathered rows."""
    cuda = device.type == "cuda"
    host = torch.empty((index.numel(), table.shape[1]), dtype=table.dtype, pin_memory=cuda)
    torch.index_select(table, 0, index, out=host)
    return host.to(device, non_blocking=True)
