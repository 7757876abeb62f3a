"""Step time: the seconds a step's bytes and FLOPs cost on a hardware profile, as pure arithmetic.

Owns: a step's time split into compute, H2D, D2H, host accumulation, CPU optimizer (and what of it
the next step waits for: exposure.py), host DRAM and pipeline bubble, the host rates it is
priced at (``HostRates``). Does not own: a block's compute work and its rates (``compute.py``), the
bytes (``traffic.py``, ``memory.py``), what each stage's step does (``core/step_plan.py``, handed
over as :class:`~nodetrain.cost.work.StageWork`), hardware profiles or verdicts (``plan/``),
measuring (``bench/``), or anything that needs torch.distributed.

Shapes as in ``memory.py``: n = B·T tokens per micro-batch, T = sequence length, e = compute-dtype
bytes, S = stages, M = micro-batches per round, G = rounds per step (grad_accum), W = micro-batches
per wave (``pipeline.wave``): the schedule's items, each W micro-batches on one load per block.

The step (:func:`step_time`): per stage max(compute, H2D, D2H, accumulation) per micro-batch,
played out on the engine's schedule (``exposure.pipeline_times``), plus the optimizer seconds the
next step waits for in ``update_mode`` (:attr:`StepTime.exposure`), bounded below by the node's
DRAM and, with ``shared_cores``, by the stages' CPU seconds (:attr:`StepTime.core_s`).

Why, and the model in full: docs/planner.md#the-step-time-model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nodetrain.cost.blocks import BlockCost, PassTimes, pass_times
from nodetrain.cost.compute import ComputeRates, block_seconds, model_flops, stage_compute
from nodetrain.cost.exposure import (
    CLIP_FRACTION,
    MODES,
    OptimizerExposure,
    UnitTiming,
    exposed_split,
    pipeline_times,
)
from nodetrain.cost.rates import HostRates, helped_share
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.shared_cores import core_seconds, shared_cores_floor
from nodetrain.cost.tier import tier_optimizer_rate
from nodetrain.cost.traffic import (
    StageTraffic,
    block_traffic,
    optimizer_bytes_per_param,
    speculative_bytes_per_param,
    speculative_traffic,
    stage_traffic,
)
from nodetrain.cost.work import StageWork

__all__ = [
    "HostRates",
    "StepTime",
    "step_time",
]


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, split by what the slowest stage waits for."""

    tokens: int
    model_flops: float
    compute_s: float
    """Busy compute of the slowest stage: forward + recompute + backward, 8·N_s·n matmul FLOPs,
    the attention and the elementwise kernels; the last stage's head 6·N·n and its softmax (its
    gradients come with the forward, no recompute)."""
    h2d_s: float
    """Weight prefetch of the busiest stage (:func:`stage_traffic`'s loads)."""
    d2h_s: float
    """Gradient offload of the busiest stage (streamed: per backward; resident: once, fp32)."""
    accum_s: float
    """Host accumulation of the busiest stage's D2H worker on its ``accum_threads`` cores."""
    bubble_s: float
    """Pipeline fill and drain: the pipeline's seconds beyond the slowest stage's micro-batches
    (equal stages: (S − 1) slots per round)."""
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
    attention_s: float = 0.0
    """Of ``compute_s``, the attention's seconds."""
    elementwise_s: float = 0.0
    """Of ``compute_s``, the elementwise kernels' seconds."""
    overhead_s: float = 0.0
    """Of ``compute_s``, the decoder layers' fixed overheads (:attr:`ComputeRates.layer_overhead_s`)."""
    recompute_s: float = 0.0
    """Of ``compute_s``, the recomputed forwards (the compute less that with every layer kept)."""
    stage_compute_s: tuple[float, ...] = ()
    """Per stage, its compute seconds in the step (``compute_s`` is the largest)."""
    core_s: tuple[float, ...] = ()
    """Per stage, the CPU seconds of its threads in a step when the stages share the node's cores
    (``shared_cores``; else empty): compute, plus every byte its copies (read and write), gradient
    accumulation and optimizer move at one core's bandwidth."""
    shared_cores_s: float = 0.0
    """Σ ``core_s`` over the shared cores: the step is at least that long (work-conserving)."""
    stall_s: float = 0.0
    """The busiest stage's compute waiting for H2D in the step (``blocks.py``: loads beyond their
    block's compute; the step's first, gated loads' copies), as the engine's ``stall``."""
    d2h_wait_s: float = 0.0
    """The busiest stage's compute waiting for offload slots, and the step's flush (``d2h_wait``)."""
    optim_wait_s: float = 0.0
    """Of ``optimizer_exposed_s``, the compute's waits for pending updates (the engine's ``optim``)."""
    device_optimizer_s: float = 0.0
    """The slowest stage's AdamW of units kept on the device (``optim.on_device``), in ``step_s``."""

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


@dataclass(frozen=True)
class _Stages:
    """Per stage, what one step costs it: its actions (the engine's rounds), bytes, seconds of
    compute, H2D, D2H and host accumulation, and its blocks' overlap (``blocks.py``)."""

    actions: list[list]
    traffic: list[StageTraffic]
    seconds: list[tuple[float, float, float, float]]
    compute_parts: list[tuple[float, ...]]
    """Per stage, its compute's (matmul, attention, elementwise, overhead) seconds in the step."""
    busy: list[float]
    """Per stage, its micro-batches' seconds in the step: their passes block by block
    (:func:`~nodetrain.cost.blocks.pass_times`), the last backward's ships and the flush, and on shared
    cores at least its in-step CPU seconds over its cores."""
    blocks: list[dict[int, BlockCost]]
    passes: list[PassTimes]
    stretch: list[float]
    """Per stage, how much its shared cores slow its passes (1 on a GPU)."""
    recompute: list[float]
    """Per stage, the seconds of its compute that recompute forwards (its compute less that with every
    layer kept, ``compute.block_work``)."""


def _block_costs(
    shape, w: StageWork, n, t, e, compute, rates: HostRates, accum: float
) -> dict[int, BlockCost]:
    """A stage's blocks as :class:`~nodetrain.cost.blocks.BlockCost`: compute, each load spread over
    the block's passes (the head's forward only), offloads per backward at the link and the D2H
    worker's accumulation rate ``accum`` (the slower of the two), a resident block's one ship (and a streamed
    block's with a device accumulator, ``w.grad_acc``, loaded per pass still). A pass is one pipeline
    item: ``w.wave`` micro-batches in a row on each block, one load and one offload (issue 31)."""
    m, last = w.num_items, len(shape.unit_numels) - 1
    link, d2h_link = rates.link_bytes_per_s, rates.d2h_link_bytes_per_s or rates.link_bytes_per_s
    out = {}
    for i in w.blocks:
        f, b = (w.wave * x for x in block_seconds(shape, i, n, t, e, compute, i in w.kept))
        h2d, d2h, acc = block_traffic(shape, w, i, n=n, itemsize=e)
        worker = max(d2h / d2h_link, acc / accum)
        passes = m if i == last else 2 * m
        offload, ship = (0.0, worker) if i in w.grad_acc else (worker / m, 0.0)  # device accumulator
        if i in w.resident:  # its load is the step's first use, gated (exposure.py)
            out[i] = BlockCost(f, b, ship_s=worker, head=i == last)
        elif i == 0 and w.rows:  # gathered at each forward
            out[i] = BlockCost(f, b, h2d / m / link, offload, ship)
        else:
            out[i] = BlockCost(f, b, h2d / passes / link, offload, ship, head=i == last)
    return out


def _stages(
    shape,
    works: list[StageWork],
    *,
    b,
    t,
    itemsize,
    compute,
    rates,
    shared_cores=0,
    offload=False,
    tier=0.0,
    slots=2,
    mode="deferred",
) -> _Stages:
    n, s = b * t, len(works)
    out = _Stages([], [], [], [], [], [], [], [], [])
    share = max(1, shared_cores // s)  # a stage's threads share its cores (one each at least)
    link = rates.link_bytes_per_s
    for w in works:
        x = stage_traffic(shape, w, n=n, itemsize=itemsize, offload_activations=offload)
        x = replace(x, tier_bytes=int(2 * tier * sum(shape.unit_numels[i] for i in w.blocks)))
        parts = tuple(
            w.num_microbatches * p for p in stage_compute(shape, w.blocks, n, t, itemsize, compute, w.kept)
        )
        out.actions.append(list(w.actions))
        out.traffic.append(x)
        out.compute_parts.append(parts)
        unrecomputed = stage_compute(shape, w.blocks, n, t, itemsize, compute, w.blocks)
        out.recompute.append(sum(parts) - w.num_microbatches * sum(unrecomputed))
        d2h_link = rates.d2h_link_bytes_per_s or link
        accum = rates.accum_rate(helped_share(mode, w.num_items) if rates.accum_help else 0.0)
        out.seconds.append((sum(parts), x.h2d_bytes / link, x.d2h_bytes / d2h_link, x.accum_bytes / accum))
        costs = _block_costs(shape, w, n, t, itemsize, compute, rates, accum)
        p = pass_times([costs[i] for i in w.blocks], slots)
        busy = w.num_items * (p.forward_s + p.backward_s) + p.last_extra_s
        busy = max(busy, *out.seconds[-1][1:3])  # the link (activation offload's bytes too) at least
        in_step = core_seconds(sum(parts), x, rates.core_bytes_per_s, optimizer=False) if shared_cores else 0
        out.busy.append(max(busy, in_step / share))
        out.blocks.append(costs)
        out.passes.append(p)
        out.stretch.append(out.busy[-1] / busy if busy > 0 else 1.0)
    return out


def _unit_timings(shape, works: list[StageWork], st: _Stages, *, b, t, itemsize, compute, rates, optim_rates):
    """Per stage, its units' :class:`~nodetrain.cost.exposure.UnitTiming` (forward order), the
    pipeline's end (each stage's last action and its flush) and each stage's fill, from
    :func:`~nodetrain.cost.exposure.pipeline_times` of the engine's schedule.

    A micro-batch's forward and backward take their passes' seconds (:func:`pass_times`); a block's
    forward max(F, H2D), its backward its share of the pass. A unit is final at its block's last
    offload (the head at the last forward, every other block at the last backward, which visits the
    blocks in reverse); its load (a row gather for stage 0's streamed embedding) starts once its update
    is done, at the link's rate beside the optimizer (``gated_link_bytes_per_s``).
    """
    n, e, last = b * t, itemsize, len(shape.unit_numels) - 1
    fwd, bwd, per_block = [], [], []
    for k in range(len(works)):
        costs, p, x = st.blocks[k], st.passes[k], st.stretch[k]
        span = sum(max(c.backward_s, c.load_s) for c in costs.values() if not c.head) or 1.0
        per_block.append(
            {
                i: (max(c.forward_s, c.load_s) * x, max(c.backward_s, c.load_s) * p.backward_s / span * x)
                for i, c in costs.items()
            }
        )
        fwd.append(p.forward_s * x)
        bwd.append(p.backward_s * x)
    times = pipeline_times(st.actions, fwd, bwd)
    step_end = max(stage[-1][1] + st.passes[k].last_extra_s * st.stretch[k] for k, stage in enumerate(times))
    gated = rates.gated_link_bytes_per_s or rates.link_bytes_per_s
    stages = []
    for k, work in enumerate(works):
        blocks = work.blocks
        kinds = list(zip(st.actions[k], times[k], strict=True))
        last_f = max(start for a, (start, _) in kinds if a.kind == "F")
        last_b = max((start for a, (start, _) in kinds if a.kind == "B"), default=0.0)
        units = []
        for i in blocks:
            if i == last:
                final = last_f + fwd[k]
            else:
                final = last_b + sum(per_block[k][j][1] for j in blocks if j >= i)
            rows = i == 0 and work.rows
            host = i not in work.on_device  # else optim.on_device: no host update, no reload
            load = host * (n * shape.hidden if rows else shape.load_numels[i]) * e / gated
            numel, r = host * shape.unit_numels[i], optim_rates[k]
            units.append(
                UnitTiming(
                    update_s=numel * optimizer_bytes_per_param(e) / r,
                    final_s=final,
                    forward_s=st.blocks[k][i].forward_s * st.stretch[k],
                    pass_s=per_block[k][i][0],
                    load_s=load,
                    backup_s=numel * speculative_bytes_per_param(False) / r,
                    redo_s=numel
                    * (speculative_bytes_per_param(True) - speculative_bytes_per_param(False))
                    / r,
                    shared=shape.tied and len(works) > 1 and i == 0,
                )
            )
        stages.append(units)
    return stages, step_end, [stage[0][0] for stage in times]


def _optim_rates(rates: HostRates, shape, stage_blocks, itemsize: int, measured, tier: float):
    """(per stage its optimizer thread's host bytes/s, what bounds the slowest): its AdamW's (measured,
    else ``rates.optim_rate``), or with ``tier`` bytes/param on NVMe (read and written once a step, at
    the rank's share of the drives) :func:`~nodetrain.cost.tier.tier_optimizer_rate` of both."""
    adamw, bound = rates.optim_rate()
    out = list(measured) if measured else [adamw] * len(stage_blocks)
    if tier <= 0:
        return out, bound
    read, write = rates.nvme_read_bytes_per_s / rates.ranks, rates.nvme_write_bytes_per_s / rates.ranks
    owned = [sum(shape.unit_numels[i] for i in blocks) for blocks in stage_blocks]
    with_tier = [
        tier_optimizer_rate(r, p * optimizer_bytes_per_param(itemsize), p * tier, read, write)
        for r, p in zip(out, owned, strict=True)
    ]
    return with_tier, "NVMe tier" if any(x < r for x, r in zip(with_tier, out, strict=True)) else bound


def _exposure(shape, works: list[StageWork], st: _Stages, kw: dict, optim_rates, mode: str, clip: float):
    """(every mode's :class:`OptimizerExposure`, the pipeline's end: the step without the optimizer,
    of ``mode``'s exposed seconds those the compute waits for updates: the rest are gated copies)."""
    stages, step_end, fills = _unit_timings(shape, works, st, **kw, optim_rates=optim_rates)
    split = {m: exposed_split(stages, step_end, m, fills) for m in MODES}
    exposure = OptimizerExposure(**{f"{m}_s": v[0] for m, v in split.items()})
    if mode == "speculative":
        waits = (1 - clip) * split["speculative"][1] + clip * split["speculative_clipped"][1]
    else:
        waits = split[mode][1]
    return exposure, step_end, waits


def step_time(
    shape: ModelShape,
    works: list[StageWork],
    *,
    b: int,
    t: int,
    itemsize: int,
    flops_per_s: float,
    rates: HostRates,
    update_mode: str = "deferred",
    optim_bytes_per_s: list[float] | None = None,
    clip_fraction: float = CLIP_FRACTION,
    attention_flops_per_s: float = 0.0,
    elementwise_bytes_per_s: float = 0.0,
    layer_overhead_s: float = 0.0,
    shared_cores: int = 0,
    tier_bytes_per_param: float = 0.0,
    offload_activations: bool = False,
    slots: int = 2,
    device_optimizer_bytes_per_s: float = 0.0,
) -> StepTime:
    """Step time when the window overlaps H2D, compute, D2H and the host accumulation on each stage
    (the module's model, "The step").

    Args:
        works: per stage, its step (``core.step_plan.StepPlan.work``: actions, loads, resident blocks);
        b, t: micro-batch size and sequence length; itemsize: compute-dtype bytes;
        flops_per_s: achieved matmul FLOP/s of one stage's device; rates: the host side;
        update_mode: ``serial``, ``deferred``, ``in_backward`` or ``speculative`` (priced at
            ``clip_fraction`` clipped steps, its backups' and redos' bytes included);
        optim_bytes_per_s: per stage, its optimizer thread's host bytes/s (the engine's measurement);
            default: ``rates.rate(rates.optim_threads)`` for every stage;
        attention_flops_per_s, elementwise_bytes_per_s, layer_overhead_s: as :class:`ComputeRates`
            (0: attention at ``flops_per_s``, elementwise work and overheads not priced);
        shared_cores: the node's cores when the stages compute on them (a CPU profile; the rates
            above are then one core's), else 0;
        tier_bytes_per_param: NVMe bytes/param read + written once a step (:func:`_optim_rates`; 0: none);
        offload_activations: ``stream.offload_activations``; slots: ``stream.slots`` (``blocks.py``).
        device_optimizer_bytes_per_s: the on-device AdamW's bytes/s (:func:`_with_device_optimizer`).

    Raises:
        ValueError: an unknown ``update_mode``.
    """
    if update_mode not in MODES[:4]:
        raise ValueError(f"update_mode={update_mode!r}: use one of {MODES[:4]}")
    stage_blocks = [w.blocks for w in works]
    compute = ComputeRates(flops_per_s, attention_flops_per_s, elementwise_bytes_per_s, layer_overhead_s)
    kw = dict(b=b, t=t, itemsize=itemsize, compute=compute, rates=rates)
    more = dict(shared_cores=shared_cores, offload=offload_activations, tier=tier_bytes_per_param)
    st = _stages(shape, works, **kw, **more, slots=slots, mode=update_mode)
    optim = _optim_rates(rates, shape, stage_blocks, itemsize, optim_bytes_per_s, tier_bytes_per_param)
    spec = update_mode == "speculative"
    traffic = speculative_traffic(shape, stage_blocks, st.traffic, clip_fraction) if spec else st.traffic
    exposure, pipeline, waits = _exposure(shape, works, st, kw, optim[0], update_mode, clip_fraction)
    exposed = exposure.of(update_mode, clip_fraction)
    floors = _floors(st, traffic, rates, optim, exposed, pipeline, shared_cores)
    tokens = works[0].num_microbatches * b * t
    out = _result(shape, st, tuple(traffic), floors, exposure, update_mode, tokens=tokens, t=t)
    out = replace(out, **_phases(st, works, floors.exposed, waits))
    return _with_device_optimizer(out, st.traffic, device_optimizer_bytes_per_s)


def _with_device_optimizer(result: StepTime, traffic, bytes_per_s: float) -> StepTime:
    """``result`` with the slowest stage's on-device AdamW (``optim.on_device``) added to the step: it
    runs after the all-reduce, before the stage's next forward; unchanged when not priced (0)."""
    if bytes_per_s <= 0:
        return result
    device = max(x.device_optimizer_bytes for x in traffic) / bytes_per_s
    return replace(result, step_s=result.step_s + device, device_optimizer_s=device)


def _phases(st: _Stages, works: list[StageWork], exposed: float, waits: float) -> dict[str, float]:
    """The busiest stage's waits as the engine's breakdown names them (``run/breakdown.py``):
    ``stall`` (its passes' loads beyond their compute, and the gated loads' copies after their
    updates), ``d2h_wait`` (offload slots and the flush) and ``optim`` (pending updates)."""
    k = max(range(len(works)), key=lambda j: st.busy[j])
    p, m, x = st.passes[k], works[k].num_items, st.stretch[k]
    return {
        "stall_s": x * m * p.stall_s + max(0.0, exposed - waits),
        "d2h_wait_s": x * (m * p.d2h_wait_s + p.last_extra_s),
        "optim_wait_s": min(waits, exposed),
    }


@dataclass(frozen=True)
class _Floors:
    """The step's seconds and what bounds them (:func:`_floors`)."""

    parts: dict[str, float]
    """The slowest stage's compute, H2D, D2H and host accumulation, and the pipeline bubble."""
    optimizer: float
    host_dram: float
    exposed: float
    core_s: list[float]
    cores_s: float
    step: float
    bottleneck: str


def _floors(st: _Stages, traffic, rates: HostRates, optim, exposed: float, pipeline: float, shared_cores):
    """The step: the pipeline plus the optimizer's ``exposed`` seconds, at least the node's DRAM floor
    (in the exposed seconds every stage's optimizer runs, all released by then, and little else),
    the slowest optimizer and the shared cores' floor; ``optim``: :func:`_optim_rates`'s."""
    optim_rates, optim_bound = optim
    core_s, cores_s = shared_cores_floor(st.seconds, traffic, rates.core_bytes_per_s, shared_cores)
    compute, h2d, d2h, accum = (max(p[j] for p in st.seconds) for j in range(4))
    optimizer = max(x.optimizer_bytes / r for x, r in zip(traffic, optim_rates, strict=True))
    host_bytes = sum(x.host_bytes for x in traffic)
    alone = sum(min(exposed * r, x.optimizer_bytes) for x, r in zip(traffic, optim_rates, strict=True))
    dram = exposed + (host_bytes - alone) / rates.host_bytes_per_s
    step = max(pipeline + exposed, dram, optimizer, cores_s)
    parts = {
        "compute": compute,
        "H2D": h2d,
        "D2H": d2h,
        "host accumulation": accum,
        "pipeline bubble": pipeline - max(st.busy),
    }
    bottleneck = _bottleneck(
        parts, exposed, optim_bound, step=step, pipeline=pipeline, dram=dram, cores_s=cores_s
    )
    return _Floors(
        parts, optimizer, host_bytes / rates.host_bytes_per_s, exposed, core_s, cores_s, step, bottleneck
    )


def _result(shape, st: _Stages, traffic, floors: _Floors, exposure, update_mode, *, tokens, t) -> StepTime:
    """The :class:`StepTime` of the step's parts (the compute parts of its slowest stage)."""
    slowest = max(range(len(st.seconds)), key=lambda k: st.seconds[k][0])
    return StepTime(
        tokens=tokens,
        model_flops=model_flops(shape, tokens, t),
        compute_s=floors.parts["compute"],
        h2d_s=floors.parts["H2D"],
        d2h_s=floors.parts["D2H"],
        accum_s=floors.parts["host accumulation"],
        bubble_s=floors.parts["pipeline bubble"],
        optimizer_s=floors.optimizer,
        host_dram_s=floors.host_dram,
        step_s=floors.step,
        bottleneck=floors.bottleneck,
        traffic=traffic,
        optimizer_exposed_s=floors.exposed,
        update_mode=update_mode,
        exposure=exposure,
        attention_s=st.compute_parts[slowest][1],
        elementwise_s=st.compute_parts[slowest][2],
        overhead_s=st.compute_parts[slowest][3],
        recompute_s=st.recompute[slowest],
        stage_compute_s=tuple(p[0] for p in st.seconds),
        core_s=tuple(floors.core_s),
        shared_cores_s=floors.cores_s,
    )


def _bottleneck(
    parts: dict[str, float], exposed: float, optim_bound: str, *, step, pipeline, dram, cores_s
) -> str:
    """What bounds the step: the largest of a stage's ``parts``; the optimizer's cores or DRAM when
    its exposed seconds exceed them; host DRAM or the shared cores when their floor sets the step."""
    out = max(parts, key=parts.get)
    if exposed > max(parts.values()):
        out = {"cores": "optimizer cores", "NVMe tier": "NVMe tier"}.get(optim_bound, "host DRAM")
    if dram >= step and dram > pipeline + exposed:
        out = "host DRAM"
    if cores_s >= step and cores_s > max(pipeline + exposed, dram):
        out = "shared cores"
    return out
