"""Data parallelism across nodes: which replica and stage a rank is, and summing gradients between replicas.

``torchrun --nnodes K --nproc_per_node P`` starts K·P ranks. A **replica** is one node's P ranks,
a whole P-stage pipeline with its own host store; the K replicas train on disjoint slices of the
same global batch and apply the same update, so their weights stay identical.

Rank mapping. torchrun's agent gives the workers of the node with group rank g the global ranks
``[g·P, g·P + P)`` in local-rank order (``SimpleElasticAgent._assign_worker_ranks``: a node's base
rank is the sum of the local world sizes before it), so with P ranks on every node::

    stage   = LOCAL_RANK                  replica = GROUP_RANK          RANK = replica · P + stage

``GROUP_RANK`` equals ``--node_rank`` with the static rendezvous; with ``c10d`` it is the order in
which the nodes joined, which is just as good: only the mapping above must hold, and
:meth:`Topology.from_env` checks it.

Owns: the :class:`Topology` (pure), the per-node and per-stage process groups, the batch slice
and the cross-replica gradient sum. Does not own: P2P inside a replica (pipeline.py, given
:attr:`Topology.pipeline_ranks`), the store (store.py) or the step's order (engine.py).

Why, and one step across replicas: docs/design.md#across-replicas and docs/launch.md#several-nodes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nodetrain.engine.comm import Comm

__all__ = ["Topology", "replica_slice", "node_group", "stage_group", "ReplicaGradSum"]


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: stage ``stage`` of the pipeline of replica ``replica``.

    Attributes:
        rank: global rank, ``replica · num_stages + stage``.
        num_stages: P, stages per pipeline = ranks per node.
        num_replicas: K, pipelines = nodes.
        local_rank: rank on the node (local rank 0 creates the node's host store).
    """

    rank: int
    num_stages: int
    num_replicas: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        p, k = self.num_stages, self.num_replicas
        assert p >= 1 and k >= 1 and 0 <= self.rank < p * k, self

    @property
    def stage(self) -> int:
        return self.rank % self.num_stages

    @property
    def replica(self) -> int:
        return self.rank // self.num_stages

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    def rank_of(self, replica: int, stage: int) -> int:
        """Global rank of ``stage`` in ``replica``."""
        return replica * self.num_stages + stage

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this replica's stages, in stage order (P2P peers)."""
        return [self.rank_of(self.replica, s) for s in range(self.num_stages)]

    @property
    def stage_ranks(self) -> list[int]:
        """Global ranks owning this rank's units, one per replica (the gradient-sum group)."""
        return [self.rank_of(r, self.stage) for r in range(self.num_replicas)]

    @property
    def node_root(self) -> int:
        """Global rank of this node's local rank 0 (stage 0 of this replica)."""
        return self.rank_of(self.replica, 0)

    @classmethod
    def single(cls, rank: int, world_size: int, local_rank: int | None = None) -> Topology:
        """One pipeline over the whole world (one node): stage = rank."""
        return cls(rank, world_size, 1, rank if local_rank is None else local_rank)

    @classmethod
    def from_env(cls, num_stages: int = 0, env: Mapping[str, str] | None = None) -> Topology:
        """The topology of this torchrun rank, from the variables torchrun sets.

        Args:
            num_stages: ``pipeline.stages``; 0 = the ranks per node (``LOCAL_WORLD_SIZE``).
            env: the environment (default ``os.environ``); outside torchrun: rank 0 of 1.

        Raises:
            ValueError: the stages are not the ranks per node, or the ranks are not laid out
                node by node (nodes started with different ``--nproc_per_node``).
        """
        env = os.environ if env is None else env
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        local_rank = int(env.get("LOCAL_RANK", str(rank)))
        per_node = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        stages = num_stages or per_node
        if stages != per_node or world % per_node:
            raise ValueError(
                f"pipeline.stages={num_stages}: {stages} stages, but torchrun started {per_node} ranks per "
                f"node ({world} in all); one replica of the pipeline runs per node, so launch with "
                f"torchrun --nproc_per_node {stages} on every node, or set pipeline.stages=0"
            )
        group_rank = int(env.get("GROUP_RANK", str(rank // per_node)))
        if rank != group_rank * per_node + local_rank:
            raise ValueError(
                f"RANK={rank} is not GROUP_RANK·LOCAL_WORLD_SIZE + LOCAL_RANK = {group_rank}·{per_node} + "
                f"{local_rank}: nodes must all run --nproc_per_node {per_node} under one torchrun rendezvous"
            )
        return cls(rank, stages, world // stages, local_rank)


def replica_slice(num_items: int, replica: int, num_replicas: int) -> slice:
    """Replica ``replica``'s contiguous share of ``num_items`` micro-batches.

    ``[r·N//K, (r+1)·N//K)``: equal shares when K divides N (training, validated at start-up);
    otherwise shares differ by at most one and may be empty (evaluation of a fixed set).
    """
    return slice(replica * num_items // num_replicas, (replica + 1) * num_items // num_replicas)


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
