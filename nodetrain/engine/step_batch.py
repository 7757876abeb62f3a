"""A step's micro-batches on the compute device: moved once per step, read on the host once per step.

Owns: the H2D copies of what a stage's actions read of a step (the last stage's labels, the position
ids, the padding a router auxiliary loss leaves out, the first stage's token ids or its streamed
embedding's row indices, see ``StageRunner.first_inputs``): one copy per tensor per step, from pinned
memory and without blocking the host on CUDA; on the CPU the same calls, which return the host
tensor. Also whether each micro-batch is packed, decided on the host so that no device reduction
(transformers' packed-sequence detection, a device sync per call on CUDA) decides it per action.
Does not own: the micro-batch order (core/schedule.py) nor what a stage computes (stage.py).

Shapes: N = micro-batches of this replica's step, B = micro-batch size, T = sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepBatch", "to_device", "packed_microbatches"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` in one copy that does not block the host.

    On CUDA a host tensor is first copied into pinned memory (PyTorch's caching host allocator, which
    keeps the pinned block until the asynchronous copy that reads it has run), then copied with
    ``non_blocking=True`` on the current stream, so later work on that stream sees it. On the CPU the
    same ``.to`` call returns ``t`` itself.

    Args:
        t: any tensor (host or device).
        device: the compute device.

    Returns:
        ``t``'s values on ``device`` (``t`` itself when already there).
    """
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def packed_microbatches(positions: torch.Tensor | None, num_microbatches: int) -> list[bool]:
    """Per micro-batch, whether some row restarts its positions (holds several documents).

    The same rule as transformers' ``find_packed_sequence_indices`` (a new document wherever two
    neighbouring positions do not differ by 1), evaluated on the host for the whole step at once. An
    unpacked micro-batch's attention mask is then built without position ids: the same causal mask.

    Args:
        positions: [N, B, T] int64 on the host, or None (0..T-1 in every row: nothing packed).
        num_microbatches: N.

    Returns:
        N booleans.
    """
    if positions is None:
        return [False] * num_microbatches
    restarts = positions.diff(dim=-1) != 1  # [N, B, T-1]
    return restarts.flatten(1).any(dim=1).tolist()  # a host tensor: read without a scalar per micro-batch


@dataclass(frozen=True)
class StepBatch:
    """What one stage's actions read of a step's N micro-batches, moved once (see :func:`to_device`)."""

    inputs: list
    """First stage: per micro-batch its input (``StageRunner.first_inputs``); else empty."""
    labels: torch.Tensor | None
    """Last stage: [N, B, T] int64 on the device (-100 = no loss); else None."""
    positions: torch.Tensor | None
    """[N, B, T] int64 on the device, or None (0..T-1 in every row)."""
    packed: list[bool]
    """Per micro-batch: some row holds several documents (:func:`packed_microbatches`)."""
    token_mask: torch.Tensor | None = None
    """[N, B, T] bool on the device, False on padding, for a router auxiliary loss; None: none to
    leave out (no padding, or no auxiliary loss to leave it out of)."""

    @classmethod
    def of(cls, runner, inputs, labels, positions, device: torch.device, token_mask=None) -> StepBatch:
        """The step batch of a stage run by ``runner`` (a ``StageRunner``).

        Args:
            inputs, labels: [N, B, T] int64 on the host.
            positions: [N, B, T] int64 on the host, or None.
            device: the compute device.
            token_mask: [N, B, T] bool on the host (False on padding), or None; moved only when the
                model has a router auxiliary loss and some position is padding.
        """
        aux = runner.model.router_aux is not None
        used = token_mask is not None and aux and not bool(token_mask.all())
        return cls(
            runner.first_inputs(inputs) if runner.is_first else [],
            to_device(labels, device) if runner.is_last else None,
            None if positions is None else to_device(positions, device),
            packed_microbatches(positions, inputs.shape[0]),
            to_device(token_mask, device) if used else None,
        )

    def microbatch(self, mb: int) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """(labels [B, T] or None, positions [B, T] or None, packed) of micro-batch ``mb``: views, no copy."""
        labels = None if self.labels is None else self.labels[mb]
        positions = None if self.positions is None else self.positions[mb]
        return labels, positions, self.packed[mb]

    def token_mask_of(self, mb: int) -> torch.Tensor | None:
        """[B, T] bool of micro-batch ``mb`` (False on padding; a view), or None."""
        return None if self.token_mask is None else self.token_mask[mb]
