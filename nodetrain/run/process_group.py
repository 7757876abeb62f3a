"""The process group of a launch: created once per process (a ``--multirun`` reuses it), and work
done on rank 0 whose result (or refusal) every rank receives.

Owns: choosing the backend and device of a rank (gloo on CPU, NCCL on GPU unless ``dist.backend``
says gloo; local rank r computes on GPU r mod count) and :func:`on_rank0`. Does not own the groups the
engine and the checkpoint make from it (engine/comm/, checkpoint/collective.py).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from nodetrain.run.jobs import REFUSALS

__all__ = ["init_distributed", "on_rank0"]

log = logging.getLogger("nodetrain")


def init_distributed(timeout_s: float, backend: str = "") -> tuple[int, int, int, torch.device]:
    """Init the process group once per process (a multirun reuses it); gloo on CPU, NCCL on GPU
    unless ``backend`` (``dist.backend``) says gloo. No collective or receive waits longer than
    ``timeout_s`` (``dist.timeout_s``).

    Raises:
        ValueError: NCCL with more ranks on the node than GPUs, or NCCL without CUDA.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and (not cuda or local_rank >= torch.cuda.device_count()):
        have = torch.cuda.device_count() if cuda else 0
        raise ValueError(
            f"dist.backend=nccl needs one GPU per rank: LOCAL_RANK={local_rank}, {have} GPU(s); start at "
            "most that many ranks per node, or set dist.backend=gloo to share GPUs"
        )
    if cuda:  # with gloo, ranks may share a GPU: rank i uses GPU i mod count
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m nodetrain.train`: a one-stage pipeline
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(
            backend, device_id=device if backend == "nccl" else None, timeout=timedelta(seconds=timeout_s)
        )
        log.info("process group: %s, world size %d, device %s", backend, dist.get_world_size(), device)
    else:
        log.info("process group: reused (%s, world size %d)", dist.get_backend(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def on_rank0(fn):
    """Run ``fn`` on rank 0 only; every rank gets its result, or raises its error (a refusal as the
    same refusal, see jobs.REFUSALS)."""
    box, error = [None, None, None], None
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as e:  # shared below so that no rank waits forever for rank 0
            error, box[1] = e, f"{type(e).__name__}: {e}"
            box[2] = next((i for i, kind in enumerate(REFUSALS) if isinstance(e, kind)), None)
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[2] is not None:
        raise REFUSALS[box[2]](box[1].split(": ", 1)[1])
    if box[1] is not None:
        raise RuntimeError(f"rank 0 failed: {box[1]}")
    return box[0]
