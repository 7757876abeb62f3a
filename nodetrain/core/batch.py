"""The automatic batch: ``train.micro_batch_size=auto`` and ``pipeline.microbatches=auto`` turned into
numbers once, and the step of a batch priced with its stages fitted, placed and its update mode chosen.

Owns: :func:`resolve_batch`: among the candidates whose peak fits the device (fit.py), the smallest
micro-batch size × count within :data:`AUTO_WITHIN` of the best tokens/s the step model predicts on the
hardware profile (pricing.py); and :func:`priced_batch`, the one way a batch is priced (the engine's
choices and the planner's report). Pure. Does not own the batch's counts (``config/batch.py``), the
data that fills it (data/) or the schedule of its micro-batches (schedule.py).
"""

from __future__ import annotations

import math

from nodetrain.config.batch import BatchShape
from nodetrain.config.schema import Config, ConfigError
from nodetrain.core.fit import node_fit, profile_host_free_bytes
from nodetrain.core.machine import Machine, profile_machine
from nodetrain.core.placement import grad_blocks, on_device_request, place_stages
from nodetrain.core.pricing import priced_step
from nodetrain.core.recompute import decide_recompute
from nodetrain.core.update import choose_update
from nodetrain.cost.shape import ModelShape

__all__ = ["AUTO_MAX_ROUNDS", "AUTO_WITHIN", "priced_batch", "resolve_batch"]

AUTO_WITHIN = 0.02
"""An automatic choice takes the smallest batch within this fraction of the best predicted tokens/s."""
AUTO_MAX_ROUNDS = 8
"""``pipeline.microbatches=auto`` tries S, 2S, 4S … up to this many × the stages."""


def _candidates(cfg: Config, num_stages: int, nodes: int) -> list[tuple[int, int]]:
    """(micro-batch size, micro-batches) pairs to try: the given value of each, or for ``auto`` powers
    of two (sizes) and S, 2S, 4S … 8S that W = ``pipeline.wave`` divides (else lcm(S, W)); with
    ``train.batch_size`` only pairs dividing it (then any multiple of W up to 8S).

    Raises:
        ConfigError: with ``train.batch_size`` and W > 1, no micro-batch count W divides fits the batch."""
    b, m = cfg.train.micro_batch_size, cfg.pipeline.microbatches
    sizes = [1 << k for k in range(17)] if b == "auto" else [b]
    w = cfg.pipeline.wave  # a wave is W micro-batches of a round: only counts W divides
    counts = [num_stages << k for k in range(AUTO_MAX_ROUNDS.bit_length())] if m == "auto" else [m]
    if m == "auto":
        counts = [y for y in counts if y % w == 0] or [math.lcm(num_stages, w)]
    if cfg.train.batch_size > 0:
        fits = [(x, y) for x in sizes for y in counts if cfg.train.batch_size % (x * y * nodes) == 0]
        if m == "auto" and not fits:
            counts = [y for y in range(w, AUTO_MAX_ROUNDS * num_stages + 1, w)]
            fits = [(x, y) for x in sizes for y in counts if cfg.train.batch_size % (x * y * nodes) == 0]
        if m == "auto" and not fits and w > 1:
            raise ConfigError(
                f"pipeline.wave={w}: pipeline.microbatches=auto must be a multiple of it, and no multiple "
                f"of {w} up to {AUTO_MAX_ROUNDS * num_stages} splits train.batch_size={cfg.train.batch_size} "
                "into micro-batches; use pipeline.wave=1 (or a smaller wave), or a larger train.batch_size"
            )
        return fits
    return [(x, y) for x in sizes for y in counts]


def priced_batch(cfg: Config, shape: ModelShape, machine: Machine, batch: BatchShape, num_stages: int):
    """The step of ``cfg`` at ``batch`` on ``machine``: its stages fitted (``fit.node_fit``), their
    blocks placed (``placement.place_stages``), the streamed blocks that keep their gradient on the
    device in what the resident ones left (``placement.grad_blocks``), the layers that keep their
    activations chosen in what the placement left (``recompute.decide_recompute``) and its update mode chosen
    (``update.choose_update``), priced in that mode (``serial`` with ``plan.overlap_optimizer=false``).

    Returns:
        (the ``NodeFit``, per stage its budget, (per stage its resident blocks, per stage those with
        their optimizer on the device, per stage its streamed blocks with a device gradient
        accumulator), the ``Recompute``, the update choice, the ``StepTime``).
    """
    fit = node_fit(cfg, shape, num_stages, batch.microbatches, batch.grad_accum, machine.hardware)
    b = batch.micro_batch_size
    streamed = [fit.stage(k, b) for k in range(num_stages)]
    on_device, _ = on_device_request(cfg.optim.on_device, cfg.optim.state, cfg.store.tier)
    budgets, resident, with_optimizer = place_stages(
        cfg.stream.device_budget, shape, fit.plans, streamed, machine.device_bytes, fit.itemsize, on_device
    )
    n = b * batch.seq_len
    held = [
        fit.stage(k, b, r, o, ()).resident_bytes
        for k, (r, o) in enumerate(zip(resident, with_optimizer, strict=True))
    ]
    grads = tuple(
        grad_blocks(cfg.stream.grad_on_device, shape, p, fit.itemsize, x - h, r, n)
        for p, x, h, r in zip(fit.plans, budgets, held, resident, strict=True)
    )
    if cfg.stream.grad_on_device == "auto":  # within the budget (true's are beyond it)
        held = [h + 4 * sum(shape.load_numels[i] for i in g) for h, g in zip(held, grads, strict=True)]
    recompute = decide_recompute(
        cfg.stream.recompute,
        shape,
        fit.plans,
        budgets,
        held,
        n=n,
        t=batch.seq_len,
        itemsize=fit.itemsize,
        cpu=machine.on_cpu,
        offload=cfg.stream.offload_activations,
    )
    plans = zip(fit.plans, resident, with_optimizer, recompute.kept, grads, strict=True)
    works = [p.work(r, o, x, g) for p, r, o, x, g in plans]
    choice = choose_update(cfg, shape, works, machine, b)
    mode = choice.kind if cfg.plan.overlap_optimizer else "serial"
    step = choice.priced.get(mode) or priced_step(cfg, shape, works, machine, mode, b)
    return fit, budgets, (resident, with_optimizer, grads), recompute, choice, step


def resolve_batch(
    cfg: Config, shape: ModelShape, num_stages: int, nodes: int = 1
) -> tuple[BatchShape, list[str]]:
    """The batch of ``cfg``, with ``train.micro_batch_size`` and ``pipeline.microbatches`` resolved
    from ``auto`` by the step model on ``cfg.hardware`` (one line each saying what was chosen and why).

    Sizes and counts are chosen among those whose peak fits the device (``cost.memory.stage_memory``,
    the one activation model, also behind the automatic device budget): the smallest micro-batch
    size × count within :data:`AUTO_WITHIN` of the best predicted tokens/s (a smaller batch for the
    same speed).

    Args:
        cfg: a validated config (``auto`` allowed in those keys); shape: its model; num_stages: stages;
            nodes: pipeline replicas sharing ``train.batch_size``.

    Raises:
        ConfigError: no candidate fits (the message gives the way to see the memory of the smallest).
    """
    b_auto, m_auto = cfg.train.micro_batch_size == "auto", cfg.pipeline.microbatches == "auto"
    if not (b_auto or m_auto):
        return BatchShape.of(cfg, nodes), []
    scored, machine = [], profile_machine(cfg, profile_host_free_bytes(cfg, shape), num_stages)
    for b, m in _candidates(cfg, num_stages, nodes):
        batch = BatchShape.of(cfg, nodes, b, m)
        if node_fit(cfg, shape, num_stages, m, batch.grad_accum).fits(b):
            t = priced_batch(cfg, shape, machine, batch, num_stages)[-1]
            scored.append((t.tokens / t.step_s, b, m, t))
    if not scored:
        keys = " and ".join(
            k for k, a in (("train.micro_batch_size", b_auto), ("pipeline.microbatches", m_auto)) if a
        )
        raise ConfigError(
            f"{keys}=auto: no candidate fits {cfg.hardware.name} (see `python -m nodetrain.plan` with "
            "train.micro_batch_size=1); shorten train.seq_len, use more stages or a larger device"
        )
    best = max(x[0] for x in scored)
    rate, b, m, t = min(
        (x for x in scored if x[0] >= (1 - AUTO_WITHIN) * best), key=lambda x: (x[1] * x[2], x[2])
    )
    line = (
        f"planner chose train.micro_batch_size={b}, pipeline.microbatches={m} on "
        f"hardware={cfg.hardware.name}: {rate:,.0f} tokens/s predicted ({t.bottleneck}-bound), the smallest "
        f"batch within {AUTO_WITHIN:.0%} of the best of {len(scored)} that fit ({best:,.0f} tokens/s)"
    )
    return BatchShape.of(cfg, nodes, b, m), [line]
