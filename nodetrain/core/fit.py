"""Whether a batch fits a node: every stage's device memory and the node's host memory at a
micro-batch size, and the largest size that fits.

Owns: :class:`NodeFit` (the node's limits and needs in bytes for one config, its stages' steps
fixed) and building it from a config (:func:`node_fit`). Used by the automatic batch (batch.py) and
the planner's report. Does not own the bytes of a stage or of the store (cost/memory.py), which
blocks stay resident (placement.py) or the verdict's wording (plan/verdict.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nodetrain.config.schema import Config
from nodetrain.core.machine import GB
from nodetrain.core.schedule import partition
from nodetrain.core.step_plan import StepPlan
from nodetrain.core.update import update_kind
from nodetrain.cost.memory import (
    StageMemory,
    field_bytes,
    pin_overhead_bytes,
    saved_per_micro_batch,
    stage_memory,
    store_layout,
)
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.tier import ram_store_bytes, tier_bytes
from nodetrain.cost.traffic import speculative_backup_bytes
from nodetrain.cost.work import StageWork

__all__ = ["NodeFit", "node_fit", "profile_host_free_bytes", "MAX_MICRO_BATCH"]

MAX_MICRO_BATCH = 1 << 16
"""The largest micro-batch size :meth:`NodeFit.max_micro_batch` tries."""


@dataclass(frozen=True)
class NodeFit:
    """What memory checks need besides the micro-batch size: the model on its stages and their steps,
    the sequence length, and the node's limits in bytes."""

    shape: ModelShape
    plans: tuple[StepPlan, ...]
    """Per stage, its step (the stage's blocks, actions and peaks)."""
    seq_len: int
    slots: int
    itemsize: int
    store_bytes: int
    fields: dict[str, int]
    overhead_bytes: int
    """All ranks' overhead beyond the store (``S × plan.rank_overhead_gb``, plus on a GPU profile the
    page-locking of the transfer copies, ``cost.memory.pin_overhead_bytes``, plus speculative backups)."""
    host_bytes: int
    device_limit_bytes: int
    """Device memory one stage may use; 0 on a CPU profile (the stages then live in host memory)."""
    tier_bytes: int = 0
    """Store bytes on NVMe (``store.tier=nvme``: ``cost.tier.tier_bytes``); 0 with ``store.tier=ram``."""
    tier_pool_bytes: int = 0
    """Host RAM of the tier's buffers (``store.tier_buffers`` × the largest unit's tier fields)."""
    offload_activations: bool = False
    """``stream.offload_activations``: saved block inputs wait in host RAM between forward and backward."""
    grad_on_device: bool = False
    """``stream.grad_on_device=true``: every streamed block keeps an fp32 gradient accumulator on the
    device, counted in each stage's memory (and so left out of the automatic budget first)."""
    keep_all: bool = False
    """``stream.recompute=false``: every decoder layer keeps its activations for every micro-batch in
    flight, counted in each stage's memory (so in the fit and left out of the automatic budget first;
    ``auto`` keeps only what the budget leaves, core/recompute.py)."""

    @property
    def stage_blocks(self) -> list[range]:
        return [range(p.blocks[0], p.blocks[-1] + 1) for p in self.plans]

    @property
    def ram_store_bytes(self) -> int:
        """Host RAM of the store: all of it, or with the tier all but the tier's fields, plus its pool
        (``cost.tier.ram_store_bytes``)."""
        return self.store_bytes - self.tier_bytes + self.tier_pool_bytes

    @property
    def cpu(self) -> bool:
        return self.device_limit_bytes == 0

    def stage(self, k: int, b: int, resident=(), on_device=(), grad_acc=None) -> StageMemory:
        """Stage ``k``'s peak device bytes at micro-batch size ``b`` with ``resident`` blocks kept, those
        of ``on_device`` with their optimizer there too, and the streamed blocks of ``grad_acc`` with a
        device gradient accumulator (None: every streamed block with :attr:`grad_on_device`, else none);
        with :attr:`keep_all` every layer's kept activations."""
        if grad_acc is None:
            grad_acc = self.plans[k].blocks if self.grad_on_device else ()
        last = len(self.shape.unit_numels) - 1
        kept = [i for i in self.plans[k].blocks if 0 < i < last] if self.keep_all else ()
        return self.memory_of(self.plans[k].work(resident, on_device, kept, grad_acc), b)

    def memory_of(self, work: StageWork, b: int) -> StageMemory:
        """Peak device bytes of one stage's ``work`` with its placement as given (resident, on-device,
        kept and accumulating blocks: ``RunShape.works``) at micro-batch size ``b``."""
        return stage_memory(
            self.shape,
            work,
            b=b,
            t=self.seq_len,
            slots=self.slots,
            itemsize=self.itemsize,
            on_cpu=self.cpu,
            offload_activations=self.offload_activations,
        )

    def memory(self, b: int) -> tuple[list[StageMemory], int]:
        """Every stage's peak at micro-batch size ``b`` (nothing resident), and the node's host need
        (store + overhead, plus the stages themselves on a CPU profile)."""
        stages = [self.stage(k, b) for k in range(len(self.plans))]
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

    def max_micro_batch(self) -> int:
        """Largest b in [1, :data:`MAX_MICRO_BATCH`] that fits (peak memory grows with b); 0 if none does."""
        if not self.fits(1):
            return 0
        lo, hi = 1, MAX_MICRO_BATCH
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(mid) else (lo, mid - 1)
        return lo


def profile_host_free_bytes(cfg: Config, shape: ModelShape) -> int:
    """The profile's host RAM less the host store's RAM (``cost.tier.ram_store_bytes``) and, on a GPU
    profile, the page-locking of its transfer copies: what ``Machine.host_free_bytes`` holds when a
    profile describes the machine."""
    hw, layout = cfg.hardware, store_layout(shape, getattr(torch, cfg.train.dtype), cfg.optim.state)
    pin = pin_overhead_bytes(field_bytes(layout)["compute"]) if hw.gpus_per_node else 0
    return int(hw.host_memory_gb * GB) - ram_store_bytes(layout, cfg.store.tier, cfg.store.tier_buffers) - pin


def node_fit(
    cfg: Config, shape: ModelShape, num_stages: int, microbatches: int, grad_accum: int, hardware=None
) -> NodeFit:
    """The :class:`NodeFit` of ``cfg`` with ``microbatches`` per round and ``grad_accum`` rounds per step,
    the stages partitioned as the engine partitions them, on ``hardware`` (default ``cfg.hardware``;
    the engine's: ``Machine.hardware``, the profile of the host it measured)."""
    hw, dtype = hardware or cfg.hardware, getattr(torch, cfg.train.dtype)
    layout = store_layout(shape, dtype, cfg.optim.state)
    fields = field_bytes(layout)
    device_limit = (
        0 if hw.gpus_per_node == 0 else int((hw.device_memory_gb - cfg.plan.device_reserve_gb) * GB)
    )
    last, wave = len(shape.unit_numels) - 1, cfg.pipeline.wave
    plans = tuple(
        StepPlan.step(
            cfg.pipeline.schedule, num_stages, k, grad_accum, microbatches, blocks, last in blocks, wave
        )
        for k, blocks in enumerate(partition(list(shape.costs), num_stages))
    )
    tier = tier_bytes(layout, cfg.store.tier_buffers) if cfg.store.tier == "nvme" else (0, 0)
    pin = pin_overhead_bytes(fields["compute"]) if hw.gpus_per_node else 0
    return NodeFit(
        shape=shape,
        plans=plans,
        seq_len=cfg.train.seq_len,
        slots=cfg.stream.slots,
        itemsize=dtype.itemsize,
        store_bytes=layout.nbytes,
        fields=fields,
        overhead_bytes=int(num_stages * cfg.plan.rank_overhead_gb * GB)
        + speculative_backup_bytes(shape, update_kind(cfg.optim) == "speculative")
        + pin,
        host_bytes=int(hw.host_memory_gb * GB),
        device_limit_bytes=device_limit,
        tier_bytes=tier[0],
        tier_pool_bytes=tier[1],
        offload_activations=cfg.stream.offload_activations,
        grad_on_device=cfg.stream.grad_on_device is True,
        keep_all=cfg.stream.recompute is False,
    )
