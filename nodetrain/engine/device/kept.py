"""A block's autograd graph kept from its forward to its backward, without its weights.

Owns: :class:`KeptBlock`, the forward of one decoder layer and micro-batch with autograd on
(``stream.recompute``: a kept layer is not recomputed, core/recompute.py) and its backward later.
Does not own which layers are kept (core/recompute.py) or the window's loads (window.py).

A streamed block's weights live in a window slot that the next load overwrites long before the
backward, so the graph must not keep them: its ``saved_tensors_hooks`` keep every saved activation
as is but replace a saved tensor that is (a view of) one of the block's weights by where it lies in
that weight (storage offset, shape, stride). At the backward the block is loaded again (the window's
backward load sequence is unchanged) and each such tensor is re-made, with ``as_strided``, from the
weights that load returns. A resident block takes the same path (its weights do not move).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KeptBlock"]


@dataclass(frozen=True)
class _WeightView:
    """Where a saved tensor lies in weight ``name``: elements from its start, shape, stride."""

    name: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class KeptBlock:
    """One block's forward for one micro-batch with its graph kept, its weights left out of it.

    Args:
        params: the block's weights from ``Window.acquire``: local name -> tensor (compute dtype, on
            the device; views into a slot or resident buffer).

    Use: run the block inside :meth:`hooks` on :attr:`leaves` and :meth:`input`, :meth:`keep` its
    output, later :meth:`backward` with the weights the backward's acquire returns.
    """

    def __init__(self, params: dict[str, torch.Tensor]):
        self.leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        """The weights as autograd leaves (their gradients are the block's weight gradients)."""
        self._spans: dict[int, list[tuple[str, int, int, torch.dtype]]] = {}  # storage -> weights in it
        for k, v in params.items():
            self._spans.setdefault(_storage(v), []).append((k, v.storage_offset(), v.numel(), v.dtype))
        self._bound: dict[str, torch.Tensor] | None = None
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, D] as the graph's input leaf (its gradient is the backward's result)."""
        self._x = x.detach().requires_grad_(True)
        return self._x

    def hooks(self):
        """The context the forward runs in: saved weights dropped, activations kept."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def keep(self, out: torch.Tensor) -> torch.Tensor:
        """Keep the forward's output ``out`` [B, T, D] (its graph); returns it detached, to send on."""
        self._out = out
        return out.detach()

    def _pack(self, t: torch.Tensor):
        for name, start, numel, dtype in self._spans.get(_storage(t), ()):
            if start <= t.storage_offset() < start + numel:
                if t.dtype != dtype:  # a reinterpreting view: keep a copy rather than the slot's bytes
                    return t.clone()
                return _WeightView(name, t.storage_offset() - start, tuple(t.shape), tuple(t.stride()))
        return t

    def _unpack(self, packed):
        if not isinstance(packed, _WeightView):
            return packed
        assert self._bound is not None, "a kept block's weights are unpacked only in its backward"
        w = self._bound[packed.name]
        return w.as_strided(packed.shape, packed.stride, w.storage_offset() + packed.offset)

    def backward(
        self, params: dict[str, torch.Tensor], grad_out: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The block's gradients, without recomputing its forward; frees the graph.

        Args:
            params: the block's weights loaded again (``Window.acquire``; same names and shapes).
            grad_out: [B, T, D] gradient of the kept output, compute dtype on the device.

        Returns:
            (weight gradients by local name, each the weight's shape and dtype; gradient of the
            input [B, T, D]).
        """
        self._bound = params
        try:
            grads = torch.autograd.grad(self._out, [*self.leaves.values(), self._x], grad_out)
        finally:
            self._bound, self._out, self._x = None, None, None
        return dict(zip(self.leaves, grads[:-1], strict=True)), grads[-1]
