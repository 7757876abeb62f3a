"""Pipeline parallelism: which stage owns which units, in what order a stage works, and P2P.

Owns: the partition of units over stages (pure), the schedules as lists of actions (pure), and
the point-to-point transfer of activations and their gradients between neighbouring stages, as
groups of paired send/receive that cannot deadlock under NCCL's in-order semantics (p2p_groups).
Does not own: what a forward or backward of a micro-batch does (stage.py).

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

import time
import weakref
from dataclasses import dataclass

import torch

from nodetrain.config.constants import SCHEDULES
from nodetrain.engine.comm import Comm, P2POp
from nodetrain.run.breakdown import NULL_TIMELINE

__all__ = [
    "Action",
    "Transfer",
    "partition",
    "build_schedule",
    "step_rounds",
    "p2p_groups",
    "in_flight_peak",
    "p2p_live_peak",
    "P2P",
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
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} units into {num_stages} stages")
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
    return bounds[::-1]


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
        return 1, grad_accum * num_microbatches
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
    send first); posted as one group, the two complete together. tests/test_pipeline.py checks
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
    groups = p2p_groups(actions, stage, num_stages)
    held: list[int] = []  # peer of each send P2P holds (posted in a group of sends only)
    peak = 0
    for _ in range(rounds):
        grad = False  # the round loop holds a received gradient
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
    return peak


class P2P:
    """Activations forward (stage s → s+1) and their gradients backward (s+1 → s), in paired groups.

    Each group of :func:`p2p_groups` is posted together through :meth:`Comm.batch_p2p`. A group
    with a receive is waited for (its data is needed next, in the ``bubble`` phase). A group of
    sends only is held until it is known complete: once a later group receiving from the same peer
    was waited (that peer posted the receive of every earlier send no later than it sent what
    arrived, true of ``p2p_groups``' order for every schedule, tests/test_memory.py; so waiting the
    held send returns once its data is through), or as soon as ``is_completed()`` says so (NCCL; a
    gloo send reports completion only once waited), or at :meth:`wait_sends`. So each sent
    activation is let go during the step, not at its end. Tags (``2·mb`` activations,
    ``2·mb + 1`` gradients) match messages on gloo.

    The buffers it sends and the gradients it receives are counted while anything holds them (a
    weak reference each; received activations are the next block's saved inputs, not counted):
    :attr:`peak_buffers` and :attr:`peak_bytes` are their high-water mark since construction
    or :meth:`reset_peak`, which :func:`p2p_live_peak` predicts.

    Args:
        stage, num_stages: this rank's stage and the pipeline depth.
        shape: [B, T, D] of an activation; dtype: the compute dtype.
        comm: the rank's :class:`~nodetrain.engine.comm.Comm` (transfers on ``comm.device_of()``: the CPU
            for gloo, the CUDA device for NCCL).
        ranks: global rank of each stage of this pipeline (a replica, see replicas.py); default
            ``range(num_stages)`` (rank = stage).
        timeline: receives enter its ``bubble`` phase (breakdown.py); default: not timed.
    """

    def __init__(self, stage: int, num_stages: int, shape, dtype: torch.dtype, comm: Comm, ranks=None,
                 timeline=NULL_TIMELINE):  # fmt: skip
        self.stage, self.num_stages = stage, num_stages
        self.ranks = list(range(num_stages)) if ranks is None else list(ranks)
        self.shape, self.dtype, self.comm = tuple(shape), dtype, comm
        self.device = comm.device_of()
        self._sends: list[tuple[int, list]] = []  # (peer rank, works) of groups of sends only
        self._live: list[tuple[weakref.ref, int]] = []  # counted buffers and their bytes
        self.peak_buffers = 0
        """Most counted buffers alive at once (on ``self.device``)."""
        self.peak_bytes = 0
        """Most bytes of counted buffers alive at once."""
        self.timeline = timeline
        self.wait_s = 0.0
        """Seconds spent blocked in receives (bubble + P2P) since :meth:`reset_timer`."""

    def exchange(
        self, group: tuple[Transfer, ...], out: torch.Tensor | None, mb_base: int
    ) -> torch.Tensor | None:
        """Post one group of :func:`p2p_groups`; returns the received tensor, if the group receives.

        Args:
            group: the transfers (micro-batch numbers within the round).
            out: the previous action's output to send ([B, T, D] compute dtype, any device).
            mb_base: index of the round's first micro-batch (tags are per step).

        Returns:
            [B, T, D] in the compute dtype on ``self.device``, or None.
        """
        if not group:
            return None
        ops, buf, counted = [], None, []
        for t in group:
            tag = 2 * (mb_base + t.mb) + (t.what == "grad")
            if t.op == "send":
                data = out.to(self.device).contiguous()
                ops.append(P2POp("send", data, self.ranks[t.peer], tag))
                counted.append(data)
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(P2POp("recv", buf, self.ranks[t.peer], tag))
                counted += [buf] if t.what == "grad" else []
        self._count(counted)
        works = self.comm.batch_p2p(ops)
        if buf is None:
            self._keep(ops[0].peer, works)
            return None
        t0 = time.perf_counter()
        with self.timeline.phase("bubble"):
            for w in works:
                w.wait()
        self.wait_s += time.perf_counter() - t0
        self._release({o.peer for o in ops if o.op == "recv"})
        return buf

    def _count(self, tensors: list[torch.Tensor]) -> None:
        """Start counting ``tensors``; record the high-water mark of the buffers still alive."""
        self._live = [(r, n) for r, n in self._live if r() is not None]
        known = {id(r()) for r, _ in self._live}
        self._live += [(weakref.ref(x), x.nbytes) for x in tensors if id(x) not in known]
        self.peak_buffers = max(self.peak_buffers, len(self._live))
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self._live))

    def reset_peak(self) -> None:
        self.peak_buffers = self.peak_bytes = 0

    def _keep(self, peer: int, works: list) -> None:
        """Hold a group of sends only (to ``peer``), after letting go of those already complete."""
        self._sends = [(p, ws) for p, ws in self._sends if not self._done(ws)] + [(peer, works)]

    def _release(self, peers: set[int]) -> None:
        """A group receiving from ``peers`` completed: every held send to them is matched (see the
        class doc); wait for each (it raises a failed send's error) and let it go."""
        kept = []
        for peer, works in self._sends:
            if peer in peers:
                for w in works:
                    w.wait()
            elif not self._done(works):
                kept.append((peer, works))
        self._sends = kept

    @staticmethod
    def _done(works: list) -> bool:
        if not all(w.is_completed() for w in works):
            return False
        for w in works:
            w.wait()  # returns at once; raises the error of a failed send
        return True

    def wait_sends(self) -> None:
        for _, works in self._sends:
            for w in works:
                w.wait()
        self._sends.clear()

    def reset_timer(self) -> None:
        self.wait_s = 0.0
