"""Checks nodetrain.replicas' process groups and gradient sum on a gloo world; started by torchrun.

Not a test itself: ``test_replicas.py`` launches it with 4 ranks laid out as 2 replicas × 2 stages
(rank = replica · 2 + stage) and compares what each rank writes with closed forms:

    python -m torch.distributed.run --nproc_per_node 4 tests/replicas_worker.py <out dir>

Writes ``<out dir>/rank<r>.json``: the node group's broadcast value, and the summed tensors (as
lists) of the in-place (gloo) and the staged, chunked (the NCCL path, here through a CPU buffer)
reductions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nodetrain.replicas import ReplicaGradSum, Topology, node_group


def _grads(rank: int) -> list[torch.Tensor]:
    """Two flat fp32 buffers whose values depend on the rank (sizes not multiples of the chunk)."""
    return [torch.arange(n, dtype=torch.float32) * (rank + 1) + 0.25 * rank for n in (11, 5)]


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topo = Topology(rank, num_stages=2, num_replicas=dist.get_world_size() // 2, local_rank=rank % 2)
    value = [f"store of node {topo.replica}" if topo.local_rank == 0 else None]
    dist.broadcast_object_list(value, src=topo.node_root, group=node_group(topo))
    in_place = _grads(rank)
    ReplicaGradSum(topo)(in_place)
    staged = _grads(rank)
    ReplicaGradSum(topo, staging=torch.device("cpu"), chunk_numel=4)(staged)
    result = {
        "stage": topo.stage,
        "replica": topo.replica,
        "broadcast": value[0],
        "in_place": [g.tolist() for g in in_place],
        "staged": [g.tolist() for g in staged],
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
