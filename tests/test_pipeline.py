"""Pure pipeline logic: the stage partition and the schedules (milliseconds, no torch.distributed).

``partition`` is checked against brute force over every set of cuts; ``build_schedule`` by
simulating all stages' action lists together with the engine's communication semantics (sends
never block, a forward waits for the previous stage's activation, a backward for the next
stage's gradient), which must finish without deadlock for every depth and micro-batch count.
"""

from __future__ import annotations

import itertools
import random

import pytest

from nodetrain.pipeline import Action, build_schedule, partition

SCHEDULE_KINDS = ("gpipe", "1f1b")
SHAPES = [(s, m) for s in range(1, 9) for m in range(1, 13)]  # (stages, micro-batches)

# ----------------------------------------------------------------------------- partition


def _brute_force_best(costs: list[int], num_stages: int) -> int:
    """Smallest achievable largest-stage cost, over every way to cut ``costs`` into contiguous parts."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


def _check_cover(parts: list[range], n: int, num_stages: int) -> None:
    assert len(parts) == num_stages
    assert all(isinstance(p, range) and p.step == 1 and len(p) > 0 for p in parts), parts
    assert parts[0].start == 0 and parts[-1].stop == n, parts
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts)), f"not contiguous: {parts}"


@pytest.mark.parametrize("seed", range(40))
def test_partition_is_contiguous_and_minimises_the_largest_stage(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    costs = [rng.choice([1, 1, 2, 5, 10, 40, 100, 1000]) * rng.randint(1, 9) for _ in range(n)]
    for num_stages in range(1, n + 1):
        parts = partition(costs, num_stages)
        _check_cover(parts, n, num_stages)
        largest = max(sum(costs[i] for i in p) for p in parts)
        assert largest == _brute_force_best(costs, num_stages), (costs, num_stages, parts)


def test_partition_of_a_model_like_cost_profile() -> None:
    # embed, 8 equal layers, head: with 4 stages the best is 2-3 layers per stage plus the ends
    costs = [50, *[100] * 8, 50]
    parts = partition(costs, 4)
    _check_cover(parts, len(costs), 4)
    assert max(sum(costs[i] for i in p) for p in parts) == _brute_force_best(costs, 4) == 250


@pytest.mark.parametrize(("n", "num_stages"), [(3, 4), (1, 2), (5, 0), (0, 1)])
def test_partition_refuses_impossible_stage_counts(n: int, num_stages: int) -> None:
    with pytest.raises(ValueError):
        partition([1] * n, num_stages)


# ----------------------------------------------------------------------------- schedules


def _simulate(schedules: list[list[Action]]) -> list[tuple[int, Action]]:
    """Execute every stage's actions in order, one ready action per stage per tick, with blocking
    receives: F(s, mb) needs F(s-1, mb) done (s > 0); B(s, mb) needs B(s+1, mb) done (s < S-1) or,
    on the last stage, its own F(s, mb). Sends are asynchronous (``isend``) and never block.

    Returns:
        the global execution order as (stage, action).

    Raises:
        AssertionError: a deadlock (no stage can proceed while some still have work).
    """
    num_stages = len(schedules)
    done: set[tuple[int, str, int]] = set()
    pos = [0] * num_stages
    order = []

    def ready(s: int, a: Action) -> bool:
        if a.kind == "F":
            return s == 0 or (s - 1, "F", a.mb) in done
        return (s + 1, "B", a.mb) in done if s < num_stages - 1 else (s, "F", a.mb) in done

    while any(pos[s] < len(schedules[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if pos[s] < len(schedules[s]) and ready(s, schedules[s][pos[s]]):
                a = schedules[s][pos[s]]
                done.add((s, a.kind, a.mb))
                order.append((s, a))
                pos[s] += 1
                progressed = True
        blocked = {s: schedules[s][pos[s]] for s in range(num_stages) if pos[s] < len(schedules[s])}
        assert progressed, f"deadlock: every stage with work waits on a receive: {blocked}"
    return order


def _max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran but backward did not yet (saved activations)."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_each_microbatch_has_one_forward_then_one_backward_per_stage(kind: str) -> None:
    for num_stages, m in SHAPES:
        for s in range(num_stages):
            actions = build_schedule(kind, num_stages, s, m)
            assert all(isinstance(a, Action) and a.kind in "FB" for a in actions)
            assert sorted((a.kind, a.mb) for a in actions) == sorted(
                [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            ), (kind, num_stages, s, m)
            index = {(a.kind, a.mb): i for i, a in enumerate(actions)}
            assert all(index[("F", i)] < index[("B", i)] for i in range(m)), (kind, num_stages, s, m)


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_schedules_run_together_without_deadlock_in_dependency_order(kind: str) -> None:
    for num_stages, m in SHAPES:
        schedules = [build_schedule(kind, num_stages, s, m) for s in range(num_stages)]
        order = _simulate(schedules)
        when = {(s, a.kind, a.mb): t for t, (s, a) in enumerate(order)}
        assert len(when) == 2 * num_stages * m
        for s in range(num_stages):
            for mb in range(m):
                if s > 0:
                    assert when[(s - 1, "F", mb)] < when[(s, "F", mb)]
                if s < num_stages - 1:
                    assert when[(s + 1, "B", mb)] < when[(s, "B", mb)]
                assert when[(s, "F", mb)] < when[(s, "B", mb)]


def test_simulation_detects_a_deadlock() -> None:
    # stage 0 waits for the gradient of mb 0 before sending mb 1; stage 1 wants mb 1 first
    schedules = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)],
    ]
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(schedules)


def test_1f1b_bounds_in_flight_activations_by_depth() -> None:
    for num_stages, m in SHAPES:
        for s in range(num_stages):
            actions = build_schedule("1f1b", num_stages, s, m)
            assert _max_in_flight(actions) <= num_stages - s, (num_stages, s, m)
            # PipeDream-Flush: the first backward comes after min(S - s, M) forwards
            first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
            assert first_b == min(num_stages - s, m), (num_stages, s, m, actions)


def test_gpipe_holds_every_microbatch() -> None:
    for num_stages, m in SHAPES:
        for s in range(num_stages):
            actions = build_schedule("gpipe", num_stages, s, m)
            assert _max_in_flight(actions) == m
            assert [a.kind for a in actions] == ["F"] * m + ["B"] * m


def test_1f1b_uses_less_activation_memory_than_gpipe_when_deep() -> None:
    one_f_one_b, gpipe = build_schedule("1f1b", 4, 0, 8), build_schedule("gpipe", 4, 0, 8)
    assert _max_in_flight(one_f_one_b) == 4 < _max_in_flight(gpipe) == 8


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="schedule"):
        build_schedule("zero-bubble", 2, 0, 4)
