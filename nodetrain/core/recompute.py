"""Recompute: which decoder layers keep their activations from the forward to the backward.

Owns: the one rule behind ``stream.recompute`` (the engine's ``StageRunner`` keeps the autograd graph
of the layers chosen here and recomputes the others; the cost model prices the same choice through
``StageWork.kept``) and the start-up line saying what ``auto`` became. Pure. Does not own the bytes
(``cost.memory.kept_activation_bytes``), the FLOPs (``cost.compute.block_work``), the device budget
or the resident blocks (placement.py).

- ``true``: every layer is recomputed from its saved input (least memory).
- ``false``: every layer keeps its activations (no recompute at all).
- ``auto``: placement decides residency first (placement.py: weights within the stage's device
  budget); the kept activations take what remains of that budget (``budget − resident bytes``), for
  every micro-batch in flight at once. Layers are kept greedily by recompute FLOPs saved per byte
  kept (ties: lower layer first); the rest are recomputed. On the CPU the automatic device budget is
  0, so every layer is recomputed unless ``stream.device_budget`` is given in bytes; with
  ``stream.offload_activations`` every layer is recomputed (the offload moves saved inputs only;
  ``recompute=false`` with it is refused at start-up, config/checks.py).

Only decoder layers are candidates: the embedding has nothing to recompute (a gather) and the head
takes its gradients in its forward (engine/linear_ce.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from nodetrain.core.schedule import in_flight_peak
from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.compute import block_work
from nodetrain.cost.memory import kept_activation_bytes
from nodetrain.cost.shape import ModelShape

__all__ = ["Recompute", "choose_kept", "decide_recompute", "kept_layers", "layers_of"]


@dataclass(frozen=True)
class Recompute:
    """``stream.recompute`` resolved.

    Attributes:
        kept: per stage, the decoder layers whose activations are kept (not recomputed).
        lines: what ``auto`` (or ``false``) became and why, for the start-up log.
    """

    kept: tuple[frozenset[int], ...]
    lines: tuple[str, ...] = ()


def layers_of(shape: ModelShape, plan: StepPlan) -> list[int]:
    """The stage's decoder layers (block indices 1..L): the candidates for keeping."""
    last = len(shape.unit_numels) - 1
    return [b for b in plan.blocks if 0 < b < last]


def choose_kept(cost_bytes: dict[int, int], saved_flops: dict[int, float], budget: int) -> list[int]:
    """Layers to keep within ``budget`` bytes, in block order: greedy by saved FLOPs per byte,
    highest first (ties: lower block first); a layer that does not fit is skipped.

    Args:
        cost_bytes: layer -> device bytes its kept activations take (all micro-batches in flight).
        saved_flops: layer -> FLOPs per micro-batch its recompute would cost.
        budget: bytes available; ≤ 0 keeps nothing.
    """
    order = sorted(cost_bytes, key=lambda b: (-saved_flops[b] / max(cost_bytes[b], 1), b))
    chosen, left = [], budget
    for block in order:
        if 0 < cost_bytes[block] <= left:
            chosen.append(block)
            left -= cost_bytes[block]
    return sorted(chosen)


def kept_layers(
    shape: ModelShape, plan: StepPlan, budget: int, n: int, t: int, itemsize: int
) -> frozenset[int]:
    """``auto``'s kept layers of one stage: those whose activations, for the most micro-batches the
    stage's step holds at once (W × ``schedule.in_flight_peak`` of its items: 1F1B stage s of S up to
    W·(S − s), GPipe all of a round), fit ``budget`` bytes (:func:`choose_kept`).

    Args:
        shape: the model; plan: the stage's step; budget: device bytes for activations.
        n: tokens per micro-batch (B·T); t: sequence length; itemsize: compute-dtype bytes.
    """
    held = plan.wave * in_flight_peak(plan.step_actions)  # an item in flight holds W micro-batches' graphs
    layers = layers_of(shape, plan)
    cost = {i: held * kept_activation_bytes(shape, i, n, itemsize) for i in layers}
    flops = {i: sum(block_work(shape, i, n, t, itemsize)[0][:2]) for i in layers}
    return frozenset(choose_kept(cost, flops, budget))


def decide_recompute(
    requested,
    shape: ModelShape,
    plans,
    budgets,
    resident_bytes,
    *,
    n: int,
    t: int,
    itemsize: int,
    cpu: bool,
    offload: bool = False,
) -> Recompute:
    """Every stage's kept layers for ``stream.recompute`` (module docstring).

    Args:
        requested: ``stream.recompute`` (True, False or ``"auto"``).
        shape: the model; plans: per stage its ``StepPlan``.
        budgets: per stage its device budget in bytes (placement.py); resident_bytes: per stage the
            bytes its resident blocks take of it (``cost.memory.StageMemory.resident_bytes``).
        n, t, itemsize: tokens per micro-batch, sequence length, compute-dtype bytes.
        cpu: the stages compute on the CPU; offload: ``stream.offload_activations``.
    """
    if requested is True:
        return Recompute(tuple(frozenset() for _ in plans))
    if requested is False:
        kept = tuple(frozenset(layers_of(shape, p)) for p in plans)
        return Recompute(kept, ("stream.recompute=false: every layer keeps its activations (no recompute)",))
    lefts = [max(0, b - r) for b, r in zip(budgets, resident_bytes, strict=True)]
    if offload or (cpu and not any(lefts)):
        why = (
            "with stream.offload_activations=true (which moves saved inputs, not kept activations)"
            if offload
            else "on the CPU (its automatic device budget is 0: give stream.device_budget in bytes)"
        )
        return Recompute(
            tuple(frozenset() for _ in plans), (f"stream.recompute=auto: every layer recomputed {why}",)
        )
    kept = tuple(kept_layers(shape, p, x, n, t, itemsize) for p, x in zip(plans, lefts, strict=True))
    return Recompute(
        kept,
        tuple(
            _auto_line(k, shape, p, kept[k], x, n, itemsize)
            for k, (p, x) in enumerate(zip(plans, lefts, strict=True))
        ),
    )


def _auto_line(stage: int, shape: ModelShape, plan: StepPlan, kept, left: int, n: int, itemsize: int) -> str:
    """What ``auto`` became on one stage, for the start-up log."""
    each = sum(kept_activation_bytes(shape, i, n, itemsize) for i in kept)
    held = plan.wave * in_flight_peak(plan.step_actions)
    return (
        f"stream.recompute=auto on stage {stage}: {len(kept)} of {len(layers_of(shape, plan))} layers keep "
        f"their activations ({each / 1e9:.2f} GB per micro-batch, {held} in "
        f"flight) in the {left / 1e9:.2f} GB the device budget has left after its resident blocks; the "
        "rest are recomputed"
    )
