"""Counts, on the calling thread, what would stall the host on a GPU: scalar reads and data moves.

Not a benchmark itself: ``gpu_syncs.py`` and ``tests/parity/test_step_syncs.py`` use it. Inside
``with SyncCounter() as c:`` it counts, on this thread only (torch's function and dispatch modes
are thread-local, so the window's copy workers and the optimizer thread are not counted):

- ``scalar_reads``: ``aten._local_scalar_dense`` calls (``.item()``, ``float(t)``, ``bool(t)``, an
  ``if`` on a tensor): on CUDA each waits for the device (a sync) when the tensor lives there.
- ``data_moves``: ``.to(<device>)``, ``.cuda()`` and ``.copy_`` calls on integer or bool tensors
  (token ids, labels, position ids, row indices, masks: the step's data; weights, activations
  and gradients are floating and belong to the window and P2P). On CUDA each such move from
  pageable memory blocks the host; on the CPU the call is a no-op, but it is issued all the same
  (the CPU path runs the CUDA path's control flow), so counting calls sees the same structure.

``sites`` maps where each count comes from (the two innermost frames outside torch) to its count.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter"]

_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_)


def _site(depth: int = 2) -> str:
    """``dir/file:line`` of the ``depth`` innermost frames outside torch and this file, innermost
    first, joined by `` < `` (the second says who called a helper such as ``to_device``)."""
    frame, found = sys._getframe(2), []
    while frame is not None and len(found) < depth:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("_sync_count.py"):
            found.append(f"{'/'.join(name.split('/')[-2:])}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(found) or "?"


def _names_a_device(args, kwargs) -> bool:
    """Whether a ``.to`` call's arguments give a device (``.to(dtype)`` alone moves nothing)."""
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


class _Scalars(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counter._add("scalar_reads")
        return func(*args, **(kwargs or {}))


class _Moves(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES:
            src = args[1] if func is torch.Tensor.copy_ else args[0]
            if isinstance(src, torch.Tensor) and not (src.is_floating_point() or src.is_complex()):
                if func is not torch.Tensor.to or _names_a_device(args, kwargs):
                    self.counter._add("data_moves")
        return func(*args, **kwargs)


class SyncCounter:
    """``with SyncCounter() as c:`` … then ``c.counts`` (``scalar_reads``, ``data_moves``) and
    ``c.sites`` (``(kind, "file:line") -> count``); see the module docstring."""

    def __init__(self):
        self.counts: Counter = Counter({"scalar_reads": 0, "data_moves": 0})
        self.sites: Counter = Counter()
        self._modes = (_Moves(self), _Scalars(self))

    def _add(self, kind: str) -> None:
        self.counts[kind] += 1
        self.sites[(kind, _site())] += 1

    def __enter__(self) -> SyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def report(self) -> dict:
        """Counts and sites as plain JSON-able dicts."""
        sites: dict[str, dict[str, int]] = {}
        for (kind, where), n in sorted(self.sites.items()):
            sites.setdefault(kind, {})[where] = n
        return {**dict(self.counts), "sites": sites}
