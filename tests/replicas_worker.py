"""Checks nodetrain.engine.replicas' process groups and gradient sum on a gloo world; started by torchrun.

Not a test itself: ``test_replicas.py`` launches it with 4 ranks laid out as 2 replicas × 2 stages
(rank = replica · 2 + stage) and compares what each rank writes with closed forms:

    python -m torch.distributed.run --nproc_per_node 4 tests/replicas_worker.py <out dir>

Writes ``<out dir>/rank<r>.json``: the node group's broadcast value, the summed tensors (as
lists) of the in-place (gloo) and the staged, chunked (the NCCL path, here through a CPU buffer)
reductions, the timeout (s) each subgroup's gloo backend was created with (the world's is
``WORLD_TIMEOUT_S``, the groups are given ``GROUP_TIMEOUT_S``), and on rank 0 how long an
all-reduce in its stage group waited for a peer that never joined (``HANG_TIMEOUT_S`` groups).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nodetrain.core.topology import Topology
from nodetrain.engine.comm.replicas import ReplicaGradSum, node_group, stage_group
from nodetrain.run.jobs import exit_process

WORLD_TIMEOUT_S = 120.0
GROUP_TIMEOUT_S = 77.0
HANG_TIMEOUT_S = 2.0


def _grads(rank: int) -> list[torch.Tensor]:
    """Two flat fp32 buffers whose values depend on the rank (sizes not multiples of the chunk)."""
    return [torch.arange(n, dtype=torch.float32) * (rank + 1) + 0.25 * rank for n in (11, 5)]


def _timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout the group's gloo backend was created with (torch keeps it in its options)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _hang_wait_s(topo: Topology) -> float | None:
    """Rank 0 all-reduces in its stage group (ranks 0 and 2) while rank 2 never joins but stays
    alive; returns the seconds until that failed (None on other ranks)."""
    group = stage_group(topo, HANG_TIMEOUT_S)
    if topo.rank != 0:
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.zeros(1), group=group)
    except RuntimeError:
        return time.monotonic() - t0
    raise AssertionError("an all-reduce without its peer returned")


def main(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    check(out_dir)
    dist.destroy_process_group()


def check(out_dir: str) -> None:
    """The checks, in a gloo world of 4 ranks that is up (created with ``WORLD_TIMEOUT_S``): writes
    ``<out dir>/rank<r>.json``. parity_worker.py runs them too, before its runs, when given a spec
    ``{"replicas_check": "<out dir>"}`` (the two-node launch of test_replicas.py)."""
    rank = dist.get_rank()
    topo = Topology(rank, num_stages=2, num_replicas=dist.get_world_size() // 2, local_rank=rank % 2)
    value = [f"store of node {topo.replica}" if topo.local_rank == 0 else None]
    dist.broadcast_object_list(value, src=topo.node_root, group=node_group(topo, GROUP_TIMEOUT_S))
    in_place = _grads(rank)
    ReplicaGradSum(topo, GROUP_TIMEOUT_S)(in_place)
    staged = _grads(rank)
    ReplicaGradSum(topo, GROUP_TIMEOUT_S, staging=torch.device("cpu"), chunk_numel=4)(staged)
    result = {
        "stage": topo.stage,
        "replica": topo.replica,
        "broadcast": value[0],
        "in_place": [g.tolist() for g in in_place],
        "staged": [g.tolist() for g in staged],
        "timeouts_s": {
            "world": _timeout_s(dist.group.WORLD),
            "node": _timeout_s(node_group(topo, GROUP_TIMEOUT_S)),
            "stage": _timeout_s(stage_group(topo, GROUP_TIMEOUT_S)),
        },
        "hang_wait_s": _hang_wait_s(topo),
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # rank 2 waits here (world timeout) while rank 0's stage-group all-reduce times out


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # skip the interpreter's teardown: ~0.8 s of CPU per rank (run/jobs.py)
