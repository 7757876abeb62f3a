"""Placement: which of a stage's blocks stay on the device, within its device budget.

Owns: the device budget of a stage (``stream.device_budget`` bytes, or the automatic one: the device
bytes the stage may use minus its window, activations and a margin) and the one rule that chooses the
blocks that fit it, shared by the engine (the memory it finds free) and the planner (a profile's).
Pure. Does not own the buffers or the loads (engine/device/window.py), the bytes
(cost/memory.py) or reading the device's free memory (engine/startup.py).

A resident block costs ``numel × (e + 4)`` device bytes (its compute-dtype weights and an fp32
gradient accumulator, ``cost.memory.resident_bytes_per_param``) and saves, per step, every load of it
but one (``(loads − 1) × numel × e`` H2D) and every gradient offload but one fp32 copy
(``backwards × numel × e − 4 × numel`` D2H; the accumulator leaves once per step). Both directions
run at the host link's speed, so transfer time saved per device byte is ``saved bytes / cost
bytes``; the choice is greedy in that order (ties: block order), after the last stage's head, which
goes first (the stage's largest block, loaded at every use).
"""

from __future__ import annotations

from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.memory import GRAD_ACC_ITEMSIZE, MARGIN_BYTES, StageMemory, resident_bytes_per_param
from nodetrain.cost.shape import ModelShape

__all__ = [
    "AUTO",
    "choose_resident",
    "device_budget_bytes",
    "place_stages",
    "ranks_on_device",
    "resident_blocks",
    "saved_transfer_bytes",
    "stage_budget",
]

AUTO = (-1, "auto")
"""The values of ``stream.device_budget`` that ask for the automatic budget."""


def saved_transfer_bytes(numel: int, itemsize: int, loads: int, backwards: int) -> int:
    """Link bytes per step a block saves by being resident (see the module docstring).

    Args:
        numel: elements the block binds; itemsize: compute-dtype bytes (e).
        loads: its uses in the step's load sequence; backwards: its gradient offloads in the step.
    """
    h2d = max(loads - 1, 0) * numel * itemsize
    d2h = backwards * numel * itemsize - (numel * GRAD_ACC_ITEMSIZE if backwards else 0)
    return h2d + d2h


def choose_resident(
    cost_bytes: dict[int, int], saved_bytes: dict[int, int], budget: int, first=()
) -> list[int]:
    """Blocks to keep resident within ``budget`` device bytes, in block order.

    Greedy: the ``first`` blocks (the last stage's head), then the others by saved bytes per device
    byte, highest first (ties: lower block first); a block that does not fit is skipped.

    Args:
        cost_bytes: block index -> device bytes if resident (weights + fp32 accumulator).
        saved_bytes: block index -> link bytes per step it saves (:func:`saved_transfer_bytes`).
        budget: bytes available; ≤ 0 keeps nothing resident.
        first: blocks tried before the ranking.
    """
    rest = sorted(
        (b for b in cost_bytes if b not in first), key=lambda b: (-saved_bytes[b] / max(cost_bytes[b], 1), b)
    )
    chosen, left = [], budget
    for block in [b for b in first if b in cost_bytes] + rest:
        if 0 < cost_bytes[block] <= left:
            chosen.append(block)
            left -= cost_bytes[block]
    return sorted(chosen)


def device_budget_bytes(free: int, window_bytes: int, activations: int, ranks: int = 1) -> int:
    """The automatic resident budget: this rank's share of ``free`` device bytes (``free // ranks``
    when ``ranks`` processes share the device) minus the window's slots, the activations
    (``cost.memory.stage_memory``) and ``cost.memory.MARGIN_BYTES``, at least 0."""
    return max(0, free // max(ranks, 1) - window_bytes - activations - MARGIN_BYTES)


def ranks_on_device(index: int, local_world_size: int, device_count: int) -> int:
    """How many of the node's ranks compute on CUDA device ``index``: train.py gives local rank r
    the device ``r mod device_count`` (with ``dist.backend=gloo`` several ranks may share one;
    NCCL refuses that), so the ranks r < ``local_world_size`` with r ≡ ``index``. (A launcher showing
    each rank only its own GPU: NCCL is refused by train.py, gloo ranks would count as sharing.)"""
    if device_count < 1:
        return 1
    return max(1, len(range(index, max(local_world_size, 1), device_count)))


def stage_budget(requested, device_bytes: int, streamed: StageMemory) -> int:
    """A stage's resident budget in bytes: ``stream.device_budget`` as given, or for :data:`AUTO` the
    ``device_bytes`` the stage may use minus its window and activations with every block streamed
    (``streamed``, :func:`cost.memory.stage_memory`) and the margin (:func:`device_budget_bytes`).

    Args:
        requested: ``stream.device_budget`` (bytes ≥ 0, -1 or ``auto``).
        device_bytes: device memory this stage may use (0 on the CPU: nothing is resident there by
            default, the "device" is host memory and streaming is what the CPU path exercises).
        streamed: the stage's device memory with nothing resident.
    """
    if requested not in AUTO:
        return int(requested)
    if device_bytes <= 0:
        return 0
    return device_budget_bytes(device_bytes, streamed.window_bytes, streamed.activation_bytes)


def resident_blocks(shape: ModelShape, plan: StepPlan, itemsize: int, budget: int) -> frozenset[int]:
    """The blocks of a stage to keep resident within ``budget`` device bytes (module docstring).

    Args:
        shape: the model; plan: the stage's step (its blocks and their uses, ``StepPlan.uses``).
        itemsize: compute-dtype bytes (e); budget: :func:`stage_budget`'s bytes.
    """
    numel = {i: shape.load_numels[i] for i in plan.blocks}
    uses = plan.uses()
    cost = {i: n * resident_bytes_per_param(itemsize) for i, n in numel.items()}
    saved = {i: saved_transfer_bytes(n, itemsize, *uses[i]) for i, n in numel.items()}
    head = len(shape.unit_numels) - 1
    return frozenset(choose_resident(cost, saved, budget, first=(head,) if head in numel else ()))


def place_stages(
    requested, shape: ModelShape, plans, streamed: list[StageMemory], device_bytes, itemsize: int
) -> tuple[tuple[int, ...], tuple[frozenset[int], ...]]:
    """Every stage's budget (:func:`stage_budget`) and resident blocks (:func:`resident_blocks`).

    Args:
        requested: ``stream.device_budget``; plans: per stage its ``StepPlan``; streamed: per stage its
            device memory with nothing resident; device_bytes: per stage the device memory it may use;
            itemsize: compute-dtype bytes.
    """
    budgets = tuple(stage_budget(requested, d, m) for d, m in zip(device_bytes, streamed, strict=True))
    resident = tuple(resident_blocks(shape, p, itemsize, x) for p, x in zip(plans, budgets, strict=True))
    return budgets, resident
