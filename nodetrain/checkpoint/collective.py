"""JSON values exchanged between ranks as byte tensors, so checkpointing never pickles anything.

(``torch.distributed``'s ``*_object`` collectives pickle; the values here are plain JSON, and
keeping them JSON end to end means no rank ever unpickles bytes another process produced.)
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json"]


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, allow_nan=False).encode()), dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    return json.loads(t.numpy().tobytes().decode())


def broadcast_json(obj: Any, group=None, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (the others' ``obj`` is ignored)."""
    data = _encode(obj) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if dist.get_rank() != src:
        data = torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.broadcast(data, src=src, group=group)
    return _decode(data)


def all_gather_json(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    data = _encode(obj)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [_decode(t[: int(s)]) for t, s in zip(out, sizes, strict=True)]
