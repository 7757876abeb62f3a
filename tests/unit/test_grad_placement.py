"""``stream.grad_on_device``'s rule and prices (core/placement.py, cost/traffic.py, cost/memory.py,
cost/step_time.py) against closed forms written here from the docstrings, on a hand-built
``ModelShape``; resolve() on a CPU profile and a GPU one; the refusal that names key, value and fix."""

from __future__ import annotations

import pytest
from test_step_time import COST, HEAD, LAYER, SHAPE, D, V, _cpu_config

from nodetrain.config.schema import ConfigError
from nodetrain.core.placement import grad_blocks
from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.memory import stage_memory
from nodetrain.cost.traffic import block_traffic, stage_traffic
from nodetrain.plan.planner import make_plan

N = 32  # tokens per micro-batch (B·T = 2·16)


def _plan(m: int) -> StepPlan:
    """One stage, 1F1B, m micro-batches in one round, blocks embed, L0, L1, head."""
    return StepPlan.step("1f1b", 1, 0, 1, m, range(4), True)


@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_block_traffic_ships_once_and_loads_as_before(m: int, e: int) -> None:
    """A streamed block with a device accumulator: its loads unchanged (P·e per load), 4·P D2H and
    8·P host bytes per step; without: m·P·e D2H, m·P·e + 4P + (m − 1)·8P host bytes. The embedding by
    rows: m·n·D·e H2D either way, then its [V, D] accumulator's 4·V·D and 8·V·D."""
    plan = _plan(m)
    plain, acc = plan.work(), plan.work(grad_acc=range(4))
    assert acc.grad_acc == frozenset(range(4)) and acc.loads == plain.loads
    for block, p in ((1, LAYER), (2, LAYER), (3, HEAD)):
        loads = sum(1 for i in plain.loads if i == block) * p * e
        assert block_traffic(SHAPE, plain, block, n=N, itemsize=e) == (
            loads,
            m * p * e,
            m * p * e + 4 * p + (m - 1) * 8 * p,
        )
        assert block_traffic(SHAPE, acc, block, n=N, itemsize=e) == (loads, 4 * p, 8 * p)
    assert block_traffic(SHAPE, acc, 0, n=N, itemsize=e) == (m * N * D * e, 4 * V * D, 8 * V * D)
    # a resident block keeps its own accumulator: grad_acc leaves it out
    assert plan.work(resident={1}, grad_acc=range(4)).grad_acc == frozenset({0, 2, 3})


def test_gradient_bytes_per_step_do_not_grow_with_the_micro_batches() -> None:
    """The bar in the planner's terms: D2H and accumulation bytes per step at 8 micro-batches over 4:
    1 with every streamed block accumulating on the device, about 2 without."""

    def host(m: int, acc: bool) -> tuple[int, int]:
        x = stage_traffic(SHAPE, _plan(m).work(grad_acc=range(4) if acc else ()), n=N, itemsize=2)
        return x.d2h_bytes, x.accum_bytes

    params = sum(SHAPE.load_numels)
    assert host(4, True) == host(8, True) == (4 * params, 8 * params)
    (d8, a8), (d4, a4) = host(8, False), host(4, False)
    assert d8 / d4 > 1.9 and a8 / a4 > 1.6


def test_stage_memory_counts_four_bytes_per_parameter() -> None:
    work = _plan(4).work(grad_acc={1, 3})
    kw = dict(b=2, t=16, slots=2, itemsize=2)
    plain = stage_memory(SHAPE, _plan(4).work(), **kw)
    got = stage_memory(SHAPE, work, **kw)
    assert got.grad_acc_bytes == 4 * (LAYER + HEAD)
    assert got.total_bytes == plain.total_bytes + 4 * (LAYER + HEAD)


def test_grad_blocks_rule() -> None:
    """true: every streamed block; false: none; auto: within what is left, the blocks that save host
    bytes, most per device byte first (a layer and the head: 32 B saved per 4 B at m = 4, bf16; ties in
    block order); the embedding by rows saves none here (its row traffic is below 12·V·D), a block
    that does not fit is skipped, and one micro-batch in fp32 saves nothing."""
    plan = _plan(4)
    assert grad_blocks(True, SHAPE, plan, 2, 0, frozenset({3}), N) == frozenset({0, 1, 2})
    assert grad_blocks(False, SHAPE, plan, 2, 10**9, frozenset(), N) == frozenset()
    assert grad_blocks("auto", SHAPE, plan, 2, 0, frozenset(), N) == frozenset()
    assert grad_blocks("auto", SHAPE, plan, 2, 10**9, frozenset(), N) == frozenset({1, 2, 3})
    assert grad_blocks("auto", SHAPE, plan, 2, 4 * 2 * LAYER, frozenset(), N) == frozenset({1, 2})
    assert grad_blocks("auto", SHAPE, plan, 2, 4 * (LAYER + HEAD) - 1, frozenset(), N) == frozenset({1})
    assert grad_blocks("auto", SHAPE, _plan(1), 4, 10**9, frozenset(), N) == frozenset()
    assert COST == LAYER


def test_resolve_on_a_cpu_profile() -> None:
    """auto: the CPU's automatic budget is 0, nothing changes; a budget in bytes: residency first (the
    head, then the embedding, 6 B/param in bf16), auto's accumulators in what is left (one layer's
    4 B/param); true: every block, with none resident (stream.device_budget=0), said in the start-up
    lines."""
    cfg = _cpu_config("bfloat16")
    cfg.stream.grad_on_device = "auto"
    run = make_plan(cfg).run
    assert run.grad_acc == (frozenset(),)
    assert any("stream.grad_on_device=auto: 0 of 4" in line for line in run.lines)
    resident = 6 * (HEAD + V * D)
    for left, want in ((4 * LAYER, {1}), (4 * LAYER - 1, set())):
        cfg.stream.device_budget = resident + left
        run = make_plan(cfg).run
        assert run.resident == (frozenset({0, 3}),) and run.grad_acc == (frozenset(want),)
    cfg.stream.device_budget, cfg.stream.grad_on_device = 0, True
    plan = make_plan(cfg)
    assert plan.run.grad_acc == (frozenset(range(4)),)
    assert plan.run.works[0].grad_acc == frozenset(range(4))
    assert plan.time.traffic[0].d2h_bytes == 4 * sum(SHAPE.load_numels)


def test_true_that_does_not_fit_the_device_is_refused() -> None:
    cfg = _cpu_config("float32")
    cfg.hardware.gpus_per_node, cfg.hardware.device_memory_gb = 1, 10.0
    cfg.stream.grad_on_device = True
    plan = make_plan(cfg)  # fits: 10 GB (the budget leaves the accumulators out first)
    assert plan.run.grad_acc == (frozenset(range(4)) - plan.run.resident[0],)
    cfg.hardware.device_memory_gb = 2.001  # the 2 GB margin, nothing else
    with pytest.raises(ConfigError) as err:
        make_plan(cfg)
    assert "stream.grad_on_device=true: stage 0 needs" in str(err.value)
    assert "set stream.grad_on_device=auto or false" in str(err.value)


def test_planner_prices_a_host_bound_step_faster_with_the_accumulators() -> None:
    """The per-block overlap: a streamed block with an accumulator has no offload per backward and one
    ship at the step's last. Host-bound (the D2H worker's adds at 0.05 GB/s a core): the step is
    faster; compute-bound (the offloads were hidden): the last backward's ships cost a little. The
    D2H worker adds alone (``stream.accum_help=false``): with the optimizer's team helping, the slow
    cores' step is bound by the optimizer, not by the adds this test is about."""
    cfg = _cpu_config("bfloat16")
    cfg.pipeline.microbatches, cfg.stream.device_budget = 8, 0
    cfg.stream.accum_help = False
    for core, faster in ((0.05, True), (20.0, False)):
        cfg.hardware.core_memory_bandwidth_gbps = core
        cfg.stream.grad_on_device = False
        off = make_plan(cfg).time
        cfg.stream.grad_on_device = True
        on = make_plan(cfg).time
        assert on.d2h_s == pytest.approx(4 * sum(SHAPE.load_numels) / 10e9)  # host_link_gbps=10
        assert on.d2h_s < off.d2h_s / 2 and on.accum_s < off.accum_s / 4
        if faster:
            assert off.bottleneck == "host accumulation" and on.step_s < 0.8 * off.step_s
        else:
            assert off.bottleneck == on.bottleneck == "compute"
            assert off.step_s <= on.step_s < 1.01 * off.step_s
