"""The planner's price of waves (``pipeline.wave``, issue 31): bytes per step, the bubble, saved inputs,
finality and the report's wave lines.

References are closed forms from parameter counts and the schedule (written out in each test), not
the cost model's helpers: a streamed block loaded once per item, its wave-summed fp32 gradient
shipped once per item (4·P D2H; on the host the step's first arrival overwrites, 4 + 4 bytes, each
later one adds fp32 += fp32, 4 + 8), the streamed embedding's rows per micro-batch as before.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from rich.console import Console
from test_step_time import HEAD, LAYER, SHAPE, D

from nodetrain.config.registry import register_configs, to_typed
from nodetrain.core.schedule import build_schedule
from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.exposure import pipeline_times
from nodetrain.cost.memory import saved_per_micro_batch, stage_memory
from nodetrain.cost.traffic import stage_traffic
from nodetrain.plan.planner import make_plan
from nodetrain.plan.report import render
from nodetrain.plan.waves import best_wave

CONF = Path(__file__).resolve().parents[2] / "conf"
M, N, E = 4, 32, 2  # micro-batches per step, tokens per micro-batch, bf16 bytes


def _work(wave: int, stages=1, stage=0, m=M, schedule="1f1b", blocks=(0, 1, 2, 3)):
    last = stage == stages - 1
    return StepPlan.step(schedule, stages, stage, 1, m, list(blocks), last, wave).work()


@pytest.mark.parametrize("wave", [1, 2, M])
def test_bytes_per_step_of_a_streamed_stage_at_each_wave(wave: int) -> None:
    """One stage owning embed, L0, L1, head (untied), M = 4, I = M/W items. Loads per item: forward L0,
    L1, head (the embedding travels as rows), backward L1, L0; the next item's first L0 reuses the
    previous backward's last, so L0 loads I + 1 times, L1 2I, the head I. Rows: M·n·D·e in,
    M·(n·D·e + 8n) out and M·8·n·D scatter-added plus the 4·V·D zeroed accumulator.
    W = 1: each streamed block ships P·e per micro-batch and the host adds it (e + 4 + 4 after the
    first, e + 4 for the first); W > 1: 4·P per item, host 4·P·I + 4·P + 8·P·(I − 1)."""
    items, x = M // wave, stage_traffic(SHAPE, _work(wave), n=N, itemsize=E)
    streamed = [LAYER, LAYER, HEAD]
    rows_in, rows_out = M * N * D * E, M * (N * D * E + 8 * N)
    rows_host = 4 * SHAPE.load_numels[0] + rows_out + M * 8 * N * D
    assert x.h2d_bytes == E * ((items + 1) * LAYER + 2 * items * LAYER + items * HEAD) + rows_in
    if wave == 1:
        d2h = sum(M * p * E for p in streamed)
        host = sum(M * p * E + 4 * p + (M - 1) * 8 * p for p in streamed)
    else:
        d2h = sum(items * 4 * p for p in streamed)
        host = sum(items * 4 * p + 4 * p + (items - 1) * 8 * p for p in streamed)
    assert x.d2h_bytes == d2h + rows_out
    assert x.accum_bytes == host + rows_host
    if wave == M:  # one item per step: a streamed block leaves once, no host add
        assert x.d2h_bytes - rows_out == 4 * sum(streamed)
        assert x.accum_bytes - rows_host == 8 * sum(streamed)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("wave", [1, 2, 4, 8])
def test_the_bubble_is_s_minus_1_over_items_plus_s_minus_1(schedule: str, wave: int) -> None:
    """S = 3 equal stages, M = 8: the schedule runs I = M/W items, each W micro-batches' forward (W·f)
    and backward (W·b); the pipeline ends after (I + S − 1) item slots, so its bubble, (S − 1) slots, is
    (S − 1)/(I + S − 1) of it (GPipe, arXiv:1811.06965; 1F1B the same)."""
    s, m, f, b = 3, 8, 1.0, 2.0
    items = m // wave
    works = [_work(wave, s, k, m, schedule, blocks) for k, blocks in enumerate([(0, 1), (2,), (3,)])]
    assert [w.num_items for w in works] == [items] * s and all(w.num_microbatches == m for w in works)
    actions = [list(w.actions) for w in works]
    assert actions == [build_schedule(schedule, s, k, items) for k in range(s)]
    end = max(t[-1][1] for t in pipeline_times(actions, [wave * f] * s, [wave * b] * s))
    assert end == pytest.approx((items + s - 1) * wave * (f + b))
    busy = items * wave * (f + b)
    assert (end - busy) / end == pytest.approx((s - 1) / (items + s - 1))


@pytest.mark.parametrize("wave", [1, 2, 4])
def test_saved_inputs_hold_w_micro_batches_per_item_in_flight(wave: int) -> None:
    """1F1B, S = 2, M = 4: stage 0 holds min(S − s, I) = min(2, 4/W) items in flight, each W micro-batches'
    block inputs (n·D·e per layer, 8·n for the embedding's ids); with W > 1 the window adds one fp32
    wave sum per slot of the largest wave-summed block (L0 or L1: the stage's embedding travels as rows)."""
    slots, items = 2, M // wave
    mem = stage_memory(SHAPE, _work(wave, 2, 0, blocks=(0, 1, 2)), b=2, t=16, slots=slots, itemsize=E)
    held = min(2, items) * wave
    assert mem.in_flight == held
    assert mem.saved_bytes == held * (8 * N + 2 * N * D * E)
    assert saved_per_micro_batch(SHAPE, range(3), N, E) == 8 * N + 2 * N * D * E
    assert mem.wave_bytes == (slots * 4 * LAYER if wave > 1 else 0)


# ----------------------------------------------------------------------------- the shared 3B run


def _cfg(*overrides: str):
    """The shared 3B run, every unit streamed, 16 micro-batches (docs/planner.md#waves)."""
    register_configs()
    base = [
        "model=llama3_2_3b",
        "hardware=h200_1gpu",
        "train.seq_len=4096",
        "train.micro_batch_size=2",
        "pipeline.microbatches=16",
        "train.dtype=bfloat16",
        "stream.device_budget=0",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_typed(compose("config", overrides=[*base, *overrides]))


@pytest.fixture(scope="module")
def plans():
    """The 3B plan at W = 1 and W = M = 16."""
    return {w: make_plan(_cfg(f"pipeline.wave={w}")) for w in (1, 16)}


def test_3b_bytes_per_step_from_parameter_counts(plans) -> None:
    """W = 16 = M: one item, so every block but the embedding (rows, per micro-batch) is loaded once per
    pass and ships 4·P once (8·P on the host); W = 1: P·e per micro-batch (tied head: the embedding
    matrix travels with it, ``load_numels``)."""
    shape, n, m = plans[1].shape, 2 * 4096, 16
    p = sum(shape.load_numels[1:])
    rows_out = m * (n * shape.hidden * E + 8 * n)
    one, wave = plans[1].time.traffic[0], plans[16].time.traffic[0]
    assert one.d2h_bytes == m * p * E + rows_out
    assert wave.d2h_bytes == 4 * p + rows_out
    rows_host = 4 * shape.load_numels[0] + rows_out + m * 8 * n * shape.hidden
    assert wave.accum_bytes == 8 * p + rows_host
    assert one.accum_bytes == m * p * E + 4 * p + (m - 1) * 8 * p + rows_host
    # a pass loads L layers forward (and the head), L backward; an item's first layer reuses the
    # previous item's last backward load (the same block twice in a row)
    layers = shape.num_layers
    assert wave.loads == 2 * layers + 1
    assert one.loads == m * (2 * layers + 1) - (m - 1)
    weights = 2 * sum(shape.load_numels[1:-1]) + shape.load_numels[-1]
    assert wave.h2d_bytes == E * weights + m * n * shape.hidden * E


def test_3b_finality_hides_the_optimizer_behind_the_wave_backward(plans) -> None:
    """With W = 1 every streamed unit is final inside the step's last micro-batch's backward (1/16 of
    the backward); with W = M each is final right after its own wave backward, unit by unit through
    the whole backward, so an update in the backward (in-backward, speculative) overlaps more of it."""
    one, wave = plans[1].time.exposure, plans[16].time.exposure
    assert wave.in_backward_s < one.in_backward_s
    assert wave.speculative_s < one.speculative_s
    assert wave.in_backward_s < 0.25 * one.in_backward_s


def test_3b_wave_lines_name_every_divisor_and_the_best_that_fits(plans) -> None:
    """The report lists W = 1, 2, 4, 8, 16 with tokens/s and memory, marks the configured one and names
    the fastest that fits; the configured W's option is the plan's own step, W = 1's the W = 1 plan's."""
    plan = plans[16]
    waves = {o.wave: o for o in plan.waves}
    assert sorted(waves) == [1, 2, 4, 8, 16]
    assert waves[16].time.step_s == plan.time.step_s and waves[1].time.step_s == plans[1].time.step_s
    assert waves[16].peak_bytes == max(st.total_bytes for st in plan.placed)
    best = max((o for o in plan.waves if o.fits), key=lambda o: o.tokens_per_s)
    assert best_wave(plan.waves) == best
    out = io.StringIO()
    render(plan, Console(file=out, width=10_000, highlight=False))
    text = out.getvalue()
    line = next(x for x in text.splitlines() if x.startswith("waves ("))
    assert "one W for all stages" in line and "W=16 " in line and line.endswith("← configured")
    assert all(f"W={w} {waves[w].tokens_per_s:,.0f} tokens/s" in line for w in waves)
    assert f"best wave that fits: pipeline.wave={best.wave} " in text


def test_3b_recompute_seconds_are_the_compute_a_kept_graph_saves(plans) -> None:
    """The 'beyond compute' line's recompute seconds: the compute with recompute less that with every
    layer's activations kept (``stream.recompute=false``, priced even where it does not fit)."""
    kept = make_plan(_cfg("pipeline.wave=1", "stream.recompute=false")).time
    t = plans[1].time
    assert t.recompute_s == pytest.approx(t.compute_s - kept.compute_s, rel=1e-9)
    assert kept.recompute_s == pytest.approx(0.0, abs=1e-9)
