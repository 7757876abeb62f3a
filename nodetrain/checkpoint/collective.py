"""JSON values exchanged between ranks, on ``torch.distributed``'s object collectives.

Each value crosses as its JSON text (``json.dumps(allow_nan=False)``: a value JSON cannot carry fails
on the sender, before the collective), so what a rank receives is a ``str`` that ``json.loads``
parses: the object collectives pickle only that string, never a structure another process built.
Collectives of the group given (checkpointing's own gloo group: CPU, no device to pick).
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json"]


def broadcast_json(obj: Any, group=None, src: int = 0) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (the others' ``obj`` is ignored).

    Raises:
        ValueError: on ``src``, ``obj`` holds NaN or infinity (not JSON).
        TypeError: on ``src``, ``obj`` is not JSON-serializable.
    """
    box = [json.dumps(obj, allow_nan=False) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return json.loads(box[0])


def all_gather_json(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj``, in the group's rank order, on every rank of ``group``.

    Raises:
        ValueError / TypeError: ``obj`` is not JSON (as :func:`broadcast_json`).
    """
    texts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, json.dumps(obj, allow_nan=False), group=group)
    return [json.loads(t) for t in texts]
