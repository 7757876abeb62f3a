"""Planner: will a model fit this node, how fast will it train, and what bounds it.

Owns: turning a config and a hardware profile (``conf/hardware/``) into a ``Plan`` (host and
device memory, the largest micro-batch that fits, step time and its bottleneck, tokens/day, nodes
for a token budget, a verdict with its reasons), the ``python -m nodetrain.plan`` entry point, and
the training start-up check that refuses a host store the node cannot hold (``preflight``, in
``host.py``). The arithmetic itself is in ``costs.py`` (bytes), ``compute.py`` and ``step_time.py``
(seconds), a profile's rates put to it in ``pricing.py``; printing is in ``report.py``.

    python -m nodetrain.plan model=llama2_70b hardware=h100_sxm train.seq_len=4096 \\
        train.micro_batch_size=4 pipeline.microbatches=16
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from nodetrain.config.schema import (
    Config,
    ConfigError,
    grad_accum_of,
    validate,
)
from nodetrain.engine.pipeline import build_schedule, partition, step_rounds
from nodetrain.engine.policy import update_kind
from nodetrain.engine.residency import choose_resident, device_budget_bytes, saved_transfer_bytes
from nodetrain.model import HFModel, build_hf_config
from nodetrain.plan.costs import (
    ModelShape,
    StageMemory,
    field_bytes,
    load_sequence,
    pin_overhead_bytes,
    resident_bytes_per_param,
    saved_per_micro_batch,
    shape_of,
    speculative_backup_bytes,
    stage_memory,
    store_layout,
)
from nodetrain.plan.host import host_problems, preflight
from nodetrain.plan.pricing import host_rates, priced_step
from nodetrain.plan.step_time import HostRates, StepTime
from nodetrain.plan.tier import tier_bytes
from nodetrain.plan.verdict import hints, problems

__all__ = ["GB", "Plan", "make_plan", "model_of", "host_problems", "preflight", "resolve_auto"]

GB = 1e9
"""Bytes in the GB of every figure here (decimal, as datasheets and ``psutil`` totals are quoted)."""
_MAX_MICRO_BATCH = 1 << 16
_AUTO_WITHIN = 0.02
"""An automatic choice takes the smallest batch within this fraction of the best predicted tokens/s."""
_AUTO_MAX_ROUNDS = 8
"""``pipeline.microbatches=auto`` tries S, 2S, 4S … up to this many × the stages."""


def model_of(cfg: Config) -> HFModel:
    """The adapter of ``cfg.model`` with the vocabulary of ``model.hf.vocab_size``, else
    ``data.vocab_size`` (the size the BPE is trained to)."""
    return HFModel(build_hf_config(cfg.model, vocab_size=cfg.model.hf.get("vocab_size", cfg.data.vocab_size)))


# ----------------------------------------------------------------------------- the whole plan


@dataclass(frozen=True)
class _Node:
    """What memory checks need besides the micro-batch size: the model on its stages, the batch
    shape, and the node's limits in bytes."""

    shape: ModelShape
    stage_blocks: list[range]
    seq_len: int
    microbatches: int
    grad_accum: int
    schedule: str
    slots: int
    itemsize: int
    store_bytes: int
    fields: dict[str, int]
    overhead_bytes: int
    """All ranks' overhead beyond the store (``S × plan.rank_overhead_gb``, plus on a GPU profile the
    page-locking of the transfer copies, ``costs.pin_overhead_bytes``)."""
    host_bytes: int
    device_limit_bytes: int
    """Device memory one stage may use; 0 on a CPU profile (the stages then live in host memory)."""
    tier_bytes: int = 0
    """Store bytes on NVMe (``store.tier=nvme``: ``tier.tier_bytes``); 0 with ``store.tier=ram``."""
    tier_pool_bytes: int = 0
    """Host RAM of the tier's buffers (``store.tier_buffers`` × the largest unit's tier fields)."""
    offload_activations: bool = False
    """``stream.offload_activations``: saved block inputs wait in host RAM between forward and backward."""

    @property
    def ram_store_bytes(self) -> int:
        """Host RAM of the store: all of it, or with the tier all but the tier's fields, plus its pool."""
        return self.store_bytes - self.tier_bytes + self.tier_pool_bytes

    @property
    def cpu(self) -> bool:
        return self.device_limit_bytes == 0

    def memory(self, b: int) -> tuple[list[StageMemory], int]:
        """Every stage's peak at micro-batch size ``b``, and the node's host need (store + overhead,
        plus the stages themselves on a CPU profile)."""
        stages = [
            stage_memory(
                self.shape,
                blocks,
                s,
                len(self.stage_blocks),
                b=b,
                t=self.seq_len,
                m=self.microbatches,
                g=self.grad_accum,
                schedule=self.schedule,
                slots=self.slots,
                itemsize=self.itemsize,
                on_cpu=self.cpu,
                offload_activations=self.offload_activations,
            )
            for s, blocks in enumerate(self.stage_blocks)
        ]
        host = self.ram_store_bytes + self.overhead_bytes + sum(x.staging_bytes for x in stages)
        host += sum(x.total_bytes for x in stages) if self.cpu else 0
        host += sum(self._offloaded_bytes(x, b) for x in stages)
        return stages, host

    def _offloaded_bytes(self, st: StageMemory, b: int) -> int:
        """Host RAM of a stage's saved block inputs waiting off the device (all in flight, pinned)."""
        if not self.offload_activations:
            return 0
        return st.in_flight * saved_per_micro_batch(self.shape, st.blocks, b * self.seq_len, self.itemsize)

    def fits(self, b: int) -> bool:
        """Whether micro-batches of ``b`` fit the device (on a CPU profile: the host, with the store)."""
        stages, host = self.memory(b)
        if self.cpu:
            return host <= self.host_bytes
        return max(x.total_bytes for x in stages) <= self.device_limit_bytes

    def resident(self, cfg: Config, b: int) -> list[frozenset[int]]:
        """Per stage, the blocks kept on the device at micro-batch size ``b``: ``stream.device_budget``
        bytes, or the automatic budget (``residency.device_budget_bytes`` of the usable device memory,
        the same arithmetic the engine applies to the memory it finds free); a resident block costs its
        compute-dtype copy and its fp32 gradient accumulator on the device (e + 4 bytes/parameter)."""
        if self.cpu:
            return [frozenset()] * len(self.stage_blocks)
        rounds, per_round = step_rounds(self.schedule, self.grad_accum, self.microbatches)
        head, num_stages = len(self.shape.unit_numels) - 1, len(self.stage_blocks)
        out = []
        for k, st in enumerate(self.memory(b)[0]):
            budget = cfg.stream.device_budget
            if budget == "auto" or budget < 0:
                budget = device_budget_bytes(self.device_limit_bytes, st.window_bytes, st.activation_bytes)
            actions = build_schedule(self.schedule, num_stages, k, per_round) * rounds
            loads = Counter(load_sequence(self.shape, st.blocks, actions))
            numel = {i: self.shape.load_numels[i] for i in st.blocks}
            cost = {i: p * resident_bytes_per_param(self.itemsize) for i, p in numel.items()}
            saved = {
                i: saved_transfer_bytes(p, self.itemsize, loads[i], rounds * per_round)
                for i, p in numel.items()
            }
            out.append(
                frozenset(choose_resident(cost, saved, budget, first=(head,) if head in numel else ()))
            )
        return out

    def max_micro_batch(self) -> int:
        """Largest b in [1, 65536] that fits (peak memory grows with b); 0 if none does."""
        if not self.fits(1):
            return 0
        lo, hi = 1, _MAX_MICRO_BATCH
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(mid) else (lo, mid - 1)
        return lo


@dataclass(frozen=True)
class Plan:
    """Everything the planner reports for one config on one hardware profile."""

    cfg: Config
    shape: ModelShape
    num_stages: int
    fields: dict[str, int]
    """Host store bytes per field (``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``, ``compute``,
    ``grad_tied``)."""
    store_bytes: int
    host_need_bytes: int
    """Host store + per-rank overhead + every stage's D2H staging buffers (+ its window and
    activations on a CPU profile)."""
    stages: list[StageMemory]
    device_limit_bytes: int
    """Device memory one stage may use (device memory − plan.device_reserve_gb); 0 on a CPU profile."""
    max_micro_batch: int
    """Largest ``train.micro_batch_size`` whose peak fits the device (on a CPU profile: the host,
    store included); 0: not even 1."""
    time: StepTime
    train_tokens: float
    nodes: int
    """Nodes to train ``train_tokens`` within ``plan.days`` days (0 when ``plan.days`` is 0)."""
    problems: list[str]
    hints: list[str]
    resident: list[frozenset[int]] = field(default_factory=list)
    """Per stage, the blocks the plan keeps on the device (``stream.device_budget``)."""
    rates: HostRates | None = None
    """The host side the step time assumes (link, DRAM, cores, the accumulation/optimizer split)."""
    choices: list[str] = field(default_factory=list)
    """What ``auto`` became (:func:`resolve_auto`), one line each."""
    tier_bytes: int = 0
    """Store bytes on NVMe (``store.tier=nvme``); the host store in RAM is ``store_bytes`` − this +
    ``tier_pool_bytes``."""
    tier_pool_bytes: int = 0
    compute_bound: tuple[int, int, StepTime] | None = None
    """With the tier or activation offload: the smallest batch found compute-bound,
    (micro-batch size, micro-batches, its step), by :func:`compute_bound_batch`; None: none found."""

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def days_one_node(self) -> float:
        return self.train_tokens / self.time.tokens_per_day

    @property
    def peak_flops(self) -> float:
        """Peak of the devices the plan uses: S GPUs, or the one CPU."""
        hw = self.cfg.hardware
        return hw.peak_flops * (self.num_stages if hw.gpus_per_node else 1)

    @property
    def verdict(self) -> str:
        return "does not fit" if self.problems else f"fits; {self.time.bottleneck}-bound"

    @property
    def searched_compute_bound(self) -> bool:
        """Whether :attr:`compute_bound` was searched (``store.tier=nvme`` or activation offload)."""
        return self.cfg.store.tier == "nvme" or self.cfg.stream.offload_activations


def _check_hardware(cfg: Config, num_stages: int) -> None:
    hw, problems = cfg.hardware, []
    for key in ("peak_flops", "host_link_gbps", "host_memory_gb", "host_memory_bandwidth_gbps"):
        if not getattr(hw, key) > 0:
            problems.append(
                f"hardware.{key}={getattr(hw, key)}: must be > 0; take it from the datasheet (units in "
                "nodetrain/config/schema.py HardwareConfig) or pick a profile of conf/hardware/"
            )
    if not 0 < hw.matmul_efficiency <= 1:
        problems.append(f"hardware.matmul_efficiency={hw.matmul_efficiency}: must be in (0, 1]; use 0.6")
    if hw.cores < 1:
        problems.append(f"hardware.cores={hw.cores}: must be >= 1; the node's CPU cores")
    if hw.gpus_per_node < 0 or (hw.gpus_per_node == 0 and hw.device_memory_gb > 0):
        problems.append(
            f"hardware.gpus_per_node={hw.gpus_per_node}: must be >= 1 on a GPU profile (device_memory_gb="
            f"{hw.device_memory_gb}); 0 only with hardware=cpu (or device_memory_gb=0)"
        )
    if hw.gpus_per_node and not hw.device_memory_gb > cfg.plan.device_reserve_gb:
        what = f"must exceed plan.device_reserve_gb={cfg.plan.device_reserve_gb} on a GPU profile"
        problems.append(f"hardware.device_memory_gb={hw.device_memory_gb}: {what}")
    if hw.gpus_per_node and num_stages > hw.gpus_per_node:
        problems.append(
            f"pipeline.stages={num_stages}: more stages than hardware.gpus_per_node={hw.gpus_per_node} "
            "(one stage per GPU); lower it or use 0"
        )
    if problems:
        raise ConfigError(f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def _node(cfg: Config, shape: ModelShape, num_stages: int) -> _Node:
    hw, dtype = cfg.hardware, getattr(torch, cfg.train.dtype)
    layout = store_layout(shape, dtype, cfg.optim.state)
    device_limit = (
        0 if hw.gpus_per_node == 0 else int((hw.device_memory_gb - cfg.plan.device_reserve_gb) * GB)
    )
    return _Node(
        shape=shape,
        stage_blocks=partition(list(shape.costs), num_stages),
        seq_len=cfg.train.seq_len,
        microbatches=cfg.pipeline.microbatches,
        grad_accum=grad_accum_of(cfg),
        schedule=cfg.pipeline.schedule,
        slots=cfg.stream.slots,
        itemsize=dtype.itemsize,
        store_bytes=layout.nbytes,
        fields=field_bytes(layout),
        overhead_bytes=int(num_stages * cfg.plan.rank_overhead_gb * GB)
        + speculative_backup_bytes(shape, update_kind(cfg.optim) == "speculative")
        + (pin_overhead_bytes(field_bytes(layout)["compute"]) if hw.gpus_per_node else 0),
        host_bytes=int(hw.host_memory_gb * GB),
        device_limit_bytes=device_limit,
        **_tier_fields(cfg, layout),
        offload_activations=cfg.stream.offload_activations,
    )


def _tier_fields(cfg: Config, layout) -> dict[str, int]:
    """``_Node``'s tier bytes and pool with ``store.tier=nvme``; none with ``ram``."""
    if cfg.store.tier != "nvme":
        return {}
    tier, pool = tier_bytes(layout, cfg.store.tier_buffers)
    return {"tier_bytes": tier, "tier_pool_bytes": pool}


def _with_batch(cfg: Config, b: int, m: int) -> Config:
    out = copy.deepcopy(cfg)
    out.train.micro_batch_size, out.pipeline.microbatches = b, m
    return out


def _candidates(cfg: Config, num_stages: int, nodes: int) -> list[tuple[int, int]]:
    """(micro-batch size, micro-batches) pairs to try: the given value of each, or for ``auto`` powers
    of two (sizes) and S, 2S, 4S … (micro-batches); with ``train.batch_size`` only pairs dividing it."""
    b, m = cfg.train.micro_batch_size, cfg.pipeline.microbatches
    sizes = [1 << k for k in range(17)] if b == "auto" else [b]
    counts = [num_stages << k for k in range(_AUTO_MAX_ROUNDS.bit_length())] if m == "auto" else [m]
    if cfg.train.batch_size > 0:
        fits = [(x, y) for x in sizes for y in counts if cfg.train.batch_size % (x * y * nodes) == 0]
        if m == "auto" and not any(y for _, y in fits):
            counts = [y for y in range(1, _AUTO_MAX_ROUNDS * num_stages + 1)]
            fits = [(x, y) for x in sizes for y in counts if cfg.train.batch_size % (x * y * nodes) == 0]
        return fits
    return [(x, y) for x in sizes for y in counts]


def _scored(cfg: Config, shape: ModelShape, num_stages: int, nodes: int) -> list[tuple]:
    """(tokens/s, micro-batch size, micro-batches, step time) of every candidate that fits."""
    scored = []
    for b, m in _candidates(cfg, num_stages, nodes):
        trial = _with_batch(cfg, b, m)
        node = _node(trial, shape, num_stages)
        if node.fits(b):
            t = priced_step(trial, node, b, node.resident(trial, b))
            scored.append((t.tokens / t.step_s, b, m, t))
    return scored


def resolve_auto(
    cfg: Config, model: HFModel | None = None, num_stages: int = 0, nodes: int = 1
) -> tuple[Config, list[str]]:
    """Replace ``auto`` in ``train.micro_batch_size``, ``pipeline.microbatches`` and
    ``stream.device_budget`` by the planner's choice, with one log line per choice.

    Sizes and counts are chosen by the step-time model (:func:`make_plan`'s, ``step_time.step_time``)
    among those whose peak fits the device (``costs.stage_memory``, the one activation model, also
    behind the automatic device budget): the smallest micro-batch size × count within 2% of the
    best predicted tokens/s (a smaller batch for the same speed). ``stream.device_budget=auto``
    becomes -1: the engine sizes it from the device memory free at start-up with the same model.

    Args:
        cfg: a validated config (``auto`` allowed in those keys); model: its adapter (built if None);
        num_stages: stages (0 = ``pipeline.stages``, else one per GPU of ``hardware``); nodes: pipeline
            replicas sharing ``train.batch_size``.

    Returns:
        (a config without ``auto``, the lines saying what was chosen and why).

    Raises:
        ConfigError: no candidate fits (the message gives the memory needed for the smallest).
    """
    b_auto, m_auto = cfg.train.micro_batch_size == "auto", cfg.pipeline.microbatches == "auto"
    if not (b_auto or m_auto or cfg.stream.device_budget == "auto"):
        return cfg, []
    cfg, lines = copy.deepcopy(cfg), []
    if cfg.stream.device_budget == "auto":
        cfg.stream.device_budget = -1
        lines.append(
            "stream.device_budget=auto: sized at start-up from the free device memory (residency.py)"
        )
    if not (b_auto or m_auto):
        return cfg, lines
    num_stages = num_stages or cfg.pipeline.stages or max(1, cfg.hardware.gpus_per_node)
    shape = shape_of(model if model is not None else model_of(cfg))
    scored = _scored(cfg, shape, num_stages, nodes)
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
        (x for x in scored if x[0] >= (1 - _AUTO_WITHIN) * best), key=lambda x: (x[1] * x[2], x[2])
    )
    cfg.train.micro_batch_size, cfg.pipeline.microbatches = b, m
    lines.append(
        f"planner chose train.micro_batch_size={b}, pipeline.microbatches={m} on "
        f"hardware={cfg.hardware.name}: "
        f"{rate:,.0f} tokens/s predicted ({t.bottleneck}-bound), the smallest batch within "
        f"{_AUTO_WITHIN:.0%} of the best of {len(scored)} that fit ({best:,.0f} tokens/s)"
    )
    return cfg, lines


def make_plan(cfg: Config, model: HFModel | None = None) -> Plan:
    """Plan ``cfg`` (model, batch shape, pipeline, ``hardware`` profile) without allocating anything.

    Stages: ``pipeline.stages``, else one per GPU of the profile (1 on a CPU profile). ``auto`` sizes
    are chosen first (:func:`resolve_auto`).

    Raises:
        ConfigError: the config is invalid for that many stages, or the profile is.
    """
    hw = cfg.hardware
    num_stages = cfg.pipeline.stages or max(1, hw.gpus_per_node)
    validate(cfg, world_size=num_stages)
    _check_hardware(cfg, num_stages)
    model = model if model is not None else model_of(cfg)
    cfg, choices = resolve_auto(cfg, model, num_stages)
    validate(cfg, world_size=num_stages)  # the chosen sizes divide train.batch_size
    b = cfg.train.micro_batch_size
    shape = shape_of(model)
    node = _node(cfg, shape, num_stages)
    stages, host_need = node.memory(b)
    resident = node.resident(cfg, b)
    time = priced_step(cfg, node, b, resident)
    train_tokens = cfg.plan.train_tokens or 20 * shape.num_params
    days_one_node = train_tokens / time.tokens_per_day
    max_b = node.max_micro_batch()
    return Plan(
        cfg=cfg,
        shape=shape,
        num_stages=num_stages,
        fields=node.fields,
        store_bytes=node.store_bytes,
        host_need_bytes=host_need,
        stages=stages,
        device_limit_bytes=node.device_limit_bytes,
        max_micro_batch=max_b,
        time=time,
        train_tokens=train_tokens,
        nodes=math.ceil(days_one_node / cfg.plan.days) if cfg.plan.days > 0 else 0,
        problems=problems(cfg, node, stages, host_need, max_b),
        hints=hints(cfg, time, max_b, num_stages),
        resident=resident,
        rates=host_rates(cfg, num_stages),
        choices=choices,
        tier_bytes=node.tier_bytes,
        tier_pool_bytes=node.tier_pool_bytes,
        compute_bound=compute_bound_batch(cfg, shape, num_stages, max_b)
        if cfg.store.tier == "nvme" or cfg.stream.offload_activations
        else None,
    )


_BOUND_MAX_ROUNDS = 64
""":func:`compute_bound_batch` tries up to this many × the stages micro-batches."""


def compute_bound_batch(cfg: Config, shape: ModelShape, num_stages: int, max_b: int):
    """The smallest batch at which ``cfg``'s step is compute-bound: (micro-batch size, micro-batches,
    its ``StepTime``), or None when no micro-batch size that fits (≤ ``max_b``) is, with up to
    :data:`_BOUND_MAX_ROUNDS` × S micro-batches (one round).

    A micro-batch's own streaming (H2D, D2H, accumulation) shrinks against its compute only with
    more tokens per micro-batch; the per-step optimizer and tier I/O and the bubble with more
    micro-batches. So: the smallest power-of-two size compute-bound at the most micro-batches, then
    the fewest micro-batches (S, 2S, 4S …) that stay compute-bound at that size."""
    counts = [num_stages << k for k in range(_BOUND_MAX_ROUNDS.bit_length())]
    sizes = [1 << k for k in range(max(0, max_b).bit_length())]

    def step(b: int, m: int) -> StepTime:
        trial = _with_batch(cfg, b, m)
        trial.train.grad_accum, trial.train.batch_size = 1, 0
        node = _node(trial, shape, num_stages)
        return priced_step(trial, node, b, node.resident(trial, b))

    size = next((b for b in sizes if step(b, counts[-1]).bottleneck == "compute"), 0)
    if not size:
        return None
    return next((size, m, t) for m in counts if (t := step(size, m)).bottleneck == "compute")
