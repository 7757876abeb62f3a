"""Residency: which blocks stay on the device (residency.py) and the window serving them (window.py).

Resident blocks are loaded once per sequence (step), streamed ones at every use; both must hand
out the current transfer copy. A resident block's gradients add up in a device fp32 accumulator
that reaches the host store once per step. Byte counts are checked against closed forms, the
accumulated gradients against a plain sum of the same tensors.
"""

from __future__ import annotations

import pytest
import torch

import nodetrain.engine.device.window as stream
from nodetrain.core.placement import (
    choose_resident,
    device_budget_bytes,
    ranks_on_device,
    saved_transfer_bytes,
    stage_budget,
)
from nodetrain.cost.memory import ALLOCATOR_MARGIN_BYTES, CUBLAS_MARGIN_BYTES, MARGIN_BYTES, NCCL_MARGIN_BYTES
from nodetrain.engine.device.window import Window
from nodetrain.engine.host.measure import free_device_bytes
from nodetrain.model import Binding
from nodetrain.run.inject import Faults
from nodetrain.store import HostStore, StoreLayout

UNIT_NUMELS = (32, 20, 20, 20)
BINDINGS = [
    (Binding("weight", 0, 0, (8, 4)),),
    (Binding("a", 1, 0, (4, 4)), Binding("b", 1, 16, (4,))),
    (Binding("a", 2, 0, (4, 4)), Binding("b", 2, 16, (4,))),
    (Binding("w", 3, 0, (4, 4)), Binding("n", 3, 16, (4,)), Binding("lm_head.weight", 0, 0, (8, 4))),
]
BLOCKS = [0, 1, 2, 3]
NUMEL = {0: 32, 1: 20, 2: 20, 3: 52}  # elements each block binds


def test_saved_transfer_bytes_by_hand() -> None:
    # 10 elements in bf16 (2 B), 16 loads, 8 backwards: 15 loads × 20 B saved H2D, 8 × 20 B of
    # gradients D2H replaced by one fp32 accumulator of 40 B
    assert saved_transfer_bytes(10, 2, 16, 8) == 15 * 20 + 8 * 20 - 40 == 420
    assert saved_transfer_bytes(10, 4, 2, 1) == 40  # fp32, one micro-batch: only the second load
    assert saved_transfer_bytes(10, 2, 1, 0) == 0  # forward only: nothing saved


def test_choose_resident_ranks_saved_bytes_per_device_byte() -> None:
    cost = {0: 100, 1: 40, 2: 40, 3: 30}
    saved = {0: 300, 1: 80, 2: 100, 3: 60}  # per device byte: 3.0, 2.0, 2.5, 2.0
    assert choose_resident(cost, saved, 0) == []
    assert choose_resident(cost, saved, -5) == []
    assert choose_resident(cost, saved, 99) == [1, 2]  # 0 does not fit; 2 (2.5), then 1 (tie with 3: lower)
    assert choose_resident(cost, saved, 75) == [2, 3]  # 2, then 1 does not fit in 35, 3 does
    assert choose_resident(cost, saved, 110) == [0]  # 0 first; 10 bytes left for nothing
    assert choose_resident(cost, saved, 210) == [0, 1, 2, 3]
    assert choose_resident(cost, saved, 45) == [2]
    assert choose_resident(cost, saved, 45, first=(3,)) == [3]  # the head goes first; 15 left
    assert choose_resident(cost, saved, 99, first=(3,)) == [2, 3]  # 3, then 2 (29 left: not 1)


def test_budget_uses_the_planners_activation_model(monkeypatch, caplog) -> None:
    """The automatic budget (``core.run_shape.resolve``, read by the engine and the planner alike) is
    usable − window − activations − margin, the window and activations ``cost.memory.stage_memory``'s
    with every block streamed, stage by stage what ``python -m nodetrain.plan`` prints for the same
    config (config A of test_plan.py, on a GPU profile); its log line names each part."""
    from cost_cases import memory
    from test_plan import _config_a

    from nodetrain.plan.planner import make_plan

    cfg = _config_a()

    def streamed(plan, st):
        return memory(
            plan.shape,
            st.blocks,
            st.stage,
            plan.num_stages,
            m=plan.batch.microbatches,
            g=plan.batch.grad_accum,
            schedule=cfg.pipeline.schedule,
            b=plan.batch.micro_batch_size,
            t=cfg.train.seq_len,
            slots=cfg.stream.slots,
            itemsize=2,
            offload_activations=cfg.stream.offload_activations,
        )

    for offload in (False, True):
        cfg.stream.offload_activations = offload  # two micro-batches' saved inputs on the device (issue 23)
        plan = make_plan(cfg)
        for st, usable, budget in zip(
            plan.stages, plan.run.machine.device_bytes, plan.run.budgets, strict=True
        ):
            free = streamed(plan, st)
            assert free.activation_bytes == st.activation_bytes > 0, st
            assert budget == usable - free.window_bytes - free.activation_bytes - MARGIN_BYTES > 0
            line = f"stream.device_budget=auto on stage {st.stage}: {usable / 1e9:.2f} GB usable"
            assert any(x.startswith(line) and x.endswith(f"= {budget / 1e9:.2f} GB") for x in plan.run.lines)
        if not offload:
            cfg.pipeline.schedule, cfg.pipeline.microbatches = "gpipe", 6  # 6 in flight without the offload
            without = make_plan(cfg).stages[0].activation_bytes
    assert plan.stages[0].activation_bytes < without
    # the margin is named by part: NCCL's buffers 1 GiB, cuBLAS's workspaces 128 MiB, the allocator
    assert MARGIN_BYTES == NCCL_MARGIN_BYTES + CUBLAS_MARGIN_BYTES + ALLOCATOR_MARGIN_BYTES == 2 << 30
    from nodetrain.plan.report import _budget_line

    assert (
        "2.15 GB margin (NCCL buffers 1.07 + cuBLAS workspaces 0.13 + allocator 0.94" in _budget_line(plan)[0]
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with caplog.at_level("INFO", logger="nodetrain.engine.host.measure"):
        assert free_device_bytes(torch.device("cuda", 0)) == 10 * 2**30
    assert "10.74 GB free / 1 rank(s) on cuda:0" in caplog.text
    assert free_device_bytes(torch.device("cpu")) == 0
    assert stage_budget("auto", 0, free) == 0  # the CPU: every block streams


def test_ranks_sharing_a_gpu_split_its_free_memory(monkeypatch, caplog) -> None:
    """train.py gives local rank r the GPU r mod count, so with dist.backend=gloo several ranks may
    share one (gpu_check's two stages on one GPU): each takes its share of the free memory, not all."""
    assert ranks_on_device(0, 2, 1) == 2  # gpu_check: 2 ranks, 1 GPU
    assert ranks_on_device(0, 3, 2) == 2 and ranks_on_device(1, 3, 2) == 1  # ranks 0, 2 | 1
    assert ranks_on_device(3, 8, 8) == 1  # one GPU per rank
    assert ranks_on_device(0, 1, 0) == 1
    gib = 2**30
    assert device_budget_bytes(40 * gib, gib, 2 * gib, ranks=2) == 20 * gib - 3 * gib - MARGIN_BYTES
    assert device_budget_bytes(40 * gib, gib, 2 * gib) == 40 * gib - 3 * gib - MARGIN_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level("INFO", logger="nodetrain.engine.host.measure"):
        assert free_device_bytes(torch.device("cuda", 0)) == 20 * gib
    assert "/ 2 rank(s) on cuda:0" in caplog.text


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
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", faults=Faults(copy_delay_s=0.003), resident=resident)
    gen = torch.Generator().manual_seed(len(resident))
    try:
        streamed = [b for b in BLOCKS if b not in resident]
        assert window.resident == resident
        assert window.resident_nbytes == (4 + 4) * sum(NUMEL[b] for b in resident)  # + fp32 accumulators
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
    window = Window(store, BINDINGS, BLOCKS, 1, "cpu", faults=Faults(copy_delay_s=0.05), resident=[1])
    monkeypatch.setattr(stream, "wait_copy", lambda fut: None)
    try:
        assert _run(window, store, [1, 0]) != []
    finally:
        window.close()


def _run_step(window: Window, store: HostStore, num_mb: int, gen, counted: bool) -> list[dict]:
    """One step of ``num_mb`` micro-batches (forward then backward each) with random gradients;
    returns the offloads in order. ``counted``: the window is told each block's backwards."""
    sequence = [0, 1, 2, 3, 3, 2, 1, 0] * num_mb
    window.begin(sequence, {b: num_mb for b in BLOCKS} if counted else None)
    offloads = []
    for k, block in enumerate(sequence):
        window.acquire(block)
        window.release()
        if k % 8 >= 4:  # the backward half of a micro-batch
            grads = {b.local_name: torch.randn(b.shape, generator=gen) for b in BINDINGS[block]}
            window.offload(block, grads)
            offloads.append((block, grads))
    window.flush()
    return offloads


def _plain_sums(offloads) -> dict[int, torch.Tensor]:
    """The reference: every gradient added into its unit's range in offload order (fp32)."""
    out = {u: torch.zeros(n) for u, n in enumerate(UNIT_NUMELS)}
    for block, grads in offloads:
        for b in BINDINGS[block]:
            out[b.unit][b.offset : b.offset + b.numel] += grads[b.local_name].flatten()
    return out


# accumulation host bytes by hand (fp32, 2 micro-batches): all streamed, every target gets a first
# write (8 B/elem) then adds (12 B/elem): unit 0's 32 elements 4 offloads, units 1-3's 20 two each;
# all resident: one ship of each accumulator through fp32 staging (read 4 + write 4 B/elem), unit 0's
# second (the embedding's) an add (12)
ACCUM_BYTES = {
    (): 8 * 32 + 3 * 12 * 32 + 3 * (8 * 20 + 12 * 20),
    (0, 1, 2, 3): 8 * (32 + 20 + 20 + 20) + 12 * 32,
}


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "mutant-every-backward"])
@pytest.mark.parametrize("resident", [(), (1, 3), (0, 1, 2, 3)], ids=str)
def test_resident_gradients_leave_the_device_once_per_step(store, resident, counted) -> None:
    """D2H bytes per step = 4 B × a resident block's elements + 4 B × a streamed block's elements
    per backward (fp32), for 2 and 4 micro-batches; the store's accumulators equal a plain sum of
    the offloaded gradients (bit for bit where one block binds the range: same order, same dtype).
    The mutant (the window not told the backwards: resident gradients offloaded at every backward,
    as before) breaks the count whenever a block is resident."""
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", faults=Faults(copy_delay_s=0.001), resident=resident)
    gen = torch.Generator().manual_seed(7)
    try:
        for num_mb in (2, 4):
            offloads = _run_step(window, store, num_mb, gen, counted)
            stats = window.take_stats()
            want = sum(4 * NUMEL[b] * (1 if b in resident else num_mb) for b in BLOCKS)
            assert (stats["d2h_bytes"] == want) == (counted or not resident), (stats, want)
            if counted and num_mb == 2 and resident in ACCUM_BYTES:
                assert stats["accum_host_bytes"] == ACCUM_BYTES[resident]
            ref = _plain_sums(offloads)
            for u in (1, 2, 3):  # one block binds each: the device sums in the host's order
                assert torch.equal(store.grad(u), ref[u]), u
            torch.testing.assert_close(store.grad(0), ref[0], rtol=1e-6, atol=1e-6)  # tied: order differs
    finally:
        window.close()


@pytest.mark.parametrize("resident", [(), (3,), (0, 1, 2, 3)], ids=str)
def test_planner_counts_the_windows_resident_bytes(store, resident) -> None:
    """``costs.stage_memory`` (the planner and the automatic budget) holds what the Window allocates:
    the slots sized by the largest streamed block but a streamed embedding (gathered by rows, as the
    engine streams it), and each resident block's weights plus its fp32 gradient accumulator, 8
    B/element in fp32."""
    from cost_cases import memory

    from nodetrain.cost.shape import ModelShape

    shape = ModelShape(
        unit_numels=UNIT_NUMELS,
        load_numels=tuple(NUMEL[b] for b in BLOCKS),
        largest_tensors=(32, 16, 16, 32),
        costs=(0, 20, 20, 52),
        tied=True,
        hidden=4,
        intermediate=8,
        vocab=8,
        heads=1,
        kv_heads=1,
        head_dim=4,
        qk_norm=False,
    )
    mem = memory(shape, range(4), 0, 1, m=2, g=1, resident=resident, b=1, t=2, slots=2, itemsize=4)
    rows = [] if 0 in resident else [0]  # the engine's rule: a streamed embedding travels as rows
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", resident=resident, rows=rows)
    try:
        assert mem.resident_bytes == window.resident_nbytes == 8 * sum(NUMEL[b] for b in resident)
        assert mem.window_bytes == window.nbytes - window.resident_nbytes
        assert mem.total_bytes == mem.window_bytes + mem.resident_bytes + mem.activation_bytes
    finally:
        window.close()
