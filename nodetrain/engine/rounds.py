"""One pipeline round of a stage: its actions in order, each over one item (a wave of micro-batches).

Owns: walking a round's actions (core/schedule.py) with their paired P2P groups (``p2p_groups``),
turning each action's item into its W micro-batches (``pipeline.wave``; W = 1: one micro-batch per
item, exactly the per-micro-batch pipeline) and calling the stage runner's wave forward or backward
on them; an item's P2P message is its W micro-batches' activations or gradients stacked as one
[W, B, T, D] tensor (one ``batch_isend_irecv`` group per exchange, as for W = 1). Does not own the
schedule (core/), what a forward or backward computes (stage.py) or moving the tensors (comm/p2p.py).

Shapes: W = micro-batches per item, B = micro-batch size, T = sequence length, D = hidden.
"""

from __future__ import annotations

import torch

from nodetrain.core.schedule import p2p_groups

__all__ = ["run_round"]


def _split(got: torch.Tensor, wave: int, device: torch.device) -> list[torch.Tensor]:
    """A received item ([B, T, D] for W = 1, else [W, B, T, D]) as W tensors [B, T, D] on ``device``."""
    got = got.to(device)
    return [got] if wave == 1 else list(got.unbind(0))


def _join(outs: list):
    """An item's outputs (W tensors [B, T, D], or Nones) as its P2P message: the one tensor for W = 1,
    else stacked [W, B, T, D]; None when there is nothing to send (the first stage's backward)."""
    if outs[0] is None or len(outs) == 1:
        return outs[0]
    return torch.stack(outs)


def run_round(stage, actions, r: int, batch, loss_scale: float, train: bool, loss_sum, wave: int = 1) -> None:
    """Run one pipeline round's ``actions`` on ``stage``; the last stage adds each micro-batch's summed
    token loss into ``loss_sum`` (an fp64 scalar on the device, read on the host once per step).

    Args:
        stage: the rank's engine (its ``runner``, ``p2p``, ``stage``, ``num_stages``, ``device``).
        actions: one round's actions over items (``StepPlan.actions``); r: the round (0-based).
        batch: the step's micro-batches on the device (``StepBatch``).
        loss_scale: 1 / valid tokens of the whole step (training), 1.0 for an evaluation.
        train: keep what the backward needs and offload gradients (False: evaluation).
        loss_sum: fp64 scalar on the device.
        wave: W, micro-batches per item (item k of the step: micro-batches kW … kW+W−1).
    """
    runner, p2p, device = stage.runner, stage.p2p, stage.device
    base = r * sum(a.kind == "F" for a in actions)  # items of the earlier rounds
    groups = p2p_groups(actions, stage.stage, stage.num_stages)  # paired send/recv: NCCL-safe order
    out = None
    for a, group in zip(actions, groups[:-1], strict=True):
        got = p2p.exchange(group, out, base, wave)
        mbs = [(base + a.mb) * wave + j for j in range(wave)]
        views = [batch.microbatch(mb) for mb in mbs]  # views of the step's device copies
        pos, packed = [v[1] for v in views], [v[2] for v in views]
        masks = [batch.token_mask_of(mb) for mb in mbs]
        if a.kind == "F":
            xs = [batch.inputs[mb] for mb in mbs] if runner.is_first else _split(got, wave, device)
            labels = [v[0] for v in views]
            outs = runner.forward_wave(mbs, xs, labels, train, pos, loss_scale, packed, masks)
            if runner.is_last:
                for loss in outs:
                    loss_sum += loss  # on the device: no sync per micro-batch
        else:
            grads = [None] * wave if runner.is_last else _split(got, wave, device)
            outs = runner.backward_wave(mbs, grads, pos, packed, masks)
        out = _join(outs)
    p2p.exchange(groups[-1], out, base, wave)
