"""Step time: the seconds a step's bytes and FLOPs cost on a hardware profile, as pure arithmetic.

Owns: a step's time split into compute, H2D, D2H, host accumulation, CPU optimizer (and what of it
the next step waits for: plan/exposure.py), host DRAM and pipeline bubble, the host rates it is
priced at (``HostRates``), and the model FLOPs used for MFU. Does not own: the bytes (``costs.py``:
store, stage memory, a step's traffic), hardware profiles or verdicts (planner.py), measuring
(``bench/``), or anything that needs torch.distributed.

Shapes as in ``costs.py``: n = B·T tokens per micro-batch, T = sequence length, e = compute-dtype
bytes, S = stages, M = micro-batches per round, G = rounds per step (grad_accum).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nodetrain.plan.costs import (
    ModelShape,
    StageTraffic,
    optimizer_bytes_per_param,
    stage_traffic,
)
from nodetrain.plan.exposure import (
    CLIP_FRACTION,
    MODES,
    OptimizerExposure,
    UnitTiming,
    exposed_s,
    pipeline_times,
)

__all__ = [
    "model_flops",
    "speculative_bytes_per_param",
    "HostRates",
    "StepTime",
    "step_time",
    "optimizer_exposure",
]


def model_flops(shape: ModelShape, tokens: int, t: int) -> float:
    """Useful training FLOPs for ``tokens`` tokens of sequences of length ``t``.

    ``6·N·tokens + 12·L·H·Q·t·tokens`` (PaLM, arXiv:2204.02311, appendix B), N = the parameters
    multiplied per token (every matmul weight incl. the head; the embedding lookup is free).
    Recompute is not useful work and is not counted here.
    """
    n_matmul = sum(shape.costs)
    attention = 12 * shape.num_layers * shape.heads * shape.head_dim * t
    return float(6 * n_matmul + attention) * tokens


def speculative_bytes_per_param(rolled_back: bool) -> int:
    """Extra host memory traffic of ``optim.speculative`` per parameter and step, over
    :func:`optimizer_bytes_per_param`: the backup reads and writes 12 (24); a step that clipped
    adds the restore (24) and a second AdamW update and transfer-copy refresh (36)."""
    return 24 + (24 + 36 if rolled_back else 0)


@dataclass(frozen=True)
class HostRates:
    """The node's host side as the planner sees one rank's share of it (bytes/s)."""

    link_bytes_per_s: float
    """One device's host link, per direction."""
    host_bytes_per_s: float
    """The node's DRAM bandwidth, shared by all its ranks."""
    core_bytes_per_s: float
    """What one core's stream of loads and stores reaches (``hardware.core_memory_bandwidth_gbps``)."""
    ranks: int
    """Ranks (one per GPU) sharing the node's DRAM and cores."""
    accum_threads: int
    """The D2H worker's OpenMP team (``host_threads.split_cores``)."""
    optim_threads: int
    """The optimizer thread's OpenMP team."""

    def rate(self, threads: int) -> tuple[float, str]:
        """Bytes/s of a team of ``threads`` on one rank, and what bounds it: its cores, or its share
        of the node's DRAM bandwidth."""
        cores, share = threads * self.core_bytes_per_s, self.host_bytes_per_s / self.ranks
        return (cores, "cores") if cores < share else (share, "host DRAM")


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, split by what the slowest stage waits for."""

    tokens: int
    model_flops: float
    compute_s: float
    """Busy compute of the slowest stage: forward + recompute + backward, 8·N_s·n (+ attention); the
    last stage's head 6·N·n (its gradients come with the forward, no recompute)."""
    h2d_s: float
    """Weight prefetch of the busiest stage (:func:`stage_traffic`'s loads)."""
    d2h_s: float
    """Gradient offload of the busiest stage (streamed: per backward; resident: once, fp32)."""
    accum_s: float
    """Host accumulation of the busiest stage's D2H worker on its ``accum_threads`` cores."""
    bubble_s: float
    """Pipeline fill and drain: (S − 1) micro-batch slots, once per step (one round of G·M)."""
    optimizer_s: float
    """CPU AdamW of the slowest stage on its ``optim_threads`` cores (or DRAM share), exposed or not."""
    host_dram_s: float
    """All stages' host bytes (:attr:`StageTraffic.host_bytes`) over the node's DRAM bandwidth."""
    step_s: float
    bottleneck: str
    """compute, H2D, D2H, host accumulation, pipeline bubble, host DRAM or optimizer cores."""
    traffic: tuple[StageTraffic, ...] = ()
    """Per stage, the bytes behind these times."""
    optimizer_exposed_s: float = 0.0
    """Of ``optimizer_s``, the seconds the next step waits for (``update_mode``; the rest is hidden
    behind the pipeline): in the step as ``pipeline + optimizer_exposed_s``."""
    update_mode: str = "deferred"
    """The update mode priced (``exposure.MODES``; ``speculative`` at ``exposure.CLIP_FRACTION``
    clipped steps)."""
    exposure: OptimizerExposure | None = None
    """The exposed seconds of every mode, for comparison."""

    @property
    def tokens_per_day(self) -> float:
        return self.tokens / self.step_s * 86400

    @property
    def host_bytes(self) -> int:
        """Host DRAM bytes per step, all stages together."""
        return sum(x.host_bytes for x in self.traffic)

    def mfu(self, peak_flops: float) -> float:
        """Model FLOPs per second over ``peak_flops`` (all devices together)."""
        return self.model_flops / self.step_s / peak_flops


def _stage_flops(shape: ModelShape, blocks: range, n: int, t: int) -> float:
    """FLOPs of one micro-batch on a stage: 8·cost·n per block (forward, recompute, backward), the
    head 6·cost·n (no recompute), plus 4 × the forward attention 4·n·T·H·Q per layer."""
    return sum(sum(_block_flops(shape, i, n, t)) for i in blocks)


def _block_flops(shape: ModelShape, block: int, n: int, t: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one block for one micro-batch: a layer 2·cost·n + 4·n·T·H·Q
    forward and 3 × that backward (recompute, then the backward's two matmuls per forward one); the
    head 6·cost·n in its forward (it takes its gradients there) and none in the backward; the
    embedding none (a gather and a scatter-add)."""
    last = len(shape.unit_numels) - 1
    if block == last:
        return 6.0 * shape.costs[block] * n, 0.0
    if block == 0:
        return 0.0, 0.0
    forward = 2.0 * shape.costs[block] * n + 4.0 * n * t * shape.heads * shape.head_dim
    return forward, 3 * forward


@dataclass(frozen=True)
class _Stages:
    """Per stage, what one step costs it: its actions (the engine's rounds), bytes, and seconds of
    compute, H2D, D2H and host accumulation."""

    actions: list[list]
    traffic: list[StageTraffic]
    seconds: list[tuple[float, float, float, float]]


def _stages(shape, stage_blocks, *, b, t, m, g, itemsize, flops_per_s, rates, schedule, resident) -> _Stages:
    from nodetrain.engine.pipeline import (  # pure; imported here: step_time stays light
        build_schedule,
        step_rounds,
    )

    n, s = b * t, len(stage_blocks)
    rounds, per_round = step_rounds(schedule, g, m)
    accum_rate, _ = rates.rate(rates.accum_threads)
    out = _Stages([], [], [])
    for k, blocks in enumerate(stage_blocks):
        actions = build_schedule(schedule, s, k, per_round) * rounds  # the engine's rounds
        x = stage_traffic(shape, blocks, actions, n=n, itemsize=itemsize, resident=resident[k])
        compute = g * m * _stage_flops(shape, blocks, n, t) / flops_per_s
        link = rates.link_bytes_per_s
        out.actions.append(actions)
        out.traffic.append(x)
        out.seconds.append((compute, x.h2d_bytes / link, x.d2h_bytes / link, x.accum_bytes / accum_rate))
    return out


def _unit_timings(
    shape, stage_blocks, st: _Stages, *, b, t, g, m, itemsize, flops_per_s, rates, resident, optim_rates
):
    """Per stage, its units' :class:`~nodetrain.plan.exposure.UnitTiming` (forward order), the
    pipeline's end and each stage's fill, from :func:`~nodetrain.plan.exposure.pipeline_times` of
    the engine's schedule.

    A block's forward and backward take its FLOPs' share of the stage's per-micro-batch time, which
    is the slowest of its compute, H2D, D2H and accumulation (a streaming-bound stage's forward is
    its loads). A unit is final at its block's last offload (the head at the last forward, every
    other block at the last backward, which visits the blocks in reverse); its load (a row gather
    for stage 0's streamed embedding) starts once its update is done.
    """
    n, e, last = b * t, itemsize, len(shape.unit_numels) - 1
    fwd, bwd, per_block = [], [], []
    for k, blocks in enumerate(stage_blocks):
        flops = {i: _block_flops(shape, i, n, t) for i in blocks}
        compute = sum(map(sum, flops.values())) / flops_per_s
        stretch = max(st.seconds[k]) / (g * m) / compute if compute > 0 else 0.0
        per_block.append(
            {i: (f * stretch / flops_per_s, w * stretch / flops_per_s) for i, (f, w) in flops.items()}
        )
        fwd.append(sum(f for f, _ in per_block[k].values()))
        bwd.append(sum(w for _, w in per_block[k].values()))
    times = pipeline_times(st.actions, fwd, bwd)
    step_end = max(end for stage in times for _, end in stage)
    stages = []
    for k, blocks in enumerate(stage_blocks):
        last_f = max(start for a, (start, _) in zip(st.actions[k], times[k], strict=True) if a.kind == "F")
        last_b = max(
            (start for a, (start, _) in zip(st.actions[k], times[k], strict=True) if a.kind == "B"),
            default=0.0,
        )
        units = []
        for i in blocks:
            if i == last:
                final = last_f + fwd[k]
            else:
                final = last_b + sum(per_block[k][j][1] for j in blocks if j >= i)
            rows = i == 0 and i not in resident[k]
            load = (n * shape.hidden if rows else shape.load_numels[i]) * e / rates.link_bytes_per_s
            numel = shape.unit_numels[i]
            units.append(
                UnitTiming(
                    update_s=numel * optimizer_bytes_per_param(e) / optim_rates[k],
                    final_s=final,
                    forward_s=per_block[k][i][0],
                    load_s=load,
                    backup_s=numel * speculative_bytes_per_param(False) / optim_rates[k],
                    redo_s=numel
                    * (speculative_bytes_per_param(True) - speculative_bytes_per_param(False))
                    / optim_rates[k],
                    shared=shape.tied and len(stage_blocks) > 1 and i == 0,
                )
            )
        stages.append(units)
    return stages, step_end, [stage[0][0] for stage in times]


def optimizer_exposure(
    shape: ModelShape,
    stage_blocks: list[range],
    *,
    b: int,
    t: int,
    m: int,
    g: int,
    itemsize: int,
    flops_per_s: float,
    rates: HostRates,
    schedule: str = "1f1b",
    resident: list[frozenset[int]] | None = None,
    optim_bytes_per_s: list[float] | None = None,
) -> OptimizerExposure:
    """Seconds of a step's CPU AdamW that the next step waits for, in every update mode
    (``plan/exposure.py``), on the engine's schedule.

    Args:
        optim_bytes_per_s: per stage, its optimizer thread's host bytes/s (the engine's measurement);
            default: ``rates.rate(rates.optim_threads)`` for every stage. The rest as :func:`step_time`.
    """
    resident = resident or [frozenset()] * len(stage_blocks)
    kw = dict(b=b, t=t, m=m, g=g, itemsize=itemsize, flops_per_s=flops_per_s, rates=rates)
    st = _stages(shape, stage_blocks, **kw, schedule=schedule, resident=resident)
    return _exposure(
        shape, stage_blocks, st, kw, resident, _optim_rates(rates, len(stage_blocks), optim_bytes_per_s)
    )


def _optim_rates(rates: HostRates, num_stages: int, measured) -> list[float]:
    return list(measured) if measured else [rates.rate(rates.optim_threads)[0]] * num_stages


def _exposure(shape, stage_blocks, st: _Stages, kw: dict, resident, optim_rates) -> OptimizerExposure:
    kw = {k: v for k, v in kw.items() if k in ("b", "t", "g", "m", "itemsize", "flops_per_s", "rates")}
    stages, step_end, fills = _unit_timings(
        shape, stage_blocks, st, **kw, resident=resident, optim_rates=optim_rates
    )
    figures = {mode: exposed_s(stages, step_end, mode, fills) for mode in MODES}
    return OptimizerExposure(**{f"{mode}_s": v for mode, v in figures.items()})


def step_time(
    shape: ModelShape,
    stage_blocks: list[range],
    *,
    b: int,
    t: int,
    m: int,
    g: int,
    itemsize: int,
    flops_per_s: float,
    rates: HostRates,
    update_mode: str = "deferred",
    schedule: str = "1f1b",
    resident: list[frozenset[int]] | None = None,
    node_flops_per_s: float = 0.0,
    optim_bytes_per_s: list[float] | None = None,
    clip_fraction: float = CLIP_FRACTION,
) -> StepTime:
    """Step time when the window overlaps H2D, compute, D2H and the host accumulation on each stage.

    1F1B runs the G rounds as one pipeline round of G·M micro-batches, GPipe as G rounds of M
    (``pipeline.step_rounds``); a round of M' takes (M' + S − 1) slots (GPipe arXiv:1811.06965, same
    for 1F1B), a slot being the slowest stage's per-micro-batch
    max(compute, H2D, D2H, accumulation). The CPU optimizer adds what the next step waits for in
    ``update_mode`` (:func:`optimizer_exposure`; ``serial``: all of it). The node's DRAM must carry
    every stage's host bytes: in the exposed seconds only the optimizers run, each stage's at most
    at its rate, so the step is at least ``exposed + (host bytes − what they moved) / DRAM bandwidth``.

    Args:
        flops_per_s: achieved FLOP/s of one stage's device; rates: the host side;
        update_mode: ``serial``, ``deferred``, ``in_backward`` or ``speculative`` (priced at
            ``clip_fraction`` clipped steps, its backups' and redos' bytes included);
        resident: per stage, the blocks kept on the device (none when omitted);
        node_flops_per_s: > 0 when the stages share one set of cores (a CPU profile): a stage idle
            in the bubble leaves its core to the others, so the pipeline takes at least every
            stage's compute over the node's FLOP/s (work-conserving), not only the critical path;
        optim_bytes_per_s: as :func:`optimizer_exposure`.

    Raises:
        ValueError: an unknown ``update_mode``.
    """
    if update_mode not in MODES[:4]:
        raise ValueError(f"update_mode={update_mode!r}: use one of {MODES[:4]}")
    n, s = b * t, len(stage_blocks)
    resident = resident or [frozenset()] * s
    kw = dict(b=b, t=t, m=m, g=g, itemsize=itemsize, flops_per_s=flops_per_s, rates=rates)
    st = _stages(shape, stage_blocks, **kw, schedule=schedule, resident=resident)
    rounds, per_round = _rounds(schedule, g, m)
    optim_rates = _optim_rates(rates, s, optim_bytes_per_s)
    _, optim_bound = rates.rate(rates.optim_threads)
    traffic = st.traffic
    if update_mode == "speculative":  # backups every step, a rollback and redo on clipped ones
        extra = speculative_bytes_per_param(False) + clip_fraction * (
            speculative_bytes_per_param(True) - speculative_bytes_per_param(False)
        )
        traffic = [
            replace(
                x, optimizer_bytes=x.optimizer_bytes + int(extra * sum(shape.unit_numels[i] for i in blocks))
            )
            for x, blocks in zip(traffic, stage_blocks, strict=True)
        ]
    per_stage = st.seconds
    slot = max(max(p) for p in per_stage) / (g * m)
    compute, h2d, d2h, accum = (max(p[j] for p in per_stage) for j in range(4))
    opt_s = [x.optimizer_bytes / r for x, r in zip(traffic, optim_rates, strict=True)]
    optimizer = max(opt_s)
    host_bytes = sum(x.host_bytes for x in traffic)
    host_dram = host_bytes / rates.host_bytes_per_s
    pipeline, bubble = rounds * (per_round + s - 1) * slot, rounds * (s - 1) * slot
    if node_flops_per_s > 0:
        total = g * m * sum(_stage_flops(shape, blocks, n, t) for blocks in stage_blocks) / node_flops_per_s
        if total > pipeline:
            pipeline, bubble = total, max(0.0, total - g * m * slot)
    exposure = _exposure(shape, stage_blocks, st, kw, resident, optim_rates)
    exposed = exposure.of(update_mode, clip_fraction)
    # in the exposed seconds every stage's optimizer runs (all released by then) and little else
    alone = sum(min(exposed * r, x.optimizer_bytes) for x, r in zip(traffic, optim_rates, strict=True))
    dram = exposed + (host_bytes - alone) / rates.host_bytes_per_s
    step = max(pipeline + exposed, dram, optimizer)
    parts = {
        "compute": compute,
        "H2D": h2d,
        "D2H": d2h,
        "host accumulation": accum,
        "pipeline bubble": bubble,
    }
    bottleneck = max(parts, key=parts.get)
    if exposed > max(parts.values()):
        bottleneck = "optimizer cores" if optim_bound == "cores" else "host DRAM"
    if dram >= step and dram > pipeline + exposed:
        bottleneck = "host DRAM"
    tokens = g * m * n
    return StepTime(
        tokens=tokens,
        model_flops=model_flops(shape, tokens, t),
        compute_s=compute,
        h2d_s=h2d,
        d2h_s=d2h,
        accum_s=accum,
        bubble_s=bubble,
        optimizer_s=optimizer,
        host_dram_s=host_dram,
        step_s=step,
        bottleneck=bottleneck,
        traffic=tuple(traffic),
        optimizer_exposed_s=exposed,
        update_mode=update_mode,
        exposure=exposure,
    )


def _rounds(schedule: str, g: int, m: int) -> tuple[int, int]:
    from nodetrain.engine.pipeline import step_rounds  # pure; imported here: step_time stays light

    return step_rounds(schedule, g, m)
