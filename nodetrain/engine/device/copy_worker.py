"""A copy direction of the window: one worker thread (in-order), plus a CUDA stream of its own.

Owns: the H2D and D2H worker threads' set-up (role, CUDA device, OpenMP team), running each job
after its gate and, with a stream, after the compute queued before it was submitted, and the busy
seconds of the copies. Does not own what a job copies (window.py, staging.py, accumulate.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nodetrain.engine.host.binding import limit_thread
from nodetrain.engine.threads import Tally, set_role
from nodetrain.run.inject import NO_FAULTS, Faults

__all__ = ["CopyWorker", "done_copy", "wait_copy"]


class CopyWorker:
    """One copy direction: a single thread (in-order), plus a CUDA stream when ``stream`` is given.

    A job first waits for its gate (host futures), then, with a stream, for the compute queued
    before it was submitted, and runs to completion before the next (``take_busy_s`` counts only the
    copy). Without a stream a job runs as it is (the D2H jobs wait for their own copy's event).
    On a CUDA ``device`` the thread first selects it: a thread's current device starts as GPU 0,
    and a CUDA call there (an event wait, a stream context) would create a context on GPU 0 in
    every rank's process. An index-less ``"cuda"`` means the constructing thread's current device
    and is resolved here (``torch.cuda.set_device`` refuses a device without an index). With
    ``threads`` the thread first sets its OpenMP team to that many (``host_threads.limit_thread``:
    the D2H worker's accumulation adds run on a team of their own). The thread's set-up is its
    first job and the constructor waits for it, so a set-up that fails raises here, not at the
    first copy.

    Args:
        name: ``h2d`` or ``d2h``, the thread's role (threads.py) and name.
        stream: the CUDA stream its copies run on, or None.
        device: the rank's device; threads: OpenMP team (0 = torch's).
        faults: test-only injection (``Faults.before_copy``, before each job's copy;
            ``Faults.skip_compute_wait`` drops the slot-reuse wait, a planted bug).

    Raises:
        Whatever the thread's set-up raised (e.g. ``ValueError`` from ``torch.cuda.set_device``),
        after the thread has ended.
    """

    def __init__(
        self,
        name: str,
        stream: torch.cuda.Stream | None,
        device=None,
        threads: int = 0,
        faults: Faults = NO_FAULTS,
    ):
        self.device = _resolve(device)
        cuda = self.device if self.device is not None and self.device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, name)
        try:
            self._pool.submit(_init_worker, name, cuda, threads).result()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise
        self._stream = stream
        self._faults = faults
        self._busy = Tally("busy_s")

    def submit(self, fn, gate: list[Future] = ()) -> Future:
        ready = None
        if self._stream is not None:  # the copy may start only after compute queued so far
            ready = torch.cuda.current_stream().record_event()
        return self._pool.submit(self._run, fn, ready, gate)

    def _run(self, fn, ready, gate):
        for fut in gate:
            fut.result()
        self._faults.before_copy()
        if self._stream is None:
            t0 = time.perf_counter()
            fn()
            self._busy.add("busy_s", time.perf_counter() - t0)
            return None
        if not self._faults.skip_compute_wait:  # the slot-reuse wait: kernels still reading the slot
            ready.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            fn()
            done = self._stream.record_event()
        done.synchronize()  # measured to completion; the consumer's wait is then free
        self._busy.add("busy_s", time.perf_counter() - t0)
        return done

    def call(self, fn):
        """Run ``fn()`` on the worker thread after the jobs queued so far; returns its result."""
        return self._pool.submit(fn).result()

    def take_busy_s(self) -> float:
        """Seconds spent copying since the last take."""
        return self._busy.take()["busy_s"]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _resolve(device) -> torch.device | None:
    """``device`` as a ``torch.device``; an index-less CUDA device becomes ``cuda:<current device>``."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _init_worker(name: str, device: torch.device | None, threads: int) -> None:
    """A copy worker's set-up: its role, the rank's CUDA device (if any), then its OpenMP team."""
    set_role(name)
    if device is not None:
        torch.cuda.set_device(device)
    if threads:
        limit_thread(threads)


def wait_copy(fut: Future) -> None:
    """Wait for a copy job on the calling thread; on CUDA, order the current stream after its copy."""
    done = fut.result()  # re-raises a worker's exception here
    if done is not None:
        torch.cuda.current_stream().wait_event(done)


def done_copy() -> Future:
    """A copy job that is already done (a load with nothing to copy): :func:`wait_copy` returns at once."""
    fut = Future()
    fut.set_result(None)
    return fut
