"""GPU checks (``pytest -m gpu``): the CUDA paths of the window, the timeline and the engine.

Skipped without CUDA. ``bench/gpu_check.sh`` runs them on a lent GPU machine:
- parity with transformers + AdamW on CUDA in fp32 (one stage, the machine may have one GPU),
  with units streaming and, in the second case, resident and the optimizer slowed down;
- the window's copies run on their own CUDA streams and hand out the current transfer copy
  (slowed copy workers: a missing event wait would hand out stale slots);
- gradients leave through page-locked staging buffers and are accumulated only after their copy
  landed (the D2H stream and the compute stream slowed with GPU sleeps: a missing event wait would
  accumulate stale staging contents, and the companion test shows that it does);
- a slot is reloaded only after the compute reading it finished, with no host sync before
  ``release()`` (a GPU sleep delays the reads; the companion test removes the wait and sees it fail);
- the CUDA timeline attributes a host-side wait to its phase and the phases sum to the step;
- the measured matmul peak is a plausible GPU figure.
"""

from __future__ import annotations

import time

import pytest
import torch

import nodetrain.engine.staging as staging
import nodetrain.engine.window as stream
from nodetrain.engine.window import Window
from nodetrain.model import Binding
from nodetrain.run.breakdown import Timeline, measured_peak_flops
from nodetrain.store import HostStore, StoreLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu-marked test)"),
]

GPU_CASES = [
    "llama-1stage-gpipe-slots1-accum2x4",
    "llama-1stage-tied-gpipe-slots2-accum2x4-noclip-resident-optdelay",
]


@pytest.mark.parametrize("case_id", GPU_CASES)
def test_parity_on_cuda_fp32(case_id: str, tmp_path, shm_dir, torchrun) -> None:
    from test_parity import CASES, check_parity

    (case,) = [c for c in CASES if c.id == case_id]
    check_parity(case, tmp_path, shm_dir, torchrun, device="cuda")


def test_window_copies_on_side_streams_and_stay_current(shm_dir) -> None:
    numels = (4096, 4096, 4096)
    bindings = [(Binding("w", i, 0, (64, 64)),) for i in range(3)]
    store = HostStore.create(StoreLayout(numels, torch.bfloat16), shm_dir, "gpu-window")
    store.unlink()
    store.pin([0, 1, 2])
    window = Window(store, bindings, [0, 1, 2], [0, 1, 2], 2, torch.device("cuda"), delay_s=0.01)
    try:
        compute = torch.cuda.current_stream()
        assert window._h2d._stream is not None and window._h2d._stream != compute
        assert window._staging.stream is not None and window._staging.stream != compute
        assert window._staging.pinned and store.compute(0).is_pinned()  # both directions page-locked
        sequence = [0, 1, 2, 2, 1, 0]
        for step in range(2):
            for u in range(3):
                store.compute(u).fill_(float(step * 10 + u))
            window.begin(sequence)
            for block in sequence:
                w = window.acquire(block)["w"]
                busy = w @ w  # queued on the compute stream; the slot's next load must wait for it
                assert torch.all(w == step * 10 + block).item(), (step, block)
                window.offload(block, {"w": busy[:64, :64] * 0 + 1})
                window.release()
            window.flush()
            for u in range(3):  # each block offloaded twice (forward and backward use)
                assert torch.all(store.grad(u) == 2 * (step + 1)).item()
        stats = window.take_stats()
        # two steps of 5 loads: the backward's first use of block 2 reuses the forward's load
        assert stats["h2d_busy_s"] > 0 and stats["h2d_bytes"] == 2 * 5 * 4096 * 2
    finally:
        window.close()
        store.unpin()
    assert not store.compute(0).is_pinned()


def _read_slots_late(shm_dir) -> tuple[list[torch.Tensor], list[float]]:
    """Stream blocks 0, 1, 2 twice through ONE slot; each use reads its slot only after a GPU sleep
    on the compute stream, and the host never synchronises before ``release()`` (which issues the
    next load into that same slot). Returns the sums read (device tensors) and the expected ones."""
    numel = 1 << 20
    store = HostStore.create(StoreLayout((numel,) * 3, torch.float32), shm_dir, "gpu-reuse")
    store.unlink()
    store.pin([0, 1, 2])
    for u in range(3):
        store.compute(u).fill_(float(u + 1))
    bindings = [(Binding("w", u, 0, (numel,)),) for u in range(3)]
    window = Window(store, bindings, [0, 1, 2], [0, 1, 2], 1, torch.device("cuda"))
    sequence, sums = [0, 1, 2, 0, 1, 2], []
    try:
        window.begin(sequence)
        for block in sequence:
            w = window.acquire(block)["w"]
            torch.cuda._sleep(SLEEP_CYCLES)  # the read below runs ~10 ms after the host moved on
            sums.append(w.sum())
            window.release()  # no .item(), no synchronize: the next load must wait for the read itself
        window.flush()
        torch.cuda.synchronize()
    finally:
        window.close()
        store.unpin()
    return sums, [float((b + 1) * numel) for b in sequence]


def test_slot_is_reloaded_only_after_its_reads(shm_dir) -> None:
    sums, expected = _read_slots_late(shm_dir)
    assert [float(s) for s in sums] == expected


def test_a_missing_slot_reuse_wait_would_be_caught(shm_dir, monkeypatch) -> None:
    """The check above can fail: without the copy worker's wait for the compute queued before
    ``release()``, the next block's copy lands in the slot while the late read is still queued."""
    monkeypatch.setattr(stream, "_wait_for_compute", lambda ready: None)
    sums, expected = _read_slots_late(shm_dir)
    assert [float(s) for s in sums] != expected


SLEEP_CYCLES = 20_000_000
"""A GPU sleep of ~10 ms (at ~2 GHz): far longer than the host needs to accumulate a staging buffer."""
OFFLOADS = 6


def _offload_slowly(shm_dir, monkeypatch) -> torch.Tensor:
    """Offload gradients ``1, 2, …, OFFLOADS`` of one 1M-element block through a 2-slot window.

    Each gradient is written on the compute stream after a GPU sleep, and each D2H copy waits for
    another sleep on the D2H stream, while the D2H worker is slowed on the host: the staging buffers
    rotate with copies still in flight. Returns the host accumulator ``[2**20]`` fp32 (expected:
    ``OFFLOADS · (OFFLOADS + 1) / 2`` everywhere, exact in fp32 and bf16).
    """
    copy_in = staging._copy_in

    def slow_copy_in(dst, src):
        torch.cuda._sleep(SLEEP_CYCLES)  # on the D2H stream: the copy lands late
        copy_in(dst, src)

    monkeypatch.setattr(staging, "_copy_in", slow_copy_in)
    store = HostStore.create(StoreLayout((1 << 20,), torch.bfloat16), shm_dir, "gpu-d2h")
    store.unlink()
    window = Window(store, [(Binding("w", 0, 0, (1024, 1024)),)], [0], [0], 2, torch.device("cuda"), 0.002)
    try:
        store.grad(0).fill_(-1.0)  # the previous step's leftovers: the first offload overwrites them
        window.begin([])
        for i in range(OFFLOADS):
            torch.cuda._sleep(SLEEP_CYCLES)  # the gradient below is written late on the compute stream
            grad = torch.full((1024, 1024), float(i + 1), device="cuda", dtype=torch.bfloat16)
            window.offload(0, {"w": grad})
            del grad  # its memory may be reused only after its copy: the window keeps it alive
        window.flush()
        assert window.take_stats()["d2h_bytes"] == OFFLOADS * 2 * (1 << 20)
        return store.grad(0).clone()
    finally:
        window.close()


def test_offload_accumulates_only_landed_copies(shm_dir, monkeypatch) -> None:
    got = _offload_slowly(shm_dir, monkeypatch)
    assert torch.equal(got, torch.full_like(got, OFFLOADS * (OFFLOADS + 1) / 2))


def test_a_missing_d2h_wait_would_be_caught(shm_dir, monkeypatch) -> None:
    """The check above can fail: accumulating without waiting for the copy's event reads the
    staging buffer before the slowed copy has landed."""
    monkeypatch.setattr(staging.Staged, "wait", lambda self: self._views)
    got = _offload_slowly(shm_dir, monkeypatch)
    assert not torch.equal(got, torch.full_like(got, OFFLOADS * (OFFLOADS + 1) / 2))


def test_cuda_timeline_attributes_a_host_wait() -> None:
    tl = Timeline("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    t0 = time.perf_counter()
    tl.start()
    for _ in range(10):
        a = a @ a / 2048
    with tl.phase("stall"):
        torch.cuda.synchronize()
        time.sleep(0.05)  # the stream is idle: the stall is what the host made it wait
    out = tl.stop()
    wall = time.perf_counter() - t0
    assert out["stall_s"] >= 0.045 and out["compute_s"] > 0
    assert sum(out.values()) == pytest.approx(wall, rel=0.1)


def test_measured_peak_is_a_gpu_figure() -> None:
    peak = measured_peak_flops("cuda", torch.bfloat16, 1)
    assert 1e13 < peak < 1e16, peak
