"""One host add shared between the D2H worker and the idle optimizer thread (accumulate.py's
``SharedAdd``, helper.py's ``Helper``), on real threads.

- Whatever the helper does (takes chunks from the start, starts late, never starts, arrives after the
  add is done), the result is plain torch's ``dst + src.float()`` (``index_add_`` for unique rows)
  bit for bit (``torch.equal``), for bf16 and fp32 sources.
- The owner never waits for a help that has not started: with a helper that never runs, the add
  still completes on the owner alone.
- The optimizer thread is lent only when idle: an offer is taken (and chunks helped) while its pool
  has nothing queued, refused while it runs a task, and a help yields once work is queued behind it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nodetrain.engine.host.accumulate import HostAccumulator, Scratch, SharedAdd
from nodetrain.engine.host.helper import Helper

WAIT_S = 30.0  # a bound on every wait, so a bug fails the test instead of hanging it
N, V, D, U = 20_011, 300, 17, 211  # ragged: the last chunk is short


def _operands(kind: str, dtype: torch.dtype, gen: torch.Generator):
    """(dst, args, the plain-torch reference) of an add, a copy or a scatter-add of unique rows."""
    if kind == "index_add":
        dst = torch.randn(V, D, generator=gen)
        index = torch.randperm(V, generator=gen)[:U]  # unique rows
        src = torch.randn(U, D, generator=gen).to(dtype)
        return dst, (index, src), dst.clone().index_add_(0, index, src.float())
    dst, src = torch.randn(N, generator=gen), torch.randn(N, generator=gen).to(dtype)
    return dst, (src,), (dst + src.float()) if kind == "add" else src.float()


def _chunks(acc: HostAccumulator, kind: str, dst, args):
    return {"add": acc.add_chunks, "copy": acc.copy_chunks, "index_add": acc.index_add_chunks}[kind](
        dst, *args
    )


def _gated(chunks, k: int, before=None, after=None):
    """``chunks`` with chunk ``k`` calling ``before()`` first and ``after()`` once it landed."""
    run, nbytes = chunks[k]

    def gated(scratch):
        if before is not None:
            before()
        run(scratch)
        if after is not None:
            after()

    return [*chunks[:k], (gated, nbytes), *chunks[k + 1 :]]


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.0005)


def _owner_first(chunks, owner_before):
    """``chunks`` with the owner's first chunk (0) calling ``owner_before()`` and the helper's first (the
    last chunk) waiting until the owner is in chunk 0: a helper the pool starts before the owner runs
    cannot take every chunk (chunk 0 included) while the owner is not yet scheduled."""
    started = threading.Event()

    def owner():
        started.set()
        owner_before()

    gated = _gated(chunks, 0, before=owner)
    return _gated(gated, len(chunks) - 1, before=lambda: _wait(started.is_set, "the owner's first chunk"))


KINDS = ["add", "copy", "index_add"]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_a_late_helper_gives_plain_torchs_sums(kind: str, dtype: torch.dtype) -> None:
    """The helper starts only after the owner landed 3 chunks; the owner's 5th waits until the helper
    landed one (so both really share the add); the result is plain torch's bit for bit."""
    gen = torch.Generator().manual_seed(1)
    dst, args, want = _operands(kind, dtype, gen)
    acc = HostAccumulator(chunk_per_thread=7)
    chunks = _chunks(acc, kind, dst, args)
    assert len(chunks) > 20, len(chunks)
    owner_ran_3 = threading.Event()
    job: SharedAdd

    chunks = _gated(chunks, 2, after=owner_ran_3.set)
    chunks = _gated(chunks, 4, before=lambda: _wait(lambda: job.helped_chunks > 0, "a helped chunk"))
    job = SharedAdd(chunks)

    def late_helper():
        assert owner_ran_3.wait(WAIT_S)
        job.run_back(Scratch())

    helper = threading.Thread(target=late_helper)
    helper.start()
    job.run_front(Scratch())
    helper.join(WAIT_S)
    assert 0 < job.helped_chunks < len(chunks), (job.helped_chunks, len(chunks))
    assert torch.equal(dst, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_a_helper_that_never_starts_does_not_hold_up_the_add(kind: str, dtype: torch.dtype) -> None:
    """The help is offered (taken) but never runs until the owner is done: the owner lands every
    chunk alone, and the stale help then finds no chunk and returns at once."""
    gen = torch.Generator().manual_seed(2)
    dst, args, want = _operands(kind, dtype, gen)
    offered: list[SharedAdd] = []

    class NeverHelps:
        def offer(self, job: SharedAdd) -> bool:
            offered.append(job)
            return True

    acc = HostAccumulator(chunk_per_thread=5, helper=NeverHelps())
    getattr(acc, kind)(dst, *args)
    assert torch.equal(dst, want)
    (job,) = offered
    job.run_back(Scratch())  # stale: every chunk landed
    assert (job.helped_chunks, job.helped_bytes) == (0, 0)
    assert acc.helped.take() == {"bytes": 0, "chunks": 0}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_the_idle_optimizer_thread_helps_bit_for_bit(kind: str, dtype: torch.dtype) -> None:
    """Through ``Helper`` on a real single-thread pool (the optimizer's): the owner's first chunk waits
    until the helper landed one, so it surely helped (and the helper's first waits for the owner's, so
    the owner surely lands one); the counts are the helped chunks' and the result is plain torch's bit
    for bit."""
    gen = torch.Generator().manual_seed(3)
    dst, args, want = _operands(kind, dtype, gen)
    pool = ThreadPoolExecutor(1)
    helper = Helper(pool)
    try:
        acc = HostAccumulator(chunk_per_thread=3)
        chunks = _chunks(acc, kind, dst, args)
        job: SharedAdd
        job = SharedAdd(_owner_first(chunks, lambda: _wait(lambda: job.helped_chunks > 0, "a help")))
        assert helper.offer(job)
        job.run_front(Scratch())
        assert 0 < job.helped_chunks < len(chunks)
        sizes = [nbytes for _, nbytes in chunks]
        assert job.helped_bytes == sum(sizes[len(chunks) - job.helped_chunks :])  # from the back
        assert torch.equal(dst, want)
    finally:
        helper.close()
        pool.shutdown(wait=True)


def test_no_help_while_the_optimizer_thread_is_busy() -> None:
    """While an update runs (a task submitted through the helper), an offer is refused and the add runs
    on the owner alone (0 helped bytes); once the pool is idle again, the next add's offer is taken."""
    gen = torch.Generator().manual_seed(4)
    pool = ThreadPoolExecutor(1)
    helper = Helper(pool)
    release = threading.Event()
    try:
        busy = helper.submit(release.wait, WAIT_S)
        acc = HostAccumulator(chunk_per_thread=3, helper=helper)
        dst, (src,), want = _operands("add", torch.bfloat16, gen)
        acc.add(dst, src)
        assert torch.equal(dst, want)
        assert acc.helped.take() == {"bytes": 0, "chunks": 0}
        assert not helper.offer(SharedAdd(acc.add_chunks(dst, src)))
        release.set()
        busy.result(WAIT_S)
        _wait(lambda: helper.offer(SharedAdd([])), "an idle pool")  # counted until its task ended
    finally:
        release.set()
        helper.close()
        pool.shutdown(wait=True)
    assert not helper.offer(SharedAdd([])), "closed: no more offers"


def test_a_help_yields_to_work_queued_behind_it() -> None:
    """A help that runs while the owner is held stops taking chunks once an update is submitted
    behind it; the owner then lands the rest, and the sums are still exact."""
    gen = torch.Generator().manual_seed(5)
    dst, (src,), want = _operands("add", torch.float32, gen)
    pool = ThreadPoolExecutor(1)
    helper = Helper(pool)
    try:
        acc = HostAccumulator(chunk_per_thread=3)
        chunks = acc.add_chunks(dst, src)
        job: SharedAdd
        queued = threading.Event()

        def hold_owner():  # the owner's first chunk: until the helper has helped, then queue an update
            _wait(lambda: job.helped_chunks > 0, "a help")
            helper.submit(queued.set)
            assert queued.wait(WAIT_S)  # the one-thread pool ran it: the help had stopped before

        job = SharedAdd(_owner_first(chunks, hold_owner))
        assert helper.offer(job)
        job.run_front(Scratch())
        assert 0 < job.helped_chunks < len(chunks) - 1, (job.helped_chunks, len(chunks))
        assert torch.equal(dst, want)
    finally:
        helper.close()
        pool.shutdown(wait=True)


def test_a_helped_chunks_error_reaches_the_owner() -> None:
    """A chunk that fails on the helper fails the add on the owner (after the rest landed), not silently."""
    dst, src = torch.zeros(100), torch.ones(100)
    acc = HostAccumulator(chunk_per_thread=1)
    chunks = acc.add_chunks(dst, src)

    def boom(scratch):
        raise RuntimeError("helped chunk failed")

    job = SharedAdd([*chunks[:-1], (boom, 0)])
    job.run_back(Scratch())  # the helper takes the last chunk first: it fails and stops
    with pytest.raises(RuntimeError, match="helped chunk failed"):
        job.run_front(Scratch())
    landed = sum(nbytes for _, nbytes in chunks[:-1]) // 12  # elements of the owner's chunks (fp32 add)
    assert torch.equal(dst[:landed], torch.ones(landed)) and torch.equal(
        dst[landed:], torch.zeros(100 - landed)
    )


def test_the_owner_waits_for_the_helpers_chunk_in_flight() -> None:
    """The helper claims the last chunk and is held in it: the owner lands every other chunk but must
    not return (the add is not complete) until the helper's chunk has landed."""
    gen = torch.Generator().manual_seed(6)
    dst, (src,), want = _operands("add", torch.bfloat16, gen)
    acc = HostAccumulator(chunk_per_thread=50)
    hold, claimed = threading.Event(), threading.Event()
    chunks = acc.add_chunks(dst, src)
    job = SharedAdd(_gated(chunks, len(chunks) - 1, before=lambda: (claimed.set(), hold.wait(WAIT_S))))
    helper = threading.Thread(target=job.run_back, args=(Scratch(),))
    helper.start()
    assert claimed.wait(WAIT_S)
    owner = threading.Thread(target=job.run_front, args=(Scratch(),))
    owner.start()
    owner.join(0.3)  # far longer than the owner's chunks take
    assert owner.is_alive(), "the add completed while the helper's chunk was in flight"
    hold.set()
    owner.join(WAIT_S)
    helper.join(WAIT_S)
    assert job.helped_chunks == 1 and torch.equal(dst, want)
