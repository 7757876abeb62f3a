"""One stage's forward and backward of a micro-batch over its streamed blocks.

Owns: running the stage's blocks in order (forward, no autograd graph kept) and in reverse
(backward: recompute each block from its saved input, then take gradients of its input and
weights), the saved inputs of in-flight micro-batches, and the token-weighted loss on the last
stage. Does not own: the window mechanics (stream.py) or the order of micro-batches
(pipeline.py).

Shapes: B = micro-batch size, T = sequence length, D = hidden, V = vocab.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from nodetrain.model import HFModel
from nodetrain.stream import Window

__all__ = ["StageRunner", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32; labels equal to -100 are ignored."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@contextlib.contextmanager
def _replay_rng(rng):
    """Replays the forward's dropout masks during recompute (as torch.utils.checkpoint does)."""
    if rng is None:
        yield
        return
    devices = [torch.cuda.current_device()] if rng[1] is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1])
        yield


class StageRunner:
    """Forward/backward of micro-batches through the blocks ``blocks`` (contiguous, in order).

    Args:
        model: the HF adapter (templates, no weights).
        blocks: this stage's block indices.
        window: the streaming window over exactly these blocks.
        compute_dtype: dtype of activations and device math.
    """

    def __init__(self, model: HFModel, blocks: range, window: Window, compute_dtype: torch.dtype):
        self.model, self.blocks, self.window = model, list(blocks), window
        self.dtype = compute_dtype
        self.is_first = self.blocks[0] == 0
        self.is_last = self.blocks[-1] == len(model.units) - 1
        self._saved: dict[int, list] = {}  # mb -> [(block input, rng state)] per block

    def forward(
        self,
        mb: int,
        x: torch.Tensor,
        labels: torch.Tensor | None,
        keep: bool = True,
        position_ids: torch.Tensor | None = None,
    ):
        """Forward micro-batch ``mb``.

        Args:
            x: first stage: input ids [B, T] int64; others: hidden [B, T, D] compute dtype.
            labels: last stage: [B, T] int64 next-token ids (-100 = ignore); else None.
            keep: save block inputs for a later :meth:`backward` (False for evaluation).
            position_ids: [B, T] int64 (packed documents restart at 0), or None (0..T-1).

        Returns:
            hidden [B, T, D] to send on, or on the last stage the summed token loss (fp32 scalar).
        """
        saved, ctx = [], None
        with torch.no_grad():
            for block in self.blocks:
                params = self.window.acquire(block)
                if ctx is None and block != 0:
                    ctx = self.model.context(x, position_ids)
                rng = self._rng_state()
                saved.append((x, rng))
                x = self.model.forward_block(block, params, x, ctx)
                self.window.release()
        if keep:
            self._saved[mb] = saved
        return _cross_entropy_sum(x, labels) if self.is_last else x

    def backward(
        self,
        mb: int,
        grad_out: torch.Tensor | None,
        labels=None,
        loss_scale: float = 1.0,
        position_ids: torch.Tensor | None = None,
    ):
        """Backward micro-batch ``mb``: recompute each block, offload its weight gradients.

        Args:
            grad_out: gradient of the stage output [B, T, D] (None on the last stage).
            labels: last stage: the same labels as in forward.
            loss_scale: last stage: 1 / (valid tokens of the whole step), so the summed gradient
                is that of the token-weighted mean loss over all micro-batches.
            position_ids: the same as in forward.

        Returns:
            gradient of the stage input [B, T, D], or None on the first stage.
        """
        saved = self._saved.pop(mb)
        ctx = None
        for block in reversed(self.blocks):
            params = self.window.acquire(block)
            x, rng = saved.pop()
            if ctx is None and block != 0:
                ctx = self.model.context(x, position_ids)
            grad_out = self._backward_block(block, params, x, rng, ctx, grad_out, labels, loss_scale)
            self.window.release()
        return grad_out

    def _backward_block(self, block, params, x, rng, ctx, grad_out, labels, loss_scale):
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        x_in = x.detach().requires_grad_(x.is_floating_point())
        with torch.enable_grad(), _replay_rng(rng):
            out = self.model.forward_block(block, leaves, x_in, ctx)
            if block == self.blocks[-1] and self.is_last:
                out, grad_out = _cross_entropy_sum(out, labels) * loss_scale, None
        inputs = list(leaves.values()) + ([x_in] if x_in.requires_grad else [])
        grads = torch.autograd.grad(out, inputs, grad_out)
        self.window.offload(block, dict(zip(leaves, grads[: len(leaves)], strict=True)))
        return grads[len(leaves)] if x_in.requires_grad else None

    def _rng_state(self):
        if not self.model.has_dropout:
            return None
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return torch.get_rng_state(), cuda
