"""GPU checks and their CPU twins: the CUDA paths of the window, the timeline and the engine.

Each test body runs on two devices. ``cpu`` always runs: the CPU path runs the same control flow
(the copy workers are real threads, slowed with ``delay_s`` or a slowed copy where CUDA uses GPU
sleeps), so a wrong expectation shows without a GPU. ``cuda`` is marked ``gpu`` and skipped without
CUDA; ``bench/gpu_check.sh`` runs it on a lent GPU machine (``pytest -m gpu``). An assertion with no
CPU meaning (side streams, page-locked memory) is guarded by the device. What is checked:
- parity with transformers + AdamW on CUDA in fp32 (one stage, the machine may have one GPU),
  with units streaming and, in the second case, resident and the optimizer slowed down (the same
  cases run on CPU in tests/parity/test_parity.py), against a reference on the same device whose weight
  tolerance is measured from two correct references there (CUDA's summation order is not the CPU's);
- the window's copies run on their own CUDA streams and hand out the current transfer copy
  (slowed copy workers: a missing wait hands out stale slots, and its companion shows that it does);
- gradients leave through page-locked staging buffers and are accumulated only after their copy
  landed (the D2H stream and the compute stream slowed with GPU sleeps: a missing event wait would
  accumulate stale staging contents, and the companion test shows that it does);
- a slot is reloaded only after the compute reading it finished, with no host sync before
  ``release()`` (a GPU sleep delays the reads; the companion test removes the wait and sees it fail);
- saved block inputs go to host buffers (page-locked, D2H after the compute making them) and come
  back exact through the H2D worker (a missing prefetch wait reads unfilled memory, its companion);
- the timeline attributes a host-side wait to its phase and the phases sum to the step;
- the measured matmul peak is a plausible figure for the device.
The companions that remove the slot-reuse and D2H event waits run on CUDA only: on CPU, compute has
finished when ``release()`` returns and a staging copy has landed when ``issue()`` returns, so
neither wait exists there and removing it cannot fail.
"""

from __future__ import annotations

import time

import pytest
import torch

import nodetrain.engine.device.activations as activations
import nodetrain.engine.device.staging as staging
import nodetrain.engine.device.window as stream
from nodetrain.engine.device.activations import SavedOffload
from nodetrain.engine.device.copy_worker import CopyWorker
from nodetrain.engine.device.window import Window
from nodetrain.model import Binding
from nodetrain.run.breakdown import Timeline, measured_peak_flops
from nodetrain.run.inject import NO_FAULTS, Faults
from nodetrain.store import HostStore, StoreLayout

_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu-marked)"),
    ],
)
DEVICES = ["cpu", _CUDA]
"""Every body runs on the CPU; its CUDA case is gpu-marked and skipped without CUDA."""
CUDA_ONLY = [_CUDA]

GPU_CASES = [
    "llama-1stage-gpipe-slots1-accum2x4",
    "llama-1stage-tied-gpipe-slots2-accum2x4-noclip-resident-optdelay",
]

SLEEP_CYCLES = 20_000_000
"""A GPU sleep of ~10 ms (at ~2 GHz): far longer than the host needs to accumulate a staging buffer."""
COPY_DELAY_S = 0.01
"""The CPU's slowed copy: seconds slept before each staging copy (where CUDA sleeps on the D2H stream)."""


def _gpu_sleep(device: str) -> None:
    """CUDA: queue a ~10 ms sleep on the current stream, so the work queued after it runs late.
    CPU: nothing; CPU compute is synchronous, there is no queue to delay."""
    if device == "cuda":
        torch.cuda._sleep(SLEEP_CYCLES)


@pytest.mark.parametrize("case_id", GPU_CASES)
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_parity_on_cuda_fp32(case_id: str, device: str, tmp_path, shm_dir, torchrun) -> None:
    from test_parity import CASES, check_parity

    (case,) = [c for c in CASES if c.id == case_id]
    check_parity(case, tmp_path, shm_dir, torchrun, device=device)


@pytest.mark.parametrize("case_id", GPU_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_two_correct_references_agree(case_id: str, device: str, tmp_path) -> None:
    """The CUDA parity's weight tolerance is measured from two correct references on its device (one
    forward over the step's batch, one per micro-batch); on either device small enough to test
    against. (On CPU the gap depends on the machine's kernels: 4e-7 where ``ATOL_WEIGHT`` was set,
    1.05e-6 on another 2-core machine, which ``check_run`` then measures instead of the floor.)"""
    from test_parity import (
        ATOL_WEIGHT,
        CASES,
        MAX_MEASURED_ATOL,
        make_batches,
        measured_weight_atol,
        run_reference,
        save_seeded_model,
    )

    (case,) = [c for c in CASES if c.id == case_id]
    save_seeded_model(case, tmp_path / "hf")
    inputs, labels, lengths = make_batches(case)
    ref = run_reference(case, tmp_path / "hf", inputs, labels, lengths, device=device)
    atol = measured_weight_atol(case, ref, tmp_path / "hf", inputs, labels, lengths, device)
    assert ATOL_WEIGHT <= atol <= MAX_MEASURED_ATOL


def test_gpu_parity_cases_run_on_cpu_in_test_parity() -> None:
    """The CPU body of the parity check is tests/parity/test_parity.py's own run of each case (the same
    ``check_parity``): the CUDA cases must name cases it runs."""
    from test_parity import CASES

    assert set(GPU_CASES) <= {c.id for c in CASES}


def _stream_two_steps(
    shm_dir, device: str, delay_s: float = 0.01
) -> tuple[list[tuple[int, int]], list[list[torch.Tensor]], dict]:
    """Stream blocks ``0, 1, 2, 2, 1, 0`` through 2 slots for two steps (copy workers slowed by
    ``delay_s``), the transfer copies filled with ``10 · step + block`` before each, offloading a
    gradient of ones (computed from the slot, so on CUDA its D2H must wait for that compute) at
    every use. Each acquired slot is compared right away, before the compute on it.

    Returns:
        (step, block) of every acquire that did not see the current transfer copy; per step, the
        three accumulators after ``flush()`` (fp32 [4096] each); the window's stats of both steps.
    """
    cuda = device == "cuda"
    numels = (4096, 4096, 4096)
    bindings = [(Binding("w", i, 0, (64, 64)),) for i in range(3)]
    store = HostStore.create(StoreLayout(numels, torch.bfloat16), shm_dir, "gpu-window")
    store.unlink()
    if cuda:
        store.pin([0, 1, 2])
    window = Window(store, bindings, [0, 1, 2], 2, torch.device(device), faults=Faults(copy_delay_s=delay_s))
    stale, grads = [], []
    try:
        if cuda:  # CUDA only: the copies' own streams, page-locked memory both ways (CPU has neither)
            compute = torch.cuda.current_stream()
            assert window.h2d._stream is not None and window.h2d._stream != compute
            assert window._staging.stream is not None and window._staging.stream != compute
            assert window._staging.pinned and all(store.is_pinned(u) for u in range(3))
        sequence = [0, 1, 2, 2, 1, 0]
        for step in range(2):
            for u in range(3):
                store.compute(u).fill_(float(step * 10 + u))
            window.begin(sequence)
            for block in sequence:
                w = window.acquire(block)["w"]
                if not torch.all(w == step * 10 + block).item():
                    stale.append((step, block))
                busy = w @ w  # queued on the compute stream; the slot's next load must wait for it
                window.offload(block, {"w": busy[:64, :64] * 0 + 1})
                window.release()
            window.flush()
            grads.append([store.grad(u).clone() for u in range(3)])
        stats = window.take_stats()
    finally:
        window.close()
        store.unpin()
    assert not any(store.is_pinned(u) for u in range(3))
    return stale, grads, stats


@pytest.mark.parametrize("device", DEVICES)
def test_window_copies_on_side_streams_and_stay_current(shm_dir, device: str) -> None:
    stale, grads, stats = _stream_two_steps(shm_dir, device)
    assert stale == []
    # Each block is offloaded twice a step (its forward and backward use). The first offload of a
    # step overwrites the accumulator (window.py), so every step leaves 1 + 1, whatever the step
    # before left: 2, not 2 · (step + 1).
    for step, accumulators in enumerate(grads):
        for u, g in enumerate(accumulators):
            assert torch.equal(g, torch.full_like(g, 2.0)), (step, u, g.unique())
    # two steps of 5 loads: the backward's first use of block 2 reuses the forward's load
    assert stats["h2d_busy_s"] > 0 and stats["h2d_bytes"] == 2 * 5 * 4096 * 2


@pytest.mark.parametrize("device", DEVICES)
def test_a_missing_load_wait_would_be_caught(shm_dir, device: str, monkeypatch) -> None:
    """The check above can fail, on either device: without ``acquire``'s wait for its load, the
    slowed copy worker has not written the slot yet when compute reads it."""
    monkeypatch.setattr(stream, "wait_copy", lambda fut: None)
    stale, _, _ = _stream_two_steps(shm_dir, device, delay_s=0.05)
    assert stale != []


def _read_slots_late(
    shm_dir, device: str, faults: Faults = NO_FAULTS
) -> tuple[list[torch.Tensor], list[float]]:
    """Stream blocks 0, 1, 2 twice through ONE slot; on CUDA each use reads its slot only after a
    GPU sleep on the compute stream, and the host never synchronises before ``release()`` (which
    issues the next load into that same slot). On CPU the read is done before ``release()``.
    Returns the sums read (tensors on the device) and the expected ones."""
    cuda = device == "cuda"
    numel = 1 << 20
    store = HostStore.create(StoreLayout((numel,) * 3, torch.float32), shm_dir, "gpu-reuse")
    store.unlink()
    if cuda:
        store.pin([0, 1, 2])
    for u in range(3):
        store.compute(u).fill_(float(u + 1))
    bindings = [(Binding("w", u, 0, (numel,)),) for u in range(3)]
    window = Window(store, bindings, [0, 1, 2], 1, torch.device(device), faults=faults)
    sequence, sums = [0, 1, 2, 0, 1, 2], []
    try:
        window.begin(sequence)
        for block in sequence:
            w = window.acquire(block)["w"]
            _gpu_sleep(device)  # CUDA: the read below runs ~10 ms after the host moved on
            sums.append(w.sum())
            window.release()  # no .item(), no synchronize: the next load must wait for the read itself
        window.flush()
        if cuda:
            torch.cuda.synchronize()
    finally:
        window.close()
        store.unpin()
    return sums, [float((b + 1) * numel) for b in sequence]


@pytest.mark.parametrize("device", DEVICES)
def test_slot_is_reloaded_only_after_its_reads(shm_dir, device: str) -> None:
    sums, expected = _read_slots_late(shm_dir, device)
    assert [float(s) for s in sums] == expected


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_a_missing_slot_reuse_wait_would_be_caught(shm_dir, device: str) -> None:
    """The check above can fail: without the copy worker's wait for the compute queued before
    ``release()``, the next block's copy lands in the slot while the late read is still queued."""
    sums, expected = _read_slots_late(shm_dir, device, Faults(skip_compute_wait=True))
    assert [float(s) for s in sums] != expected


OFFLOADS = 6


def _offload_slowly(shm_dir, monkeypatch, device: str) -> torch.Tensor:
    """Offload gradients ``1, 2, …, OFFLOADS`` of one 1M-element block through a 2-slot window.

    On CUDA each gradient is written on the compute stream after a GPU sleep, and each D2H copy
    waits for another sleep on the D2H stream; on CPU each (synchronous) staging copy is slowed
    instead. The D2H worker is slowed on the host, so the staging buffers rotate with offloads still
    in flight. Returns the host accumulator ``[2**20]`` fp32 (expected: ``OFFLOADS · (OFFLOADS + 1)
    / 2`` everywhere, exact in fp32 and bf16: the first offload overwrites the -1 left before).
    """
    copy_in = staging._copy_in

    def slow_copy_in(dst, src):
        if device == "cuda":
            _gpu_sleep(device)  # on the D2H stream: the copy lands late
        else:
            time.sleep(COPY_DELAY_S)
        copy_in(dst, src)

    monkeypatch.setattr(staging, "_copy_in", slow_copy_in)
    store = HostStore.create(StoreLayout((1 << 20,), torch.bfloat16), shm_dir, "gpu-d2h")
    store.unlink()
    window = Window(
        store,
        [(Binding("w", 0, 0, (1024, 1024)),)],
        [0],
        2,
        torch.device(device),
        faults=Faults(copy_delay_s=0.002),
    )
    try:
        store.grad(0).fill_(-1.0)  # the previous step's leftovers: the first offload overwrites them
        window.begin([])
        for i in range(OFFLOADS):
            _gpu_sleep(device)  # CUDA: the gradient below is written late on the compute stream
            grad = torch.full((1024, 1024), float(i + 1), device=device, dtype=torch.bfloat16)
            window.offload(0, {"w": grad})
            del grad  # its memory may be reused only after its copy: the window keeps it alive
        window.flush()
        assert window.take_stats()["d2h_bytes"] == OFFLOADS * 2 * (1 << 20)
        return store.grad(0).clone()
    finally:
        window.close()


@pytest.mark.parametrize("device", DEVICES)
def test_offload_accumulates_only_landed_copies(shm_dir, monkeypatch, device: str) -> None:
    got = _offload_slowly(shm_dir, monkeypatch, device)
    assert torch.equal(got, torch.full_like(got, OFFLOADS * (OFFLOADS + 1) / 2))


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_a_missing_d2h_wait_would_be_caught(shm_dir, monkeypatch, device: str) -> None:
    """The check above can fail: accumulating without waiting for the copy's event reads the
    staging buffer before the slowed copy has landed."""
    monkeypatch.setattr(staging.Staged, "wait", lambda self: self._views)
    got = _offload_slowly(shm_dir, monkeypatch, device)
    assert not torch.equal(got, torch.full_like(got, OFFLOADS * (OFFLOADS + 1) / 2))


def _saved_round_trip(device: str, delay_s: float = COPY_DELAY_S) -> list[bool]:
    """Three micro-batches of two saved inputs ([2, 8, 32] bf16 of value 10·mb + k, made by compute
    queued behind a GPU sleep on CUDA, so the D2H must wait for it and the freed input's memory
    must not be handed out before its copy ran) through ``SavedOffload`` (activations.py): put, done,
    then taken in order with the H2D worker slowed by ``delay_s``. Returns, per taken tensor,
    whether it holds what was put (read right after ``take``)."""
    cuda, ok = device == "cuda", []
    h2d = CopyWorker(
        "h2d", torch.cuda.Stream() if cuda else None, device, faults=Faults(copy_delay_s=delay_s)
    )
    saved = SavedOffload(6, 2 * 8 * 32, torch.bfloat16, device, [0, 1, 2], h2d)
    try:
        if cuda:  # page-locked host buffers, copies on side streams
            assert saved._staging.pinned and saved._staging.stream != torch.cuda.current_stream()
        for mb in range(3):
            for k in range(2):
                _gpu_sleep(device)
                saved.put(mb, torch.zeros(2, 8, 32, dtype=torch.bfloat16, device=device) + (10 * mb + k))
            saved.done(mb)
        for mb in range(3):
            ok += [bool(torch.all(t == 10 * mb + k).item()) for k, t in enumerate(saved.take(mb))]
    finally:
        h2d.shutdown()
        saved.close()
    return ok


@pytest.mark.parametrize("device", DEVICES)
def test_saved_inputs_come_back_exact(device: str) -> None:
    assert _saved_round_trip(device) == [True] * 6


@pytest.mark.parametrize("device", DEVICES)
def test_a_missing_prefetch_wait_would_be_caught(device: str, monkeypatch) -> None:
    """The check above can fail: without ``take``'s wait for the prefetch, the slowed H2D worker
    has not filled the device tensors when they are read."""
    monkeypatch.setattr(activations, "wait_copy", lambda fut: None)
    assert _saved_round_trip(device, delay_s=0.05) != [True] * 6


@pytest.mark.parametrize("device", DEVICES)
def test_gathered_rows_are_current_and_do_not_sync_the_host(shm_dir, device: str) -> None:
    """A streamed embedding's rows reach the device without blocking the host once per micro-batch:
    on CUDA, ``set_sync_debug_mode("error")`` raises on a synchronizing (pageable, blocking) copy."""
    vocab, dim = 64, 32
    store = HostStore.create(StoreLayout((vocab * dim,), torch.bfloat16), shm_dir, f"rows-{device}")
    store.unlink()
    window = Window(store, [(Binding("weight", 0, 0, (vocab, dim)),)], [0], 1, torch.device(device), rows=[0])
    try:
        table = torch.arange(vocab * dim, dtype=torch.float32).view(vocab, dim).to(torch.bfloat16)
        store.compute(0).copy_(table.flatten())
        window.begin([])
        index = torch.tensor([3, 5, 60])
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            rows = window.gather_rows(0, index)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        assert rows.device.type == device and torch.equal(rows.cpu(), table[index])
        window.flush()
    finally:
        window.close()


@pytest.mark.parametrize("device", DEVICES)
def test_timeline_attributes_a_host_wait(device: str) -> None:
    cuda = device == "cuda"
    n = 2048 if cuda else 256  # CPU: a few ms of matmuls, not seconds
    tl = Timeline(device)
    a = torch.randn(n, n, device=device)
    t0 = time.perf_counter()
    tl.start()
    for _ in range(10):
        a = a @ a / n
    with tl.phase("stall"):
        if cuda:
            torch.cuda.synchronize()
        time.sleep(0.05)  # the device is idle: the stall is what the host made it wait
    out = tl.stop()
    wall = time.perf_counter() - t0
    assert out["stall_s"] >= 0.045 and out["compute_s"] > 0
    assert sum(out.values()) == pytest.approx(wall, rel=0.1)


PEAK_RANGE = {"cpu": (1e8, 1e13), "cuda": (1e13, 1e16)}
"""Plausible dense bf16 matmul FLOP/s: one CPU thread (0.1 GFLOP/s to a 10 TFLOP/s AMX socket); a
datacenter GPU (10 TFLOP/s to 10 PFLOP/s)."""


@pytest.mark.parametrize("device", DEVICES)
def test_measured_peak_is_a_plausible_figure(device: str) -> None:
    low, high = PEAK_RANGE[device]
    peak = measured_peak_flops(device, torch.bfloat16, 1)
    assert low < peak < high, peak
