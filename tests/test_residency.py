"""Residency: which blocks stay on the device (residency.py) and the window serving them (stream.py).

Resident blocks are loaded once per sequence (step), streamed ones at every use; both must hand
out the current transfer copy. Byte counts are checked against closed forms.
"""

from __future__ import annotations

import pytest
import torch

import nodetrain.stream as stream
from nodetrain.model import Binding
from nodetrain.residency import MARGIN_BYTES, auto_device_budget, choose_resident, stage_activation_bytes
from nodetrain.store import HostStore, StoreLayout
from nodetrain.stream import Window

UNIT_NUMELS = (32, 20, 20, 20)
BINDINGS = [
    (Binding("weight", 0, 0, (8, 4)),),
    (Binding("a", 1, 0, (4, 4)), Binding("b", 1, 16, (4,))),
    (Binding("a", 2, 0, (4, 4)), Binding("b", 2, 16, (4,))),
    (Binding("w", 3, 0, (4, 4)), Binding("n", 3, 16, (4,)), Binding("lm_head.weight", 0, 0, (8, 4))),
]
BLOCKS = [0, 1, 2, 3]
NUMEL = {0: 32, 1: 20, 2: 20, 3: 52}  # elements each block binds


def test_choose_resident_is_first_fit_in_block_order() -> None:
    sizes = {0: 100, 1: 40, 2: 40, 3: 30}
    assert choose_resident(sizes, 0) == []
    assert choose_resident(sizes, -5) == []
    assert choose_resident(sizes, 99) == [1, 2]  # 0 does not fit; 1 and 2 do; 3 no longer does
    assert choose_resident(sizes, 110) == [0]  # first fit: 0, not the 110 bytes of 1, 2 and 3
    assert choose_resident(sizes, 140) == [0, 1]  # 100 + 40 leave nothing for 2 or 3
    assert choose_resident(sizes, 210) == [0, 1, 2, 3]


def test_budget_uses_the_planners_activation_model(monkeypatch, caplog) -> None:
    """The automatic budget's activations are ``costs.stage_memory``'s, stage by stage equal to what
    ``python -m nodetrain.plan`` prints for the same config (config A of test_plan.py, on a GPU
    profile); the budget is free − window − activations − margin, with the margin logged."""
    from test_plan import _config_a

    from nodetrain.model import HFModel, build_hf_config
    from nodetrain.plan import make_plan

    cfg = _config_a()
    plan, model = make_plan(cfg), HFModel(build_hf_config(cfg.model))
    cuda = torch.device("cuda", 0)
    for st in plan.stages:
        acts = stage_activation_bytes(cfg, model, st.blocks, st.stage, 2, 1, cuda)
        assert acts == st.activation_bytes > 0, st
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    with caplog.at_level("INFO", logger="nodetrain.residency"):
        assert auto_device_budget(cuda, 3 << 30, 1 << 30) == (10 - 3 - 1) * 2**30 - MARGIN_BYTES
    assert "margin" in caplog.text and "2.15 GB margin" in caplog.text
    assert auto_device_budget(torch.device("cpu"), 0, 0) == 0


@pytest.fixture
def store(shm_dir):
    s = HostStore.create(StoreLayout(UNIT_NUMELS, torch.float32, tied_units=(0,)), shm_dir, "residency-test")
    s.unlink()
    return s


def _run(window: Window, store: HostStore, sequence: list[int]) -> list[tuple[int, str]]:
    stale = []
    window.begin(sequence)
    for k, block in enumerate(sequence):
        got = window.acquire(block)
        for b in BINDINGS[block]:
            want = store.compute(b.unit)[b.offset : b.offset + b.numel].view(b.shape)
            if not torch.equal(got[b.local_name], want):
                stale.append((k, b.local_name))
        window.release()
    window.flush()
    return stale


@pytest.mark.parametrize("resident", [[], [1], [0, 3], [0, 1, 2, 3]], ids=str)
def test_resident_blocks_load_once_per_sequence_and_stay_current(store, resident) -> None:
    sequence = [0, 1, 2, 3, 3, 2, 1, 0] * 2  # two micro-batches, forward then backward
    window = Window(store, BINDINGS, BLOCKS, BLOCKS, 2, "cpu", delay_s=0.003, resident=resident)
    gen = torch.Generator().manual_seed(len(resident))
    try:
        streamed = [b for b in BLOCKS if b not in resident]
        assert window.resident == resident
        assert window.resident_nbytes == 4 * sum(NUMEL[b] for b in resident)
        assert window.nbytes == window.resident_nbytes + 2 * 4 * max((NUMEL[b] for b in streamed), default=0)
        assert window.staging_nbytes == 2 * 4 * max(NUMEL[b] for b in BLOCKS)  # resident blocks offload too
        for _ in range(2):  # steps: the transfer copies change in between
            for u, n in enumerate(UNIT_NUMELS):
                store.compute(u).copy_(torch.randn(n, generator=gen))
            assert _run(window, store, sequence) == []
            # a streamed block used twice in a row loads once: F→B turns reuse block 3, the B→F turn block 0
            reused = [b for b in (3, 0, 3) if b not in resident]
            loads = sum(NUMEL[b] for b in sequence if b not in resident) + sum(NUMEL[b] for b in resident)
            loads -= sum(NUMEL[b] for b in reused)
            assert window.take_stats()["h2d_bytes"] == 4 * loads
    finally:
        window.close()


def test_a_resident_load_is_waited_for(store, monkeypatch) -> None:
    """The check above can fail for a resident block: without the wait its slow load is not there."""
    store.compute(1).fill_(7.0)
    window = Window(store, BINDINGS, BLOCKS, BLOCKS, 1, "cpu", delay_s=0.05, resident=[1])
    monkeypatch.setattr(stream, "_wait", lambda fut: None)
    try:
        assert _run(window, store, [1, 0]) != []
    finally:
        window.close()
