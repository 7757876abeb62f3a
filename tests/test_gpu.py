"""GPU checks (``pytest -m gpu``): the CUDA paths of the window, the timeline and the engine.

Skipped without CUDA. ``bench/gpu_check.sh`` runs them on a lent GPU machine:
- parity with transformers + AdamW on CUDA in fp32 (one stage, the machine may have one GPU),
  with units streaming and, in the second case, resident and the optimizer slowed down;
- the window's copies run on their own CUDA streams and hand out the current transfer copy
  (slowed copy workers: a missing event wait would hand out stale slots);
- the CUDA timeline attributes a host-side wait to its phase and the phases sum to the step;
- the measured matmul peak is a plausible GPU figure.
"""

from __future__ import annotations

import time

import pytest
import torch

from nodetrain.breakdown import Timeline, measured_peak_flops
from nodetrain.model import Binding
from nodetrain.store import HostStore, StoreLayout
from nodetrain.stream import Window

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
    window = Window(store, bindings, [0, 1, 2], [0, 1, 2], 2, torch.device("cuda"), delay_s=0.01)
    try:
        compute = torch.cuda.current_stream()
        assert window._h2d._stream is not None and window._h2d._stream != compute
        assert window._d2h._stream is not None and window._d2h._stream != compute
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
        assert stats["h2d_busy_s"] > 0 and stats["h2d_bytes"] == 2 * 6 * 4096 * 2
    finally:
        window.close()


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
