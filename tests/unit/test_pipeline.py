"""Pure pipeline logic: the stage partition, the schedules and their P2P (milliseconds, no torch.distributed).

``partition`` is checked against brute force over every set of cuts; ``build_schedule`` by
simulating all stages' action lists together with their data dependencies (a forward waits for
the previous stage's activation, a backward for the next stage's gradient); ``p2p_groups`` by
simulating every stage's P2P with NCCL's semantics (``_simulate_nccl``: tags ignored, a rank
pair's operations run in posting order in one queue shared by both directions, a send completes
only when the peer's matching receive is at the head of its queue, a batched group is posted
together), which must finish without deadlock and deliver every message to its own receive for
every depth, micro-batch count and schedule, and must reject the engine's order before issue 13
(isend after each action, a blocking recv before the next: ``_unpaired_groups``, kept as the mutant).
"""

from __future__ import annotations

import itertools
import random

import pytest

from nodetrain.core.schedule import Action, Transfer, build_schedule, p2p_groups, partition, step_rounds

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


# ----------------------------------------------------------------------------- P2P under NCCL semantics


def _unpaired_groups(actions: list[Action], stage: int, num_stages: int) -> list[tuple[Transfer, ...]]:
    """The engine's P2P before issue 13 (the mutant), as its ``_run_round`` did it: a blocking
    ``recv`` before each action that needs one, an ``isend`` on its own after each action that
    produces one."""
    first, last, groups = stage == 0, stage == num_stages - 1, []
    for a in actions:
        if a.kind == "F":
            if not first:
                groups.append((Transfer("recv", "act", a.mb, stage - 1),))
            if not last:
                groups.append((Transfer("send", "act", a.mb, stage + 1),))
        else:
            if not last:
                groups.append((Transfer("recv", "grad", a.mb, stage + 1),))
            if not first:
                groups.append((Transfer("send", "grad", a.mb, stage - 1),))
    return groups


def _simulate_nccl(programs: list[list[tuple[Transfer, ...]]], fifo: str = "pair") -> int:
    """Run every stage's P2P groups (posting order) under NCCL's semantics; returns the matches.

    A stage posts its groups in order; after posting a group with a receive it blocks until the
    whole group completed (the engine needs the data), a group of sends does not block. Each
    ``fifo`` key holds the posted groups in order: ``"pair"`` one queue per (rank, peer), shared by
    both directions (NCCL's P2P communicator of a rank pair, tags ignored); ``"rank"`` one queue per
    rank (``batch_isend_irecv``'s use of the group's communicator: one stream for every peer). An
    operation can complete only when its group is at the head of its queue and the peer's head
    group holds the opposite operation towards it; the first such operation is its match (no
    tags), so a send matched with a different message's receive is an error. A group leaves its
    queues when all its operations completed.

    Raises:
        AssertionError: a deadlock, or a send matched with the receive of another message.
    """
    num = len(programs)
    key = (lambda a, b: (a, b)) if fifo == "pair" else (lambda a, b: (a,))
    queues: dict[tuple, list[tuple[int, int]]] = {}
    left = {(s, k): set(range(len(g))) for s in range(num) for k, g in enumerate(programs[s])}
    pos, matches = [0] * num, 0

    def head_ops(s: int, peer: int):
        q = queues.get(key(s, peer), [])
        if not q:
            return []
        gs, gk = q[0]
        return [(i, t) for i, t in enumerate(programs[gs][gk]) if i in left[(gs, gk)] and t.peer == peer]

    def retire(s: int, k: int) -> None:
        if not left[(s, k)]:
            for q in queues.values():
                if q and q[0] == (s, k):
                    q.pop(0)

    while True:
        progressed = False
        for s in range(num):  # post until a group with a receive is outstanding
            while pos[s] < len(programs[s]):
                k = pos[s]
                if k > 0 and any(t.op == "recv" for t in programs[s][k - 1]) and left[(s, k - 1)]:
                    break
                for t in programs[s][k]:
                    q = queues.setdefault(key(s, t.peer), [])
                    if (s, k) not in q:
                        q.append((s, k))
                pos[s] += 1
                progressed = True
        for s in range(num):
            for peer in (s - 1, s + 1):
                for i, t in head_ops(s, peer):
                    if t.op != "send":
                        continue
                    recvs = [(j, r) for j, r in head_ops(peer, s) if r.op == "recv"]
                    if not recvs:
                        continue
                    j, r = recvs[0]
                    assert (r.what, r.mb) == (t.what, t.mb), (
                        f"stage {s}'s send {t} landed in stage {peer}'s {r}"
                    )
                    gs, gr = queues[key(s, peer)][0], queues[key(peer, s)][0]
                    left[gs].discard(i)
                    left[gr].discard(j)
                    retire(*gs)
                    retire(*gr)
                    matches += 1
                    progressed = True
        if not progressed:
            break
    stuck = {s: programs[s][k] for (s, k), ops in sorted(left.items()) if ops}
    assert not stuck and pos == [len(p) for p in programs], f"deadlock: groups never completed: {stuck}"
    return matches


def _programs(kind: str, num_stages: int, m: int, groups_of=p2p_groups) -> list[list[tuple[Transfer, ...]]]:
    return [groups_of(build_schedule(kind, num_stages, s, m), s, num_stages) for s in range(num_stages)]


@pytest.mark.parametrize("fifo", ["pair", "rank"])
@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_paired_p2p_completes_under_nccl_semantics(kind: str, fifo: str) -> None:
    for num_stages in range(2, 9):
        for m in range(1, 13):
            matches = _simulate_nccl(_programs(kind, num_stages, m), fifo)
            assert matches == 2 * (num_stages - 1) * m, (kind, num_stages, m)  # every act and grad


@pytest.mark.parametrize("fifo", ["pair", "rank"])
def test_forward_only_evaluation_p2p_completes(fifo: str) -> None:
    for num_stages in range(2, 9):
        for n in range(1, 9):
            forwards = [Action("F", i) for i in range(n)]
            programs = [p2p_groups(forwards, s, num_stages) for s in range(num_stages)]
            assert _simulate_nccl(programs, fifo) == (num_stages - 1) * n


def test_unpaired_send_then_recv_deadlocks_1f1b_under_nccl() -> None:
    """The order before issue 13 (isend, then a blocking recv from the same peer) deadlocks in
    1F1B's steady state: stage 0 sends act(1) before receiving grad(0), stage 1 sends grad(0)
    before receiving act(1), and neither send's receive reaches the head of its queue."""
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate_nccl(_programs("1f1b", 2, 2, _unpaired_groups))
    for num_stages in range(2, 9):  # every depth with a steady state (M ≥ 2) deadlocks
        with pytest.raises(AssertionError, match="deadlock"):
            _simulate_nccl(_programs("1f1b", num_stages, num_stages, _unpaired_groups))


def test_nccl_simulation_catches_a_message_landing_in_the_wrong_receive() -> None:
    # stage 1 receives mb 1 first: without tags, mb 0's activation would land there
    programs = [
        [(Transfer("send", "act", 0, 1),), (Transfer("send", "act", 1, 1),)],
        [(Transfer("recv", "act", 1, 0),), (Transfer("recv", "act", 0, 0),)],
    ]
    with pytest.raises(AssertionError, match="landed in"):
        _simulate_nccl(programs)


def test_p2p_groups_pair_each_send_with_the_next_receive() -> None:
    # stage 0 of 2, 1F1B, M=2: F0 F1 B0 B1 → send act0 alone, then (send act1, recv grad0) together
    groups = p2p_groups(build_schedule("1f1b", 2, 0, 2), 0, 2)
    assert groups == [
        (),
        (Transfer("send", "act", 0, 1),),
        (Transfer("send", "act", 1, 1), Transfer("recv", "grad", 0, 1)),
        (Transfer("recv", "grad", 1, 1),),
        (),
    ]
    assert p2p_groups(build_schedule("gpipe", 1, 0, 3), 0, 1) == [()] * 7  # one stage: no P2P


# ----------------------------------------------------------------------------- a step of grad_accum rounds


def _step_programs(kind: str, num_stages: int, grad_accum: int, m: int) -> list[list[tuple[Transfer, ...]]]:
    """Every stage's P2P of one step as the engine posts it: the rounds of ``step_rounds`` one after
    the other, each round's micro-batches numbered after the earlier rounds' (``_run_round``'s base)."""
    rounds, per_round = step_rounds(kind, grad_accum, m)
    programs = []
    for s in range(num_stages):
        groups = p2p_groups(build_schedule(kind, num_stages, s, per_round), s, num_stages)
        shifted = [
            tuple(Transfer(t.op, t.what, r * per_round + t.mb, t.peer) for t in g)
            for r in range(rounds)
            for g in groups
        ]
        programs.append(shifted)
    return programs


def test_step_rounds_merge_accumulation_for_1f1b_only() -> None:
    assert step_rounds("1f1b", 3, 4) == (1, 12)  # one fill and drain per step
    assert step_rounds("gpipe", 3, 4) == (3, 4)  # one round holds every micro-batch's activations
    assert step_rounds("1f1b", 1, 5) == step_rounds("gpipe", 1, 5) == (1, 5)
    with pytest.raises(ValueError, match=r"pipeline\.schedule='zb'"):
        step_rounds("zb", 2, 4)


@pytest.mark.parametrize("fifo", ["pair", "rank"])
@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_a_step_of_accumulated_rounds_completes_under_nccl_semantics(kind: str, fifo: str) -> None:
    for num_stages in range(2, 7):
        for grad_accum in (1, 2, 3):
            for m in range(1, 5):
                programs = _step_programs(kind, num_stages, grad_accum, m)
                matches = _simulate_nccl(programs, fifo)
                assert matches == 2 * (num_stages - 1) * grad_accum * m, (kind, num_stages, grad_accum, m)


def test_one_1f1b_round_per_step_fills_and_drains_once() -> None:
    """Stage 0 of 4, grad_accum 2 × M 4: one warm-up of S - 1 forwards and one drain, not two; the
    activations in flight stay bounded by S."""
    (actions,) = [build_schedule("1f1b", 4, 0, step_rounds("1f1b", 2, 4)[1])]
    kinds = "".join(a.kind for a in actions)
    assert kinds == "FFF" + "FB" * 5 + "BBB"
    assert _max_in_flight(actions) == 4
