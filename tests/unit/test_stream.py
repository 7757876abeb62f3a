"""The streaming window on CPU, single process, over a real small host store.

The copy workers are slowed down (``delay_s``) so that a protocol mistake shows: ``acquire``
must always return exactly the host transfer copy of the requested block (a missing wait would
hand out the slot's previous contents), ``offload`` must accumulate into the owner's ``grad``
(or a non-owned tied unit's ``grad_tied``), and ``flush`` must wait for every queued offload.
"""

from __future__ import annotations

import time

import pytest
import torch

import nodetrain.engine.device.window as stream
from nodetrain.core.schedule import build_schedule
from nodetrain.engine.device.copy_worker import CopyWorker
from nodetrain.engine.device.window import Window
from nodetrain.model import Binding
from nodetrain.run.inject import Faults
from nodetrain.store import HostStore, StoreLayout

# Three units: 0 = an "embedding" [8, 4] (tied: owned elsewhere), 1 and 2 = "layers" with a matrix and a
# vector. Block 2 also binds unit 0's weight, as the tied head does.
UNIT_NUMELS = (32, 20, 20)
BINDINGS = [
    (Binding("weight", 0, 0, (8, 4)),),
    (Binding("a", 1, 0, (4, 4)), Binding("b", 1, 16, (4,))),
    (Binding("w", 2, 0, (4, 4)), Binding("n", 2, 16, (4,)), Binding("lm_head.weight", 0, 0, (8, 4))),
]
BLOCKS = [1, 2]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture
def make_store(shm_dir):
    def make(dtype: torch.dtype) -> HostStore:
        store = HostStore.create(StoreLayout(UNIT_NUMELS, dtype, tied_units=(0,)), shm_dir, "stream-test")
        store.unlink()  # the mapping stays; the name must not outlive the test
        return store

    return make


def _fill_compute(store: HostStore, gen: torch.Generator) -> None:
    """New transfer copies, as after an optimizer step."""
    for u in range(len(UNIT_NUMELS)):
        store.compute(u).copy_(torch.randn(UNIT_NUMELS[u], generator=gen))


def _expected(store: HostStore, block: int) -> dict[str, torch.Tensor]:
    return {
        b.local_name: store.compute(b.unit)[b.offset : b.offset + b.numel].view(b.shape).clone()
        for b in BINDINGS[block]
    }


def _stale_acquires(window: Window, store: HostStore, sequence: list[int]) -> list[tuple[int, str]]:
    """Run ``sequence`` through the window; (load index, parameter) of every value that differs
    from the host transfer copy at the time of acquire."""
    stale = []
    window.begin(sequence)
    for k, block in enumerate(sequence):
        got = window.acquire(block)
        want = _expected(store, block)
        assert set(got) == set(want)
        stale += [(k, name) for name in want if not torch.equal(got[name], want[name])]
        for name, t in got.items():
            assert t.shape == want[name].shape and t.dtype == store.layout.compute_dtype, name
        window.release()
    window.flush()
    return stale


# forward then backward order of a stage's blocks, for three micro-batches
SEQUENCE = [1, 2, 2, 1] * 3


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_acquire_returns_the_current_transfer_copy(make_store, slots: int, dtype: torch.dtype) -> None:
    store, gen = make_store(dtype), torch.Generator().manual_seed(slots)
    window = Window(store, BINDINGS, BLOCKS, slots, "cpu", faults=Faults(copy_delay_s=0.005))
    try:
        largest = max(sum(b.numel for b in BINDINGS[i]) for i in BLOCKS)
        assert window.nbytes == slots * largest * dtype.itemsize
        assert window.staging_nbytes == slots * largest * dtype.itemsize  # one host buffer per slot
        assert not window._staging.pinned  # page-locked only for a CUDA device
        for _ in range(3):  # steps: the transfer copies change between them
            _fill_compute(store, gen)
            assert _stale_acquires(window, store, SEQUENCE) == []
    finally:
        window.close()


def test_a_missing_wait_would_be_caught(make_store, monkeypatch) -> None:
    """The check above can fail: without the wait in ``acquire`` the slow copies are not there yet."""
    store = make_store(torch.float32)
    _fill_compute(store, torch.Generator().manual_seed(0))
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", faults=Faults(copy_delay_s=0.05))
    monkeypatch.setattr(stream, "wait_copy", lambda fut: None)
    try:
        assert _stale_acquires(window, store, [1, 2, 2, 1]) != []
    finally:
        window.close()


def test_acquire_refuses_a_block_out_of_order(make_store) -> None:
    store = make_store(torch.float32)
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu")
    try:
        window.begin([1, 2])
        with pytest.raises(AssertionError, match="load order"):
            window.acquire(2)
    finally:
        window.close()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_offload_accumulates_into_grad_and_grad_tied(make_store, dtype: torch.dtype) -> None:
    store = make_store(dtype)
    gen = torch.Generator().manual_seed(1)
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", faults=Faults(copy_delay_s=0.005))

    def grads(block: int) -> dict[str, torch.Tensor]:
        return {b.local_name: torch.randn(b.shape, generator=gen).to(dtype) for b in BINDINGS[block]}

    try:
        g1, g1b, g2 = grads(1), grads(1), grads(2)
        for block, g in ((1, g1), (2, g2), (1, g1b)):
            window.offload(block, g)
        window.flush()
        flat = lambda g, names: torch.cat([g[n].float().reshape(-1) for n in names])  # noqa: E731
        want1 = flat(g1, ["a", "b"]) + flat(g1b, ["a", "b"])
        torch.testing.assert_close(store.grad(1), want1, rtol=0, atol=0)
        torch.testing.assert_close(store.grad(2), flat(g2, ["w", "n"]), rtol=0, atol=0)
        # unit 0 is not owned here: its use in block 2 goes to grad_tied, its own grad stays zero
        torch.testing.assert_close(store.buffer(0, "grad_tied"), flat(g2, ["lm_head.weight"]), rtol=0, atol=0)
        assert not store.grad(0).any()
    finally:
        window.close()


def test_offload_into_an_owned_tied_unit_uses_grad(make_store) -> None:
    """On a single stage the tied embedding is owned: the head's use accumulates into ``grad``."""
    store = make_store(torch.float32)
    window = Window(store, BINDINGS, [0, 2], 2, "cpu")
    try:
        g0 = {"weight": torch.ones(8, 4)}
        g2 = {"w": torch.zeros(4, 4), "n": torch.zeros(4), "lm_head.weight": torch.full((8, 4), 2.0)}
        window.offload(0, g0)
        window.offload(2, g2)
        window.flush()
        assert torch.equal(store.grad(0), torch.full((32,), 3.0))
        assert not store.buffer(0, "grad_tied").any()
    finally:
        window.close()


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_offload_bounds_in_flight_and_flush_waits_for_all(make_store, slots: int) -> None:
    """Also the staging rotation: offload ``i`` is staged in buffer ``i % slots`` while the slow D2H
    worker still holds earlier ones; a buffer rewritten before its accumulation loses a mark."""
    store, calls = make_store(torch.float32), 5
    window = Window(store, BINDINGS, BLOCKS, slots, "cpu", faults=Faults(copy_delay_s=0.1))
    try:
        for i in range(calls):
            g = {"a": torch.zeros(4, 4), "b": torch.zeros(4)}
            g["a"].view(-1)[i] = 1.0  # call i marks element i
            window.offload(1, g)
            completed = int(store.grad(1)[:calls].sum())
            assert completed >= i + 1 - slots, f"more than {slots} offloads in flight after call {i}"
        assert int(store.grad(1)[:calls].sum()) < calls, "the last offload finished before its delay"
        window.flush()
        assert torch.equal(store.grad(1)[:calls], torch.ones(calls))
    finally:
        window.close()


def test_first_offload_of_a_sequence_overwrites_the_accumulator(make_store) -> None:
    """The optimizer does not zero gradients: the first offload into an accumulator after ``begin``
    overwrites whatever the previous step left, later ones add (exactly: fp32 += widened grad)."""
    store = make_store(torch.bfloat16)
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", faults=Faults(copy_delay_s=0.002))
    gen = torch.Generator().manual_seed(7)

    def grads() -> dict[str, torch.Tensor]:
        return {
            "a": torch.randn(4, 4, generator=gen).bfloat16(),
            "b": torch.randn(4, generator=gen).bfloat16(),
        }

    def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g["a"].float().reshape(-1), g["b"].float()])

    try:
        store.grad(1).fill_(123.0)  # what the previous step left
        window.begin([])
        g1, g2 = grads(), grads()
        window.offload(1, g1)
        window.offload(1, g2)
        window.flush()
        assert torch.equal(store.grad(1), flat(g1) + flat(g2))
        window.begin([])  # the next step
        g3 = grads()
        window.offload(1, g3)
        window.flush()
        assert torch.equal(store.grad(1), flat(g3))
    finally:
        window.close()


def test_copy_workers_select_the_rank_device_on_their_thread(monkeypatch) -> None:
    """A CUDA copy worker calls ``torch.cuda.set_device(<rank device>)`` on its own thread before any
    job (recorded: no CUDA here); a CPU one does not touch CUDA."""
    import threading

    calls = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d))
    )
    for name in ("h2d", "d2h"):
        worker = CopyWorker(name, None, torch.device("cuda", 3))
        assert worker.submit(threading.current_thread).result() is None
        worker.shutdown()
    assert [(n.split("_")[0], d) for n, d in calls] == [
        ("h2d", torch.device("cuda", 3)),
        ("d2h", torch.device("cuda", 3)),
    ]
    cpu = CopyWorker("h2d", None, torch.device("cpu"))
    cpu.submit(lambda: None).result()
    cpu.shutdown()
    assert len(calls) == 2


def _strict_set_device(calls: list):
    """A stand-in for ``torch.cuda.set_device`` that, like torch's, refuses a device without an index."""
    import threading

    def set_device(device) -> None:
        device = torch.device(device)
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index, but got:{device}")
        calls.append((threading.current_thread().name.split("_")[0], device))

    return set_device


def test_an_index_less_cuda_device_is_resolved_to_the_current_one(monkeypatch) -> None:
    """``"cuda"`` (as the GPU tests and bench/copy_bandwidth.py pass it) becomes ``cuda:<current>`` when
    the worker is built; the thread then selects that (the H200 run died on ``set_device("cuda")``)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", _strict_set_device(calls))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    worker = CopyWorker("h2d", None, "cuda")
    try:
        assert worker.device == torch.device("cuda", 2)
        worker.submit(lambda: None).result()
    finally:
        worker.shutdown()
    assert calls == [("h2d", torch.device("cuda", 2))]


def test_a_failed_thread_set_up_fails_the_constructor(monkeypatch) -> None:
    """The set-up's own error is raised by ``CopyWorker(...)``, not at the first copy as a
    ``BrokenThreadPool``, and the thread is gone."""
    import threading

    def refuse(device) -> None:
        raise RuntimeError("no such device")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    with pytest.raises(RuntimeError, match="no such device"):
        CopyWorker("d2h", None, torch.device("cuda", 0))
    assert not [t for t in threading.enumerate() if t.name.startswith("d2h")]


# ----------------------------------------------------------------------------- reuse of consecutive loads


def _stage_sequence(kind: str, num_stages: int, stage: int, m: int) -> list[int]:
    """The engine's load order of a stage owning BLOCKS: each forward in order, each backward reversed."""
    actions = build_schedule(kind, num_stages, stage, m)
    return [b for a in actions for b in (BLOCKS if a.kind == "F" else BLOCKS[::-1])]


def _loaded_numel(kind: str, num_stages: int, stage: int, m: int) -> int:
    """Closed form of the elements loaded: every use of both blocks, less one load of the last block
    per F→B turn and of the first block per B→F turn. 1F1B with w = min(S - s - 1, M) warm-up
    forwards has max(M - w, 1) F→B turns and max(M - w - 1, 0) B→F turns; GPipe one F→B turn."""
    first, last = (sum(b.numel for b in BINDINGS[i]) for i in BLOCKS)
    w = min(num_stages - stage - 1, m)
    f_to_b, b_to_f = (max(m - w, 1), max(m - w - 1, 0)) if kind == "1f1b" else (1, 0)
    return 2 * m * (first + last) - f_to_b * last - b_to_f * first


def _held_slots_stay_current(window: Window, store: HostStore, sequence: list[int], compute_s: float) -> list:
    """Like ``_stale_acquires``, but compares each use's weights only after ``compute_s`` of "compute"
    (longer than a copy): a load written into a slot that a later position still reuses shows."""
    stale = []
    window.begin(sequence)
    for k, block in enumerate(sequence):
        got = window.acquire(block)
        time.sleep(compute_s)
        want = _expected(store, block)
        stale += [(k, name) for name in want if not torch.equal(got[name], want[name])]
        window.release()
    window.flush()
    return stale


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize(
    ("kind", "num_stages", "stage"), [("1f1b", 1, 0), ("1f1b", 2, 0), ("1f1b", 2, 1), ("gpipe", 2, 0)]
)
def test_consecutive_uses_of_a_block_share_one_load(make_store, kind, num_stages, stage, slots) -> None:
    """H2D bytes per sequence equal the closed form from the schedule, and every use, reused or not,
    still sees the current transfer copy (a freed-too-early slot would be overwritten under it)."""
    store, gen = make_store(torch.bfloat16), torch.Generator().manual_seed(stage)
    window = Window(store, BINDINGS, BLOCKS, slots, "cpu", faults=Faults(copy_delay_s=0.002))
    try:
        for m in (1, 3, 4):
            _fill_compute(store, gen)
            sequence = _stage_sequence(kind, num_stages, stage, m)
            assert _held_slots_stay_current(window, store, sequence, compute_s=0.006) == [], m
            want = 2 * _loaded_numel(kind, num_stages, stage, m)
            assert window.take_stats()["h2d_bytes"] == want, (m, sequence)
    finally:
        window.close()


def test_one_stage_1f1b_loads_closed_form_figures() -> None:
    """The closed form itself, by hand: 1 stage, M = 2: loads 1,2,(2),1,(1),2,(2),1 → 3 × 20 + 2 × 52."""
    assert _stage_sequence("1f1b", 1, 0, 2) == [1, 2, 2, 1, 1, 2, 2, 1]
    assert _loaded_numel("1f1b", 1, 0, 2) == 3 * 20 + 2 * 52
    # 2 stages, stage 0, M = 4: F0 F1 B0 F2 B1 F3 B2 B3 → 3 F→B and 2 B→F turns of 16 uses
    assert _loaded_numel("1f1b", 2, 0, 4) == 8 * 72 - 3 * 52 - 2 * 20


def test_a_reused_load_is_not_gated_again(make_store) -> None:
    """The gate is asked once per actual load (a later non-consecutive use is gated again)."""
    store = make_store(torch.float32)
    asked: list[int] = []
    window = Window(store, BINDINGS, BLOCKS, 1, "cpu", gate=lambda block: asked.append(block) or [])
    try:
        assert _stale_acquires(window, store, [1, 2, 2, 1, 1, 2]) == []
        assert asked == [1, 2, 1, 2]
    finally:
        window.close()
