"""Pipeline schedules: which stage owns which units, and the order a stage works in, as pure lists.

Owns: the partition of units over stages, the schedules as lists of actions, a step's split into
pipeline rounds, the P2P of each action as groups of paired send/receive that cannot deadlock under
NCCL's in-order semantics (:func:`p2p_groups`), and the peaks those imply (micro-batches in flight,
P2P buffers alive). Pure: no torch, no threads. Does not own moving the tensors (engine/comm/p2p.py)
or what a forward or backward does (engine/stage.py).

Schedules (M micro-batches, S stages):
    gpipe  all M forwards, then all M backwards (GPipe, arXiv:1811.06965);
    1f1b   S - s - 1 warm-up forwards, then one forward / one backward alternating, then the
           remaining backwards (PipeDream-Flush, arXiv:2006.09503; Megatron-LM arXiv:2104.04473).
           Stage s holds at most S - s micro-batches' activations instead of M.
Both have the same bubble fraction (S - 1) / (M + S - 1).

A step of ``grad_accum`` × M micro-batches (step_rounds): 1F1B runs them as ONE round of
grad_accum·M (one fill and drain per step: bubble (S - 1) / (grad_accum·M + S - 1), activations
still bounded by S - s); GPipe keeps grad_accum rounds of M, since one GPipe round holds every
micro-batch's activations (one round of grad_accum·M would hold grad_accum times as many).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from nodetrain.config.batch import microbatches_per_step
from nodetrain.config.constants import SCHEDULES

__all__ = [
    "Action",
    "Transfer",
    "partition",
    "build_schedule",
    "step_rounds",
    "p2p_groups",
    "in_flight_peak",
    "p2p_live_peak",
    "SCHEDULES",
]


@dataclass(frozen=True)
class Transfer:
    """One P2P half: ``op`` "send"/"recv" of ``what`` ("act" forward, "grad" backward) of
    micro-batch ``mb`` with neighbouring stage ``peer``."""

    op: str
    what: str
    mb: int
    peer: int


@dataclass(frozen=True)
class Action:
    """``kind`` is "F" (forward) or "B" (backward) of micro-batch ``mb`` (0-based in the round)."""

    kind: str
    mb: int


def partition(costs: list[int], num_stages: int) -> list[range]:
    """Split units into contiguous stages minimising the largest stage cost.

    Args:
        costs: cost of each unit in order (parameters it computes with).
        num_stages: S, 1 ≤ S ≤ len(costs).

    Returns:
        S contiguous, non-empty ranges of unit indices covering all units.

    Raises:
        ValueError: more stages than units.
    """
    if not 1 <= num_stages <= len(costs):
        raise ValueError(f"cannot split {len(costs)} units into {num_stages} stages")
    return list(_partition(tuple(costs), num_stages))


@functools.lru_cache(maxsize=1024)
def _partition(costs: tuple[int, ...], num_stages: int) -> tuple[range, ...]:
    """:func:`partition`, remembered: the planner asks the same split of each candidate it prices."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max-cost splitting units[:i] into s stages; cut[s][i]: start of the last one
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return tuple(bounds[::-1])


def build_schedule(kind: str, num_stages: int, stage: int, num_microbatches: int) -> list[Action]:
    """The ordered actions of ``stage`` for one pipeline round of ``num_microbatches``.

    Raises:
        ValueError: unknown schedule.
    """
    m = num_microbatches
    if kind == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"pipeline.schedule={kind!r}: use one of {SCHEDULES}")
    warmup = min(num_stages - stage - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions


def step_rounds(kind: str, grad_accum: int, num_microbatches: int) -> tuple[int, int]:
    """How a step of ``grad_accum × num_microbatches`` micro-batches is split into pipeline rounds.

    Args:
        kind: the schedule ("gpipe" or "1f1b").
        grad_accum: accumulation rounds of the config (≥ 1).
        num_microbatches: ``pipeline.microbatches`` (≥ 1).

    Returns:
        (rounds, micro-batches per round): 1F1B ``(1, grad_accum · num_microbatches)``, one fill and
        drain per step with the same activation bound; GPipe ``(grad_accum, num_microbatches)``, so
        its activation memory (every micro-batch of a round) does not grow with ``grad_accum``.

    Raises:
        ValueError: unknown schedule.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline.schedule={kind!r}: use one of {SCHEDULES}")
    if kind == "1f1b":
        return 1, microbatches_per_step(grad_accum, num_microbatches)
    return grad_accum, num_microbatches


def _recv_of(a: Action, stage: int, num_stages: int) -> Transfer | None:
    """The receive ``a`` waits for: a forward the previous stage's activation, a backward the next
    stage's gradient (none on the first / last stage)."""
    if a.kind == "F":
        return Transfer("recv", "act", a.mb, stage - 1) if stage > 0 else None
    return Transfer("recv", "grad", a.mb, stage + 1) if stage < num_stages - 1 else None


def _send_of(a: Action, stage: int, num_stages: int) -> Transfer | None:
    """What ``a`` produces for a neighbour: a forward's activation, a backward's input gradient."""
    if a.kind == "F":
        return Transfer("send", "act", a.mb, stage + 1) if stage < num_stages - 1 else None
    return Transfer("send", "grad", a.mb, stage - 1) if stage > 0 else None


def p2p_groups(actions: list[Action], stage: int, num_stages: int) -> list[tuple[Transfer, ...]]:
    """The P2P of ``stage`` for ``actions``, as groups each posted together (one ``batch_isend_irecv``).

    Group ``k < len(actions)`` is posted just before action ``k``: the send of action ``k - 1``'s
    output and the receive action ``k`` needs. The last group sends the last action's output.
    Pairing a send with the next receive is Megatron-LM's ``send_forward_recv_backward`` /
    ``send_backward_recv_forward`` (arXiv:2104.04473) generalised to every action: NCCL runs a
    rank pair's operations in the order they were posted and ignores tags, so a send posted on
    its own before a receive from the same peer deadlocks in 1F1B's steady state (both stages
    send first); posted as one group, the two complete together. tests/unit/test_pipeline.py checks
    every schedule, 2-8 stages, against a model of those semantics.

    Returns:
        ``len(actions) + 1`` tuples of :class:`Transfer` (each may be empty).
    """
    groups, pending = [], None
    for a in actions:
        need = _recv_of(a, stage, num_stages)
        groups.append(tuple(t for t in (pending, need) if t is not None))
        pending = _send_of(a, stage, num_stages)
    groups.append(() if pending is None else (pending,))
    return groups


def in_flight_peak(actions: list[Action]) -> int:
    """Most micro-batches whose block inputs a stage keeps at once over ``actions`` (forwards done
    minus backwards done, at its highest): 1F1B ``min(S − s, M)``, GPipe ``M``."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


def p2p_live_peak(actions: list[Action], rounds: int, stage: int, num_stages: int) -> int:
    """Most P2P buffers ([B, T, D] each) alive at once on ``stage`` in a step of ``rounds`` ×
    ``actions`` (one round's :func:`build_schedule`), as :class:`P2P` and the engine's round loop
    hold them; what :attr:`P2P.peak_buffers` measures.

    Rules, group by group of :func:`p2p_groups`:

    - a sent output lives while the round loop holds it (until the next action returns) and while
      P2P holds its send: a group with a receive is waited at once; a group of sends only is held
      until a later group receives from the same peer (see :class:`P2P`) or the step ends;
    - a received gradient lives until the next backward's receive replaces it in the loop, or the
      round ends;
    - a received activation is the first block's saved input, counted with the saved inputs
      (:func:`in_flight_peak`), not here.

    The count peaks inside an exchange, once its buffers exist and before its wait releases
    anything: held sends + the one it posts + the loop's last gradient + the one it receives.
    """
    return _p2p_live_peak(tuple(actions), rounds, stage, num_stages)


@functools.lru_cache(maxsize=4096)
def _p2p_live_peak(actions: tuple[Action, ...], rounds: int, stage: int, num_stages: int) -> int:
    """:func:`p2p_live_peak`, remembered: the planner prices each stage's schedule many times."""
    groups = p2p_groups(list(actions), stage, num_stages)
    held: list[int] = []  # peer of each send P2P holds (posted in a group of sends only)
    peak = 0
    for _ in range(rounds):
        start, grad = list(held), False  # grad: the round loop holds a received gradient
        for k, group in enumerate(groups):
            sends = [t.peer for t in group if t.op == "send"]
            recvs = [t for t in group if t.op == "recv"]
            received_grad = any(t.what == "grad" for t in recvs)
            if group:
                peak = max(peak, len(held) + len(sends) + grad + received_grad)
            if recvs:
                held = [p for p in held if p not in {t.peer for t in recvs}]
            else:
                held += sends
            if k < len(actions) and actions[k].kind == "B":
                grad = received_grad
        if held == start:  # the next round starts as this one did: it repeats it, peak and all
            break
    return peak
