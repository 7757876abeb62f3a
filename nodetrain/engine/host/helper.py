"""The optimizer thread lent to the D2H worker's host adds while it has nothing else to do.

Owns: the count of the optimizer pool's tasks submitted and not finished (every task of that pool is
submitted through :meth:`Helper.submit`), the offer of a help (:meth:`Helper.offer`: a task that runs
:meth:`~nodetrain.engine.host.accumulate.SharedAdd.run_back` of one add, submitted only when that
count is 0) and the optimizer thread's own fp32 widening scratch. Does not own: the pool and what its
other tasks do (overlap.py), the chunks and the arithmetic (accumulate.py) or which adds are offered
(window.py's D2H worker, through its ``HostAccumulator``).

Threads: the count is written under its lock by every thread that submits (the training thread, the
D2H worker) and by the optimizer thread as each task ends; the scratch is the optimizer thread's only.
A help yields between chunks once another task is queued behind it, so the optimizer's own work
(an arrival, an update a load waits for) waits at most for one chunk.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from nodetrain.engine.host.accumulate import Scratch, SharedAdd

__all__ = ["Helper"]


class Helper:
    """Counts the optimizer pool's work and lends the thread to an add when the count is 0.

    Args:
        pool: the optimizer thread's single-thread pool (overlap.py's ``UnitUpdates``).

    Memory: the scratch grows to the D2H worker's chunk (``accum_threads × CHUNK_PER_THREAD × 4``
    bytes of host memory) at the first help.
    """

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool = pool
        self._lock = threading.Lock()
        self._queued = 0  # tasks submitted and not finished (under the lock)
        self._closed = False
        self._scratch = Scratch()  # the optimizer thread's only

    def submit(self, fn, *args) -> Future:
        """Any thread: submit ``fn(*args)`` to the optimizer thread, counted until it ends."""
        with self._lock:
            self._queued += 1
            return self._pool.submit(self._counted, fn, *args)

    def offer(self, job: SharedAdd) -> bool:
        """D2H worker: lend the optimizer thread to ``job`` (it takes chunks from the back) if nothing
        is submitted there and not finished; returns whether the help was submitted. A help that runs
        after ``job`` is done returns at once."""
        with self._lock:
            if self._queued or self._closed:
                return False
            self._queued += 1
            self._pool.submit(self._counted, job.run_back, self._scratch, self._alone)
        return True

    def _alone(self) -> bool:
        """Whether the running help is the only task of the pool (else it yields between chunks)."""
        with self._lock:
            return self._queued == 1

    def _counted(self, fn, *args):
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._queued -= 1

    def close(self) -> None:
        """No more offers (before the pool shuts down)."""
        with self._lock:
            self._closed = True
