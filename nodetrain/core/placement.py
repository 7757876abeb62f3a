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

A resident block may also keep its units' optimizer on the device (``optim.on_device``): fp32 master
weights, ``exp_avg``, ``exp_avg_sq`` and the fp32 gradient, ``numel × (e + 16)`` device bytes in all
(``cost.memory.on_device_bytes_per_param``), updated there, with no host traffic per step: it saves
the fp32 gradient's D2H (4), the reload after the host update (e), the host accumulation (8) and the
host AdamW (``cost.traffic.optimizer_bytes_per_param``) per parameter, for 12 more device bytes.
``true``: every resident block takes it, charged at ``e + 16`` within the budget; ``false``: none;
``auto``: the blocks resident as above, then as many of them as the budget left holds, largest host
bytes saved per device byte first. That ratio is the same for every block (every term is ∝ numel),
so the ties go in block order: the first blocks' host updates finish last in the backward and are
the first the next forward waits for. A tied embedding read by two stages (tied, ``num_stages > 1``)
keeps its optimizer on the host (its two gradients meet there), and so do block 0 and the head that
binds it; on one stage the two stay or go together (their gradients are summed on the device).

A streamed block may keep its fp32 gradient accumulator on the device (``stream.grad_on_device``,
:func:`grad_blocks`): ``4 × numel`` device bytes; its weights still load at every pass, but its
gradient leaves once per step (``4 × numel`` D2H and an ``8 × numel`` host copy) instead of after every
backward (``backwards × numel × e`` D2H and the host's fp32 adds; ``cost.traffic.block_traffic``).
``true``: every streamed block, beyond the device budget (the automatic budget leaves all the stage's
accumulators out first, :attr:`core.fit.NodeFit.grad_on_device`: conservative by 4 bytes per resident
parameter, whose accumulator is also in its ``e + 4``; :func:`check_grad_fit` refuses a device that
cannot hold them); ``false``: none; ``auto``: after the resident blocks, within what the budget has
left, the streamed blocks that save host bytes, most saved per device byte first (ties: block order).
"""

from __future__ import annotations

from nodetrain.config.schema import ConfigError
from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.memory import (
    GRAD_ACC_ITEMSIZE,
    MARGIN_BYTES,
    StageMemory,
    on_device_bytes_per_param,
    resident_bytes_per_param,
)
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.traffic import block_traffic, optimizer_bytes_per_param

__all__ = [
    "AUTO",
    "check_grad_fit",
    "choose_on_device",
    "grad_blocks",
    "choose_resident",
    "on_device_request",
    "optimizer_blocks",
    "device_budget_bytes",
    "place_stages",
    "ranks_on_device",
    "resident_blocks",
    "saved_host_bytes",
    "saved_transfer_bytes",
    "stage_budget",
]

AUTO = (-1, "auto")
"""The values of ``stream.device_budget`` that ask for the automatic budget."""


def saved_transfer_bytes(numel: int, itemsize: int, loads: int, backwards: int, wave: int = 1) -> int:
    """Link bytes per step a block saves by being resident (see the module docstring).

    Args:
        numel: elements the block binds; itemsize: compute-dtype bytes (e).
        loads: its uses in the step's load sequence; backwards: its backwards (micro-batches) in the step.
        wave: W, micro-batches per item: with W > 1 a streamed block ships one fp32 wave sum per
            backward item (``backwards / W × numel × 4`` D2H) instead of ``backwards × numel × e``.
    """
    h2d = max(loads - 1, 0) * numel * itemsize
    streamed = backwards * numel * itemsize if wave <= 1 else backwards // wave * numel * GRAD_ACC_ITEMSIZE
    d2h = streamed - (numel * GRAD_ACC_ITEMSIZE if backwards else 0)
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


def resident_blocks(
    shape: ModelShape, plan: StepPlan, itemsize: int, budget: int, with_optimizer=frozenset()
) -> frozenset[int]:
    """The blocks of a stage to keep resident within ``budget`` device bytes (module docstring).

    Args:
        shape: the model; plan: the stage's step (its blocks and their uses, ``StepPlan.uses``).
        itemsize: compute-dtype bytes (e); budget: :func:`stage_budget`'s bytes.
        with_optimizer: blocks charged with their optimizer on the device (``e + 16`` bytes/param).
    """
    numel = {i: shape.load_numels[i] for i in plan.blocks}
    uses = plan.uses()
    per = {
        i: on_device_bytes_per_param(itemsize) if i in with_optimizer else resident_bytes_per_param(itemsize)
        for i in numel
    }
    cost = {i: n * per[i] for i, n in numel.items()}
    saved = {i: saved_transfer_bytes(n, itemsize, *uses[i], plan.wave) for i, n in numel.items()}
    head = len(shape.unit_numels) - 1
    return frozenset(choose_resident(cost, saved, budget, first=(head,) if head in numel else ()))


def on_device_request(on_device, state: str, tier: str) -> tuple[bool | str, str]:
    """``optim.on_device`` as the placement takes it, and why when it cannot hold: it needs the host's
    full fp32 state (``optim.state=full``) and the store in RAM (``store.tier=ram``); ``true`` with
    either is refused at start-up (config/checks.py), ``auto`` becomes False."""
    if on_device is False or (state == "full" and tier == "ram"):
        return on_device, ""
    return (
        False,
        f"optim.on_device={str(on_device).lower()}: none (needs optim.state=full and store.tier=ram)",
    )


def saved_host_bytes(numel: int, itemsize: int) -> int:
    """Host bytes per step a resident block saves by keeping its optimizer on the device: the fp32
    gradient's D2H (4), the reload after the host update (e), the host accumulation (8) and the host
    AdamW (``optimizer_bytes_per_param``), per parameter."""
    return numel * (GRAD_ACC_ITEMSIZE + itemsize + 8 + optimizer_bytes_per_param(itemsize))


def choose_on_device(extra_bytes: dict[int, int], saved_bytes: dict[int, int], budget: int) -> list[int]:
    """Resident blocks to give their optimizer on the device within ``budget`` more device bytes:
    by saved host bytes per extra device byte, highest first (ties: lower block first); a block that
    does not fit is skipped. Returns them in block order.

    Args:
        extra_bytes: block -> device bytes it takes beyond being resident (12 per parameter).
        saved_bytes: block -> host bytes per step it saves (:func:`saved_host_bytes`).
    """
    chosen, left = [], budget
    for block in sorted(extra_bytes, key=lambda b: (-saved_bytes[b] / max(extra_bytes[b], 1), b)):
        if extra_bytes[block] <= left:
            chosen.append(block)
            left -= extra_bytes[block]
    return sorted(chosen)


def _tied_pair(chosen: frozenset[int], tied: bool, head: int) -> frozenset[int]:
    """One stage's tied embedding: block 0 and the head keep their optimizer on the device together
    or not at all (their gradients of the one weight are summed on the device)."""
    pair = {0, head}
    return chosen if not tied or pair <= chosen else chosen - pair


def optimizer_blocks(
    requested, shape: ModelShape, plan: StepPlan, itemsize: int, budget: int, eligible: frozenset[int]
) -> tuple[frozenset[int], frozenset[int]]:
    """A stage's (resident blocks, those with their optimizer on the device), ``optim.on_device``'s rule
    (module docstring).

    Args:
        requested: ``optim.on_device`` (True, False or ``auto``), already False where it cannot hold.
        shape, plan, itemsize, budget: as :func:`resident_blocks`.
        eligible: blocks allowed it (the tied embedding across stages, and its head, left out).
    """
    head = len(shape.unit_numels) - 1
    if requested is True:
        resident = resident_blocks(shape, plan, itemsize, budget, eligible)
        return resident, _tied_pair(resident & eligible, shape.tied and head in plan.blocks, head)
    resident = resident_blocks(shape, plan, itemsize, budget)
    if requested is False:
        return resident, frozenset()
    left = budget - sum(shape.load_numels[i] for i in resident) * resident_bytes_per_param(itemsize)
    extra = on_device_bytes_per_param(itemsize) - resident_bytes_per_param(itemsize)
    cands = [i for i in resident if i in eligible]
    chosen = choose_on_device(
        {i: shape.load_numels[i] * extra for i in cands},
        {i: saved_host_bytes(shape.load_numels[i], itemsize) for i in cands},
        left,
    )
    return resident, _tied_pair(frozenset(chosen), shape.tied and head in plan.blocks, head)


def place_stages(
    requested,
    shape: ModelShape,
    plans,
    streamed: list[StageMemory],
    device_bytes,
    itemsize: int,
    on_device=False,
) -> tuple[tuple[int, ...], tuple[frozenset[int], ...], tuple[frozenset[int], ...]]:
    """Every stage's budget (:func:`stage_budget`), resident blocks and those of them with their optimizer
    on the device (:func:`optimizer_blocks`).

    Args:
        requested: ``stream.device_budget``; plans: per stage its ``StepPlan``; streamed: per stage its
            device memory with nothing resident; device_bytes: per stage the device memory it may use;
            itemsize: compute-dtype bytes; on_device: ``optim.on_device`` (False where it cannot hold).
    """
    budgets = tuple(stage_budget(requested, d, m) for d, m in zip(device_bytes, streamed, strict=True))
    head = len(shape.unit_numels) - 1
    across = {0, head} if shape.tied and len(plans) > 1 else set()  # the tied embedding's two stages
    placed = [
        optimizer_blocks(on_device, shape, p, itemsize, x, frozenset(set(p.blocks) - across))
        for p, x in zip(plans, budgets, strict=True)
    ]
    return budgets, tuple(r for r, _ in placed), tuple(o for _, o in placed)


def grad_blocks(
    requested, shape: ModelShape, plan: StepPlan, itemsize: int, left: int, resident, n: int
) -> frozenset[int]:
    """A stage's streamed blocks that keep their fp32 gradient accumulator on the device,
    ``stream.grad_on_device``'s rule (module docstring).

    Args:
        requested: ``stream.grad_on_device`` (True, False or ``auto``).
        shape, plan, itemsize: as :func:`resident_blocks`.
        left: device bytes the budget has left after the resident blocks (``auto`` only).
        resident: the stage's resident blocks (never candidates).
        n: tokens per micro-batch (a streamed embedding's row traffic depends on it).
    """
    streamed = [i for i in plan.blocks if i not in resident]
    if requested is True:
        return frozenset(streamed)
    if requested is False or left <= 0 or not streamed:
        return frozenset()
    plain, kept = plan.work(resident), plan.work(resident, grad_acc=streamed)

    def host(work, i: int) -> int:  # D2H + accumulation bytes per step
        return sum(block_traffic(shape, work, i, n=n, itemsize=itemsize)[1:])

    saved = {i: host(plain, i) - host(kept, i) for i in streamed}
    cost = {i: shape.load_numels[i] * GRAD_ACC_ITEMSIZE for i in streamed if saved[i] > 0}
    return frozenset(choose_on_device(cost, saved, left))  # the same greedy: saved per byte, block order


def check_grad_fit(requested, streamed: list[StageMemory], device_bytes) -> None:
    """Refuse ``stream.grad_on_device=true`` where a stage's device cannot hold its window, activations,
    every accumulator (``streamed``: each stage's memory with them, nothing resident) and the margin.
    A CPU stage (``device_bytes`` 0) is not checked: its "device" is host memory.

    Raises:
        ConfigError: naming the key, the value, the stage's bytes and the fix.
    """
    if requested is not True:
        return
    for k, (m, d) in enumerate(zip(streamed, device_bytes, strict=True)):
        if d > 0 and m.total_bytes + MARGIN_BYTES > d:
            raise ConfigError(
                f"stream.grad_on_device=true: stage {k} needs {m.total_bytes / 1e9:.2f} GB with every "
                f"streamed unit's fp32 gradient accumulator ({m.grad_acc_bytes / 1e9:.2f} GB) + "
                f"{MARGIN_BYTES / 1e9:.2f} GB margin, the device has {d / 1e9:.2f} GB; set "
                "stream.grad_on_device=auto or false (or use more stages, a shorter train.seq_len or a "
                "smaller train.micro_batch_size)"
            )
