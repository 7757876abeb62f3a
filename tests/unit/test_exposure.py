"""Exposed optimizer time (``cost/exposure.py``) and the rule of ``optim.speculative=auto``, pure.

Every expected figure is worked out in the test's docstring or comment from the timeline the module
docstring draws (the engine's schedule, a FIFO optimizer thread, loads gated on updates), not by
calling the module's helpers.
"""

from __future__ import annotations

import pytest

from nodetrain.config.schema import OptimConfig
from nodetrain.core.schedule import build_schedule
from nodetrain.core.update import SPECULATE_GAIN, choose_speculative, update_kind
from nodetrain.cost.exposure import CLIP_FRACTION, OptimizerExposure, UnitTiming, exposed_s, pipeline_times

# ----------------------------------------------------------------------------- the schedule


def test_pipeline_times_1f1b_two_stages() -> None:
    """S=2, M=2, forwards 1 and 2 s, backwards 3 and 4 s. Stage 1: F0 [1, 3] after stage 0's F0,
    B0 [3, 7], F1 [7, 9], B1 [9, 13]; stage 0 (one warm-up forward): F0 [0, 1], F1 [1, 2], B0 waits
    for stage 1's B0: [7, 10], B1 for stage 1's B1: [13, 16]."""
    actions = [build_schedule("1f1b", 2, s, 2) for s in range(2)]
    times = pipeline_times(actions, [1.0, 2.0], [3.0, 4.0])
    assert times[0] == [(0, 1), (1, 2), (7, 10), (13, 16)]
    assert times[1] == [(1, 3), (3, 7), (7, 9), (9, 13)]


def test_pipeline_times_pairs_repeated_rounds() -> None:
    """GPipe, S=2, M=2, two rounds (the same micro-batch numbers twice), forwards 1 s, backwards 2 s:
    round 2's forwards on stage 1 wait for round 2's on stage 0 (at 9 and 10), not round 1's."""
    actions = [build_schedule("gpipe", 2, s, 2) * 2 for s in range(2)]
    times = pipeline_times(actions, [1.0, 1.0], [2.0, 2.0])
    assert times[0] == [(0, 1), (1, 2), (5, 7), (7, 9), (9, 10), (10, 11), (14, 16), (16, 18)]
    assert times[1] == [(1, 2), (2, 3), (3, 5), (5, 7), (10, 11), (11, 12), (12, 14), (14, 16)]


def test_pipeline_times_refuses_schedules_that_wait_forever() -> None:
    actions = [build_schedule("gpipe", 2, 0, 2), build_schedule("gpipe", 2, 1, 1)]  # mb 1 never arrives
    with pytest.raises(ValueError, match="forever"):
        pipeline_times(actions, [1.0, 1.0], [1.0, 1.0])


# ----------------------------------------------------------------------------- one stage


def _units(k: int, u: float, f: float, load: float = 0.0, finals=None, **kw) -> list[UnitTiming]:
    finals = finals or [0.0] * k
    return [UnitTiming(update_s=u, final_s=finals[i], forward_s=f, load_s=load, **kw) for i in range(k)]


@pytest.mark.parametrize("k,u,f", [(4, 2.0, 1.0), (4, 0.5, 1.0), (1, 3.0, 1.0), (6, 1.0, 1.0)])
def test_deferred_closed_form(k: int, u: float, f: float) -> None:
    """Deferred, K equal units released at P in forward order: unit j is done at P + (j+1)u and its
    forward, in the baseline at P + j·f, starts at max(that, the previous forward's end). The chain
    ends u + (K − 1)·max(0, u − f) late: the first update is always exposed, each later one by
    what it exceeds a forward."""
    assert exposed_s([_units(k, u, f)], 10.0, "deferred") == pytest.approx(u + (k - 1) * max(0.0, u - f))


def test_deferred_loads_wait_for_the_update() -> None:
    """Loads of 0.5 s on one in-order H2D worker, u = 2, f = 1, K = 3: load j ends at (j+1)·2 + 0.5
    (the updates are slower than the loads), forward j at max(…) + 1: the chain ends at 7.5; the
    baseline loads end at 0.5, 1, 1.5 and its forwards at 1.5, 2.5, 3.5: 4 s late."""
    assert exposed_s([_units(3, 2.0, 1.0, load=0.5)], 0.0, "deferred") == pytest.approx(4.0)


def test_serial_is_every_update_and_the_slowest_stage() -> None:
    stages = [_units(3, 1.0, 0.1), _units(2, 2.5, 0.1)]
    assert exposed_s(stages, 5.0, "serial") == pytest.approx(5.0)  # max(3 × 1, 2 × 2.5)


FINALS = [9.0, 8.0, 7.0]
"""Three units of one stage final during the last backward, in reverse (unit 2 at 7 s); P = 10 s."""


def test_in_backward_closed_form() -> None:
    """u = 2, f = 1. The FIFO runs unit 2 [7, 9], unit 1 [9, 11], unit 0 [11, 13]; the all-reduce
    waits until unit 0's update has begun (its norm² first): 11, the next step starts there. Unit 0,
    needed first, is done at 13: its forward ends at 14 against 12 without the updates, and the two
    later forwards follow at once. Late 2 + the all-reduce's 1 = 3 s."""
    assert exposed_s([_units(3, 2.0, 1.0, finals=FINALS)], 10.0, "in_backward") == pytest.approx(3.0)
    # deferred on the same stage: u + (K − 1)(u − f) = 4, later despite the earlier start
    assert exposed_s([_units(3, 2.0, 1.0, finals=FINALS)], 10.0, "deferred") == pytest.approx(4.0)


def test_speculative_closed_forms() -> None:
    """As in-backward with a 1 s backup per unit: jobs [7, 10], [10, 13], [13, 16]; the all-reduce at
    13, unit 0 done at 16: 3 + 3 = 6 s. A step that clips then redoes each unit (3 s) in forward
    order after the all-reduce: [16, 19], [19, 22], [22, 25]; the forwards end at 26 against 16:
    3 + 10 = 13 s."""
    units = _units(3, 2.0, 1.0, finals=FINALS, backup_s=1.0, redo_s=3.0)
    assert exposed_s([units], 10.0, "speculative") == pytest.approx(6.0)
    assert exposed_s([units], 10.0, "speculative_clipped") == pytest.approx(13.0)


def test_a_shared_unit_delays_every_stage() -> None:
    """Stage 0 owns the tied embedding (shared, u = 1) and L0 (final at 9, u = 2); P = 10. In the
    backward L0 runs [9, 11]; the embedding waits for the all-reduce (10) and the queue: [11, 12];
    the step's end waits for it (the barrier), so both stages start the next step at 12: 2 s. Stage
    0's chain is then on time (L0 done at 11, the embedding at 12); stage 1's unit (final at 5,
    done at 6) too."""
    stage0 = [
        UnitTiming(update_s=1.0, final_s=0.0, forward_s=0.0, shared=True),
        UnitTiming(update_s=2.0, final_s=9.0, forward_s=1.0),
    ]
    stage1 = [UnitTiming(update_s=1.0, final_s=5.0, forward_s=1.0)]
    assert exposed_s([stage0, stage1], 10.0, "in_backward", fills=[0.0, 1.0]) == pytest.approx(2.0)


def test_a_later_stage_hides_its_updates_behind_the_fill() -> None:
    """Deferred, stage 1's first forward waits 3 s for stage 0's (its fill): its update of 2.5 s is
    hidden, stage 0's 1 s is not."""
    stages = [_units(1, 1.0, 3.0), _units(1, 2.5, 1.0)]
    assert exposed_s(stages, 0.0, "deferred", fills=[0.0, 3.0]) == pytest.approx(1.0)
    assert exposed_s(stages, 0.0, "deferred", fills=[0.0, 0.0]) == pytest.approx(2.5)


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown update mode"):
        exposed_s([_units(1, 1.0, 1.0)], 0.0, "eager")


# ----------------------------------------------------------------------------- the choice


def test_speculative_is_priced_at_the_clip_fraction() -> None:
    x = OptimizerExposure(serial_s=5, deferred_s=4, in_backward_s=2, speculative_s=1, speculative_clipped_s=9)
    assert x.of("speculative") == pytest.approx((1 - CLIP_FRACTION) * 1 + CLIP_FRACTION * 9)
    assert x.of("speculative", clip_fraction=0.0) == 1
    assert (x.of("serial"), x.of("deferred"), x.of("in_backward")) == (5, 4, 2)


@pytest.mark.parametrize(
    "deferred,speculative,fits,want",
    [
        (1.0, 0.9, True, True),
        (1.0, 1.0 - SPECULATE_GAIN / 2, True, False),  # within the margin: not worth the RAM
        (1.0, 0.5, False, False),  # the backups do not fit
        (1.0, 1.5, True, False),
    ],
)
def test_choose_speculative(deferred: float, speculative: float, fits: bool, want: bool) -> None:
    assert choose_speculative(deferred, speculative, fits) is want


def test_update_kind_names_every_mode() -> None:
    assert update_kind(OptimConfig(overlap=False, speculative="auto")) == "serial"
    assert update_kind(OptimConfig()) == "deferred"  # clipping by default
    assert update_kind(OptimConfig(speculative=True)) == "speculative"
    assert update_kind(OptimConfig(speculative="auto")) == "auto"
    assert update_kind(OptimConfig(speculative="auto", update_in_backward=False)) == "deferred"
    assert update_kind(OptimConfig(speculative="auto", max_grad_norm=0.0)) == "in_backward"
    assert update_kind(OptimConfig(max_grad_norm=0.0, update_in_backward=False)) == "deferred"
