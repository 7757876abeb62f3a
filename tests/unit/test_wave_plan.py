"""Waves (``pipeline.wave``) in the pure core and the window: the schedule over items, the loads,
offloads and arrival counts of a step, the peaks and memory they imply, and the window's one fp32
ship per item (CPU, a real host store), each against a closed form written here."""

from __future__ import annotations

import math

import pytest
import torch
from test_step_time import HEAD, LAYER, SHAPE, _cpu_config
from test_stream import BINDINGS, make_store  # noqa: F401  (a fixture)

from nodetrain.checkpoint.state import config_hash
from nodetrain.config.checks import ConfigError, validate
from nodetrain.config.schema import Config
from nodetrain.core.batch import _candidates
from nodetrain.core.placement import saved_transfer_bytes
from nodetrain.core.recompute import kept_layers
from nodetrain.core.schedule import build_schedule, in_flight_peak
from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.memory import kept_activation_bytes, stage_memory
from nodetrain.engine.device.window import Window
from nodetrain.plan.planner import make_plan
from nodetrain.run.inject import Faults

EMBED, L0, L1, HEAD_BLOCK = range(4)  # SHAPE's blocks on one stage


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("wave", [1, 2, 4])
def test_the_schedule_runs_over_items(schedule: str, stages: int, wave: int) -> None:
    """M = 8 micro-batches, 2 rounds (grad_accum 2): the actions are the schedule over M/W items per
    round; item k is micro-batches kW … kW+W−1; the step's micro-batches count M·G whatever W."""
    for stage in range(stages):
        plan = StepPlan.step(schedule, stages, stage, 2, 8, range(4), stage == stages - 1, wave)
        rounds = 1 if schedule == "1f1b" else 2
        assert list(plan.actions) == build_schedule(schedule, stages, stage, 16 // rounds // wave)
        assert plan.num_items == 16 // wave and plan.num_microbatches == 16
        assert plan.microbatches_of(3) == [3 * wave + j for j in range(wave)]
        assert sorted(plan.backward_microbatches) == list(range(16))


def test_a_wave_that_does_not_divide_the_round_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pipeline.wave=3 does not divide a round's 4 micro-batches"):
        StepPlan.step("gpipe", 1, 0, 1, 4, range(4), True, 3)


def test_loads_offloads_and_arrivals_of_one_stage() -> None:
    """One stage (embed, L0, L1, head), GPipe, M = 4, W = 2: items F0 F1 B0 B1. Each item loads every
    block once per forward and L1, L0 once per backward (the head's gradients are taken in its
    forward); the streamed layers and head arrive once per item (their wave sums), the embedding's
    rows once per micro-batch; a block with a device accumulator once, at its last backward."""
    plan = StepPlan.step("gpipe", 1, 0, 1, 4, range(4), True, 2)
    fwd, bwd = [EMBED, L0, L1, HEAD_BLOCK], [L1, L0, EMBED]
    assert list(plan.loads) == fwd * 2 + bwd * 2
    assert plan.streamed_loads() == [L0, L1, HEAD_BLOCK] * 2 + [L1, L0] * 2  # the embedding by rows
    assert list(plan.offloads) == [HEAD_BLOCK, HEAD_BLOCK, L1, L0, EMBED, L1, L0, EMBED]
    assert plan.backwards == {HEAD_BLOCK: 4, L1: 4, L0: 4, EMBED: 4}  # the window's count of adds
    rows = [EMBED]
    assert plan.arrivals((), rows) == [HEAD_BLOCK, HEAD_BLOCK, L1, L0, EMBED, EMBED, L1, L0, EMBED, EMBED]
    assert plan.arrivals([L0], rows) == [HEAD_BLOCK, HEAD_BLOCK, L1, EMBED, EMBED, L1, L0, EMBED, EMBED]
    one = StepPlan.step("gpipe", 1, 0, 1, 4, range(4), True)
    assert one.arrivals((), rows) == list(one.offloads)  # W = 1: one arrival per offload, as before
    assert one.backwards == {b: 4 for b in range(4)}


def test_streamed_loads_with_the_wave_equal_to_the_round() -> None:
    """W = M: one item, so each block loads once for the forward and once for the backward, the
    block at the turn (the last forward's, the first backward's) only once."""
    plan = StepPlan.step("1f1b", 1, 0, 1, 4, range(4), True, 4)
    assert plan.streamed_loads() == [L0, L1, HEAD_BLOCK, L1, L0]


@pytest.mark.parametrize("wave", [1, 2, 4])
def test_work_counts_micro_batches_in_flight(wave: int) -> None:
    """Stage 0 of 2, 1F1B, M = 4: the items' peak (min(S − s, M/W)) times W micro-batches' inputs, and
    W × the items' P2P buffers (an item's message is [W, B, T, D])."""
    plan = StepPlan.step("1f1b", 2, 0, 1, 4, range(3), False, wave)
    work = plan.work()
    assert work.wave == wave and work.num_microbatches == 4 and work.num_items == 4 // wave
    assert work.in_flight == wave * min(2, 4 // wave)
    assert work.in_flight == wave * in_flight_peak(list(plan.actions))


def test_stage_memory_adds_one_fp32_wave_sum_per_slot() -> None:
    """The window's wave-sum buffers: slots × 4 × the largest wave-summed block (the head here; the
    streamed embedding goes by rows), in the window's bytes (so the automatic budget leaves them
    out); none for W = 1. The saved inputs count the item's W micro-batches."""
    kw = dict(b=2, t=16, slots=2, itemsize=2)
    plain = stage_memory(SHAPE, StepPlan.step("1f1b", 1, 0, 1, 4, range(4), True).work(), **kw)
    waved = stage_memory(SHAPE, StepPlan.step("1f1b", 1, 0, 1, 4, range(4), True, 2).work(), **kw)
    assert plain.wave_bytes == 0 and waved.wave_bytes == 2 * 4 * max(LAYER, HEAD)
    assert waved.window_bytes == plain.window_bytes + waved.wave_bytes
    # one stage, 1F1B: one micro-batch's inputs in flight for W = 1, one item of 2 for W = 2
    assert (plain.in_flight, waved.in_flight, waved.saved_bytes) == (1, 2, 2 * plain.saved_bytes)
    assert waved.total_bytes == plain.total_bytes + waved.wave_bytes + plain.saved_bytes
    acc = stage_memory(SHAPE, StepPlan.step("1f1b", 1, 0, 1, 4, range(4), True, 2).work(grad_acc={3}), **kw)
    assert acc.wave_bytes == 2 * 4 * LAYER  # the head keeps its own accumulator


def test_residency_saving_with_waves() -> None:
    """A streamed block of 10 elements (e = 2), 2 loads and 8 backwards a step: with W = 4 it ships
    its fp32 wave sum twice (80 B), resident once (40 B): 20 B of H2D + 40 B of D2H saved."""
    assert saved_transfer_bytes(10, 2, 2, 8, 4) == 20 + 2 * 40 - 40
    assert saved_transfer_bytes(10, 2, 2, 8) == 20 + 8 * 20 - 40  # W = 1: as before


def test_kept_layers_count_every_micro_batch_of_the_items_in_flight() -> None:
    """Stage 0 of 2, 1F1B, M = 4: W = 1 holds 2 micro-batches' graphs, W = 2 holds 2 items of 2. A
    budget of 2 micro-batches' graphs of one layer keeps one layer with W = 1 and none with W = 2."""
    budget = 2 * kept_activation_bytes(SHAPE, L0, 32, 2)
    one = StepPlan.step("1f1b", 2, 0, 1, 4, range(3), False)
    two = StepPlan.step("1f1b", 2, 0, 1, 4, range(3), False, 2)
    assert len(kept_layers(SHAPE, one, budget, 32, 16, 2)) == 1
    assert kept_layers(SHAPE, two, budget, 32, 16, 2) == frozenset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_window_ships_one_fp32_sum_per_item(make_store, dtype: torch.dtype) -> None:  # noqa: F811
    """W = 2, blocks 1 and 2 streamed: two items of two offloads of block 1 each reach the store as
    two fp32 wave sums (D2H 4 B per element per item; host bytes 8 then 12), the first overwriting
    what the previous step left, the second adding; one arrival per item; the buffers are 2 slots ×
    4 B × the largest block (block 2's 52 elements)."""
    store = make_store(dtype)
    arrived: list[int] = []
    window = Window(store, BINDINGS, [1, 2], 2, "cpu", wave=2, on_arrival=arrived.append)
    gen = torch.Generator().manual_seed(3)

    def grads() -> dict[str, torch.Tensor]:
        return {"a": torch.randn(4, 4, generator=gen).to(dtype), "b": torch.randn(4, generator=gen).to(dtype)}

    def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g["a"].float().reshape(-1), g["b"].float()])

    try:
        slots_nbytes = 2 * 52 * store.layout.compute_dtype.itemsize
        assert window.sums.wave_nbytes == 2 * 4 * 52 and window.nbytes == slots_nbytes + 2 * 4 * 52
        store.grad(1).fill_(123.0)  # what the previous step left
        window.begin([])
        g = [grads() for _ in range(4)]
        for x in g:
            window.offload(1, x)
        window.flush()
        want = (flat(g[0]) + flat(g[1])) + (flat(g[2]) + flat(g[3]))
        assert torch.equal(store.grad(1), want)
        assert arrived == [1, 1]
        stats = window.take_stats()
        assert (stats["d2h_bytes"], stats["accum_host_bytes"]) == (2 * 4 * 20, 8 * 20 + 12 * 20)
        window.begin([])
        window.offload(1, g[0])
        with pytest.raises(AssertionError, match="waves left unshipped"):
            window.flush()
    finally:
        window.close()


def _refusal(cfg: Config) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    return str(err.value)


def test_a_wave_is_refused_where_it_cannot_run() -> None:
    """A wave that does not divide the micro-batches, and waves with activation offload, are refused
    at start-up with the key, the value and the fix."""
    cfg = _cpu_config("float32")
    cfg.pipeline.microbatches, cfg.pipeline.wave = 4, 3
    assert "pipeline.wave=3: does not divide pipeline.microbatches=4" in _refusal(cfg)
    cfg.pipeline.wave, cfg.stream.offload_activations = 2, True
    message = _refusal(cfg)
    assert "pipeline.wave=2: runs a wave of micro-batches per load" in message, message
    assert "set pipeline.wave=1 (or stream.offload_activations=false)" in message, message


def test_resolve_with_waves_plans_items_and_says_so() -> None:
    """The run resolved on a CPU profile: every stage's plan carries the wave and the start-up lines
    say what it does; ``pipeline.microbatches=auto`` tries multiples of W only."""
    cfg = _cpu_config("float32")
    cfg.pipeline.microbatches, cfg.pipeline.wave = 4, 2
    run = make_plan(cfg).run
    assert {p.wave for p in run.plans} == {2} and run.plans[0].num_items == 2
    assert any(line.startswith("pipeline.wave=2: 2 items of 2 micro-batches per step") for line in run.lines)
    assert {w.wave for w in run.works} == {2}
    cfg.pipeline.microbatches = "auto"
    assert {m % 2 for _, m in _candidates(cfg, 2, 1)} == {0}


@pytest.mark.parametrize(("stages", "wave"), [(2, 1), (2, 2), (2, 4), (8, 2), (8, 16), (2, 32)])
def test_automatic_micro_batches_stay_within_their_range_with_a_wave(stages: int, wave: int) -> None:
    """``pipeline.microbatches=auto`` tries S, 2S, 4S, 8S (the documented range), those W divides;
    where none is (W > 8S) the one count lcm(S, W): a wave never multiplies the batch by W."""
    cfg = _cpu_config("float32")
    cfg.pipeline.microbatches, cfg.pipeline.wave = "auto", wave
    documented = [stages * k for k in (1, 2, 4, 8) if stages * k % wave == 0]
    expected = documented or [stages * wave // math.gcd(stages, wave)]
    assert sorted({m for _, m in _candidates(cfg, stages, 1)}) == expected


def test_a_batch_no_wave_multiple_splits_is_refused_naming_the_wave() -> None:
    """``train.batch_size=8`` of micro-batches of 4 on 2 stages: 2 micro-batches per step, which W = 4
    cannot divide; the refusal names ``pipeline.wave`` and its fix (W = 1 picks 2 micro-batches)."""
    cfg = _cpu_config("float32")
    cfg.train.batch_size, cfg.train.micro_batch_size, cfg.pipeline.microbatches = 8, 4, "auto"
    cfg.pipeline.wave = 1
    assert {m for _, m in _candidates(cfg, 2, 1)} == {2}
    cfg.pipeline.wave = 4
    with pytest.raises(ConfigError, match=r"pipeline.wave=4: .*use pipeline.wave=1"):
        _candidates(cfg, 2, 1)


@pytest.mark.parametrize("value", ["auto", 2.0, 0, None, True])
def test_a_wave_that_is_no_positive_integer_is_refused(value) -> None:
    """Not Hydra's type error: the key, the value and the fix."""
    cfg = _cpu_config("float32")
    cfg.pipeline.wave = value
    assert "pipeline.wave=" in _refusal(cfg) and "must be an integer >= 1; use 1, or a divisor" in _refusal(
        cfg
    )


def test_a_resume_may_change_the_wave() -> None:
    """``pipeline.wave`` changes only the order of fp32 sums (as the stage count does): the config hash
    that ``checkpoint.resume=auto`` matches leaves it out, so a resume with another W continues."""
    base = {"pipeline": {"wave": 1, "microbatches": 4, "stages": 2}, "optim": {"lr": 1e-3}}
    other = {"pipeline": {"wave": 4, "microbatches": 4, "stages": 1}, "optim": {"lr": 1e-3}}
    assert config_hash(base) == config_hash(other)
    assert config_hash(base) != config_hash({**base, "pipeline": {**base["pipeline"], "microbatches": 8}})


def test_a_wave_sum_buffer_is_rewritten_only_after_its_ship_landed(make_store) -> None:  # noqa: F811
    """One slot (one wave-sum buffer) and a slowed D2H worker: block 1's wave ships from the buffer
    while block 2's wave starts; its first add must wait for that ship, else the delayed ship would
    read block 2's gradients into block 1's accumulator (without the wait this test fails)."""
    store = make_store(torch.float32)
    window = Window(store, BINDINGS, [1, 2], 1, "cpu", wave=2, faults=Faults(copy_delay_s=0.05))
    ones = {"a": torch.ones(4, 4), "b": torch.ones(4)}
    twos = {
        "w": torch.full((4, 4), 2.0),
        "n": torch.full((4,), 2.0),
        "lm_head.weight": torch.full((8, 4), 2.0),
    }
    try:
        window.begin([])
        for block, g in ((1, ones), (1, ones), (2, twos), (2, twos)):
            window.offload(block, g)
        window.flush()
        assert torch.equal(store.grad(1), torch.full((20,), 2.0))
        assert torch.equal(store.grad(2), torch.full((20,), 4.0))
        assert torch.equal(store.buffer(0, "grad_tied"), torch.full((32,), 4.0))
    finally:
        window.close()
