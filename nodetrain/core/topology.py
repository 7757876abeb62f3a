"""Where a rank sits: its stage in its replica's pipeline, and its replica's share of the batch.

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

Owns: :class:`Topology` and :func:`replica_slice` (pure). Does not own the process groups or the
cross-replica gradient sum (engine/comm/replicas.py).

Why, and one step across replicas: docs/design.md#across-replicas and docs/launch.md#several-nodes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Topology", "replica_slice"]


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
