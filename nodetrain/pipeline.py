"""Pipeline parallelism: which stage owns which units, in what order a stage works, and P2P.

Owns: the partition of units over stages (pure), the schedules as lists of actions (pure), and
the point-to-point transfer of activations and their gradients between neighbouring stages.
Does not own: what a forward or backward of a micro-batch does (stage.py).

Schedules (M micro-batches, S stages):
    gpipe  all M forwards, then all M backwards (GPipe, arXiv:1811.06965);
    1f1b   S - s - 1 warm-up forwards, then one forward / one backward alternating, then the
           remaining backwards (PipeDream-Flush, arXiv:2006.09503; Megatron-LM arXiv:2104.04473).
           Stage s holds at most S - s micro-batches' activations instead of M.
Both have the same bubble fraction (S - 1) / (M + S - 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nodetrain.breakdown import NULL_TIMELINE

__all__ = ["Action", "partition", "build_schedule", "P2P", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")


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


class P2P:
    """Activations forward (stage s → s+1) and their gradients backward (s+1 → s).

    Sends are asynchronous (``isend``) so neighbouring stages never block on each other. A handle
    holds its tensor until the send completes; completed handles are dropped at each new send, so
    the activations of micro-batches already received downstream are freed during the step, and
    :meth:`wait_sends` waits for the rest. Tags separate micro-batches and directions.

    Args:
        stage, num_stages: this rank's stage and the pipeline depth.
        shape: [B, T, D] of an activation; dtype/device: compute dtype and transfer device
            (CPU for gloo; the CUDA device for NCCL).
        ranks: global rank of each stage of this pipeline (a replica, see replicas.py); default
            ``range(num_stages)`` (rank = stage).
    """

    def __init__(
        self, stage: int, num_stages: int, shape, dtype: torch.dtype, device: torch.device, ranks=None
    ):
        self.stage, self.num_stages = stage, num_stages
        self.ranks = list(range(num_stages)) if ranks is None else list(ranks)
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self._sends: list = []
        self.timeline = NULL_TIMELINE
        """Receives enter its ``bubble`` phase (set by the engine, see breakdown.py)."""
        self.wait_s = 0.0
        """Seconds spent blocked in receives (bubble + P2P) since :meth:`reset_timer`."""

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        t0 = time.perf_counter()
        with self.timeline.phase("bubble"):
            dist.recv(buf, src=src, tag=tag)
        self.wait_s += time.perf_counter() - t0
        return buf

    def _keep(self, work) -> None:
        pending = []
        for w in self._sends:
            if w.is_completed():
                w.wait()  # returns at once; raises the error of a failed send
            else:
                pending.append(w)
        self._sends = [*pending, work]

    def send_activation(self, mb: int, h: torch.Tensor) -> None:
        self._keep(dist.isend(h.contiguous(), dst=self.ranks[self.stage + 1], tag=2 * mb))

    def recv_activation(self, mb: int) -> torch.Tensor:
        return self._recv(self.ranks[self.stage - 1], 2 * mb)

    def send_grad(self, mb: int, g: torch.Tensor) -> None:
        self._keep(dist.isend(g.contiguous(), dst=self.ranks[self.stage - 1], tag=2 * mb + 1))

    def recv_grad(self, mb: int) -> torch.Tensor:
        return self._recv(self.ranks[self.stage + 1], 2 * mb + 1)

    def wait_sends(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends.clear()

    def reset_timer(self) -> None:
        self.wait_s = 0.0
