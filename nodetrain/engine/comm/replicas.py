"""Data parallelism across nodes: the per-node and per-stage process groups, and summing gradients
between the replicas of a stage.

Owns: the process groups (created once per layout), the cross-replica gradient sum. Does not own:
where a rank sits (core/topology.py), P2P inside a replica (p2p.py, given
:attr:`Topology.pipeline_ranks`), the store (store.py) or the step's order (engine.py).

Why, and one step across replicas: docs/design.md#across-replicas and docs/launch.md#several-nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from nodetrain.core.topology import Topology
from nodetrain.engine.comm.comm import Comm

__all__ = ["node_group", "stage_group", "ReplicaGradSum"]


# One set of subgroups per process, layout and timeout: a Hydra multirun reuses them job after
# job, and ``new_group`` must be entered by every rank in the same order, which a cache keyed by
# the layout and the timeout (identical on every rank) guarantees.
_GROUPS: dict[tuple[str, int, int, float], dist.ProcessGroup] = {}


def _subgroup(
    kind: str, topo: Topology, members: Sequence[Sequence[int]], timeout_s: float
) -> dist.ProcessGroup | None:
    if topo.num_replicas == 1:
        return None  # one pipeline: the default group is the node group, and there is nothing to sum
    key = (kind, topo.num_stages, topo.num_replicas, timeout_s)
    if key not in _GROUPS:
        # A subgroup does not inherit the default group's timeout (torch gives it its own default,
        # 30 min on gloo, 10 on NCCL): pass ``dist.timeout_s`` so a hang here ends as elsewhere.
        timeout = timedelta(seconds=timeout_s)
        _GROUPS[key], _ = dist.new_subgroups_by_enumeration([list(m) for m in members], timeout=timeout)
    return _GROUPS[key]


def node_group(topo: Topology, timeout_s: float) -> dist.ProcessGroup | None:
    """The ranks of this node (its replica); ``None`` (the default group) for one replica.

    Collective: every rank of the world must call it, in the same order as :func:`stage_group`.

    Args:
        topo: this rank's topology.
        timeout_s: seconds a collective in the group may wait before it fails (``dist.timeout_s``,
            as given to ``init_process_group``).
    """
    members = [[topo.rank_of(r, s) for s in range(topo.num_stages)] for r in range(topo.num_replicas)]
    return _subgroup("node", topo, members, timeout_s)


def stage_group(topo: Topology, timeout_s: float, kind: str = "stage") -> dist.ProcessGroup | None:
    """The ranks owning the same stage, one per node; ``None`` for one replica (nothing to sum).

    Collective: every rank of the world must call it, in the same order as :func:`node_group`.

    Args:
        topo: this rank's topology.
        timeout_s: seconds a collective in the group may wait before it fails (``dist.timeout_s``).
        kind: a cache key: each kind is a separate set of communicators over the same ranks.
    """
    members = [[topo.rank_of(r, s) for r in range(topo.num_replicas)] for s in range(topo.num_stages)]
    return _subgroup(kind, topo, members, timeout_s)


class ReplicaGradSum:
    """Sums gradient accumulators in host memory over the replicas, in place, identically everywhere.

    On gloo (CPU) the host buffers are all-reduced directly. NCCL reduces only device memory, so
    there each buffer goes through a device staging buffer of ``chunk_numel`` fp32 elements
    (H2D, all-reduce, D2H per chunk). All-reduce leaves the same bits on every member, so the K
    replicas go on to identical AdamW updates.

    Args:
        topo: this rank's topology.
        timeout_s: seconds the all-reduce may wait for the other replicas (``dist.timeout_s``).
        comm: the rank's :class:`~nodetrain.engine.comm.Comm` (checks every all-reduce's device); default
            a CPU one.
        staging: device of the staging buffer; default: the group's device when that is not the
            CPU (NCCL), else ``None``, which reduces the host buffers in place (gloo).
        chunk_numel: elements per staged chunk (default 16 Mi = 64 MiB of fp32).
        kind: names the stage group; a different ``kind`` gets a communicator of its own (the
            optimizer thread's "stage_optim": NCCL documents concurrent use of one communicator
            from two threads as a deadlock hazard). Created in the same order on every rank.
    """

    def __init__(
        self,
        topo: Topology,
        timeout_s: float,
        comm: Comm | None = None,
        staging: torch.device | None = None,
        chunk_numel: int = 1 << 24,
        kind: str = "stage",
    ):
        self.num_replicas = topo.num_replicas
        self.group = stage_group(topo, timeout_s, kind)
        self._comm = comm or Comm(torch.device("cpu"))
        if staging is None and self.num_replicas > 1 and self._comm.device_of(self.group).type != "cpu":
            staging = self._comm.device_of(self.group)
        self._staging = staging
        self._chunk_numel = chunk_numel
        self._buffer: torch.Tensor | None = None

    def __call__(self, grads: Sequence[torch.Tensor]) -> None:
        """Replace each tensor by its sum over the replicas.

        Args:
            grads: flat fp32 host tensors (this stage's unit accumulators), the same sizes and
                order on every replica.
        """
        if self.num_replicas == 1:
            return
        for g in grads:
            if self._staging is None:
                self._comm.all_reduce(g, self.group)
            else:
                self._staged(g)

    def _staged(self, g: torch.Tensor) -> None:
        if self._buffer is None:
            self._buffer = torch.empty(self._chunk_numel, dtype=torch.float32, device=self._staging)
        for lo in range(0, g.numel(), self._chunk_numel):
            part = g[lo : lo + self._chunk_numel]
            buf = self._buffer[: part.numel()]
            buf.copy_(part, non_blocking=True)
            self._comm.all_reduce(buf, self.group)
            part.copy_(buf)  # blocking D2H: the buffer is reused by the next chunk
