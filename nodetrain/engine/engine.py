"""The stage engine: one rank's part of a training step, from micro-batches to updated weights.

One step, 2 stages, 2 micro-batches, 1F1B (time →; F1 = forward of micro-batch 1, B = backward):

    stage 0  | F0 F1 ·· ·· B0 ·· B1 | flush | tied sum | replicas |-.
    stage 1  | ·· F0 B0 F1 ·· B1 ·· | flush | tied sum | replicas |-+- all-reduce: norm², loss,
                                                                   |  tokens, stop request
    each     clip coefficient → AdamW of the units left (overlap.py) → refresh transfer copies → next
    (activations go 0 → 1 and gradients 1 → 0 by P2P between F/B; the window streams each stage's
    blocks through its slots and the D2H worker adds their gradients into the host store meanwhile)

Owns: wiring store, window, stage runner, P2P and optimizer for this rank, and the order of a
step: pipeline rounds → flush gradients → sum the tied embedding's two uses → sum gradients over
the replicas (several nodes, see replicas.py) → one all-reduce (global grad norm² and loss) → clip
→ AdamW → refresh the transfer copy, with the AdamW of each unit on a background thread and the
step's phases timed (breakdown.py). The same all-reduce carries the stop request of a signal
(faults.StopRequest), so every rank stops after the same step. Does not own: the config, data or
logging (train.py).

When each unit is updated (overlap.py decides; logged once at start-up):
    in-backward (``optim.overlap``, ``optim.max_grad_norm=0``, ``optim.update_in_backward``)  as
        soon as the unit's gradient is final, during the rest of the backward; its cross-replica
        sum and norm² run on the optimizer thread just before. Only the tied embedding shared
        across stages waits for the step's all-reduce (its gradient is final after the tied sum).
    speculative (clipping, ``optim.speculative``)  as in-backward with coefficient 1; a step that
        clipped rolls them back and redoes them (overlapped with the next forward), a NaN/inf step
        rolls them back (skipped whole); ``num_rollbacks`` counts the units rolled back.
        ``optim.speculative=auto``: speculative or deferred, chosen at start-up by measurement
        (update_choice.py).
    deferred (clipping, or ``optim.update_in_backward=false``)  every unit after the all-reduce,
        overlapped with the next step's forward; the cross-replica sum runs here, before it.
    ``optim.overlap=false``  every unit at the end of the step, on the training thread.

A step whose all-reduced loss or gradient norm is NaN/inf is reported skipped on every stage (they
all see the same totals; ``StepResult.skipped``, ``train.max_bad_steps``), and no non-finite value
reaches the master weights or AdamW's state. Deferred, the whole step is skipped: gradients
dropped, no AdamW update. In-backward, the units whose gradient was NaN/inf were left out by the
optimizer thread's per-unit guard, the units with finite gradients of that step were already
updated, and the units left for after the all-reduce are not updated.

Exactness (DESIGN invariant 2): the loss is the sum of token cross-entropies over every
micro-batch and accumulation round of the step divided by the step's valid-token count, so
any micro-batch split gives the same gradient as one big batch.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from nodetrain.config.constants import DTYPES
from nodetrain.config.schema import Config, grad_accum_of
from nodetrain.engine.comm import Comm
from nodetrain.engine.host_threads import (
    CoreSplit,
    bind_threads,
    cuda_pci_bus_ids,
    fair_share_threads,
    numa_binding,
    split_cores,
)
from nodetrain.engine.overlap import UnitUpdates, update_mode
from nodetrain.engine.pipeline import P2P, Action, build_schedule, p2p_groups, partition, step_rounds
from nodetrain.engine.replicas import ReplicaGradSum, Topology, node_group, replica_slice
from nodetrain.engine.residency import resident_blocks
from nodetrain.engine.stage import IGNORE_INDEX, StageRunner, stage_loads, stage_offloads
from nodetrain.engine.step_batch import StepBatch
from nodetrain.engine.update_choice import choose_update_mode
from nodetrain.engine.window import Window, arrival_order
from nodetrain.model import HFModel
from nodetrain.optim.adamw import StoreAdamW, clip_coef, lr_at
from nodetrain.optim.lean import LeanAdamW, init_lean
from nodetrain.run.breakdown import (
    StepBreakdown,
    flops_per_token,
    hardware_profiles,
    measured_peak_flops,
    peak_flops_line,
    select_peak_flops,
)
from nodetrain.run.faults import nan_injection
from nodetrain.store import HostStore, StoreLayout

__all__ = ["Engine", "StepResult", "DTYPES"]

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step did, identical on every rank (``loss`` and ``grad_norm`` are all-reduced)."""

    step: int
    loss: float
    """Token-weighted mean cross-entropy of the step (nats/token)."""
    grad_norm: float
    """Global L2 norm of the gradient before clipping."""
    lr: float
    tokens: int
    """Valid (label ≠ -100) tokens in the step."""
    step_s: float
    stall_s: float
    """This rank's seconds waiting for H2D prefetch."""
    p2p_wait_s: float
    """This rank's seconds blocked receiving activations/gradients (bubble + transfer)."""
    optim_s: float
    """This rank's seconds of optimizer work the step waited for (not hidden behind compute)."""
    skipped: bool = False
    """The loss or gradient norm was NaN/inf: no update was applied (on any stage), except, with
    in-backward updates, those of units whose own gradient was finite (see the module docstring)."""
    stop: bool = False
    """Some rank asked to stop (a signal) before this step's all-reduce: every rank stops after it."""
    breakdown: dict = field(default_factory=dict)
    """On rank 0: every stage's step breakdown, flat (see ``breakdown.combine_stages``); else {}."""


def _host_threads(cfg, device: torch.device, local_rank: int) -> CoreSplit:
    """Bind this rank's threads to its GPU's NUMA node (more than one node) and split its cores between
    the D2H accumulation and the optimizer (host_threads.py); both logged, whatever OMP_NUM_THREADS is."""
    sharing = 0
    if device.type == "cuda":
        index = device.index if device.index is not None else local_rank
        binding = numa_binding(cuda_pci_bus_ids(), index, allowed=os.sched_getaffinity(0))
        if binding.cpus is not None:
            bind_threads(binding.cpus)
        sharing = binding.ranks_sharing
        log.info("NUMA: %s", binding.reason)
    else:
        log.info("NUMA: device %s is not a GPU: threads not bound", device)
    split = split_cores(fair_share_threads(sharing), cfg.stream.accum_threads, cfg.optim.threads)
    log.info("%s (OMP_NUM_THREADS=%s)", split.reason, os.environ.get("OMP_NUM_THREADS", "unset"))
    return split


class Engine:
    """This rank's stage: owns a contiguous range of units and trains them.

    Args:
        cfg: the validated run config.
        model: the HF adapter (templates + units).
        rank, world_size: this rank in the (single-node) pipeline; stage = rank.
        local_rank: rank on the node (local rank 0 creates the host store).
        run_id: names the store file.
        device: compute device (CPU, or this rank's CUDA device).
        init_from: optional callable ``(store, units) -> None`` that fills master weights of the
            given units (checkpoint import); default is random init.
        topology: stage and replica of this rank when several nodes each run a replica of the
            pipeline (see replicas.py); default: one pipeline over the world, stage = rank.
    """

    def __init__(
        self,
        cfg: Config,
        model: HFModel,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        run_id: str,
        device: torch.device,
        init_from=None,
        topology: Topology | None = None,
    ):
        self.cfg, self.model, self.device = cfg, model, device
        self.topo = topo = topology or Topology.single(rank, world_size, local_rank)
        self.stage, self.num_stages = topo.stage, topo.num_stages
        self.dtype = DTYPES[cfg.train.dtype]
        self.grad_accum = grad_accum_of(cfg, topo.num_replicas)
        costs = [model.block_cost(i) for i in range(len(model.units))]
        self.stage_blocks = partition(costs, topo.num_stages)
        self.blocks = self.stage_blocks[topo.stage]
        self.units = [model.units[i] for i in self.blocks]
        # bind first: opening the store first-touches this rank's units' pages (NUMA placement)
        self.host_threads = _host_threads(cfg, device, topo.local_rank)
        self.store = self._open_store(topo.local_rank, run_id)
        self.optimizer = (
            LeanAdamW(self.store, self.units, cfg.optim, cfg.seed)
            if cfg.optim.state == "lean"
            else StoreAdamW(self.store, self.units, cfg.optim)
        )
        self._init_weights(init_from)
        if device.type == "cuda":  # only the transfer copies this rank's H2D copies read
            self.store.pin({b.unit for i in self.blocks for b in model.bindings[i]})
        self._tied_across = model.tied and topo.num_stages > 1
        self.comm = Comm(device)
        # Two communicators for the cross-replica sums: the optimizer thread's (in-backward) and the
        # training thread's; NCCL forbids concurrent use of one from two threads (replicas.py).
        self.grad_sum = ReplicaGradSum(topo, cfg.dist.timeout_s, self.comm)
        self.grad_sum_optim = ReplicaGradSum(topo, cfg.dist.timeout_s, self.comm, kind="stage_optim")
        self._step = [0]  # the step being run, read by the NaN injection (on the optimizer thread too)
        self._poison = nan_injection(cfg.test, self.store, self.units[-1].index, self._step)  # None: off
        self._peak = self._peak_flops()  # before the residency budget reads free device memory
        resident = resident_blocks(
            cfg, model, self.blocks, topo.stage, topo.num_stages, device, self.grad_accum, self._uses()
        )
        self.updates = self._make_updates(device, resident)
        self.window = Window(
            self.store,
            model.bindings,
            self.blocks,
            self.blocks,
            cfg.stream.slots,
            device,
            cfg.stream.test_copy_delay_s,
            resident=resident,
            rows=[0] if 0 in self.blocks and 0 not in resident else [],  # a streamed embedding: by rows
            accum_threads=self.host_threads.accum_threads,
        )
        self.window.gate, self.window.on_offloaded = self.updates.gate, self.updates.offloaded
        self.runner = StageRunner(model, self.blocks, self.window, self.dtype)
        shape = (cfg.train.micro_batch_size, cfg.train.seq_len, model.config.hidden_size)
        self.p2p = P2P(topo.stage, topo.num_stages, shape, self.dtype, self.comm, topo.pipeline_ranks)
        self.breakdown = self._make_breakdown()
        self.window.timeline = self.p2p.timeline = self.breakdown.timeline
        log.info(
            "stage %d/%d (replica %d/%d): %s … %s, %d units, window %.1f MB (resident: %s), "
            "host store %.1f MB, %.2f bytes/parameter (optim.state=%s)",
            topo.stage,
            topo.num_stages,
            topo.replica,
            topo.num_replicas,
            model.units[self.blocks[0]].name,
            model.units[self.blocks[-1]].name,
            len(self.blocks),
            self.window.nbytes / 1e6,
            ", ".join(model.units[i].name for i in self.window.resident) or "none",
            self.store.nbytes / 1e6,
            self.store.nbytes / sum(u.numel for u in model.units),
            cfg.optim.state,
        )

    def _make_updates(self, device: torch.device, resident) -> UnitUpdates:
        """The overlapped optimizer, in the mode :func:`update_mode` gives (logged with its reason);
        ``optim.speculative=auto`` is resolved first, by measurement (update_choice.py; collective)."""
        cfg = self.cfg
        choice = choose_update_mode(
            cfg,
            self.model,
            stage_blocks=self.stage_blocks,
            topo=self.topo,
            comm=self.comm,
            peak_flops=self._peak[0],
            split=self.host_threads,
            resident=resident,
            grad_accum=self.grad_accum,
            device=device,
        )
        self.update_choice = choice
        """What ``optim.speculative`` became, and the start-up line saying why (``auto``)."""
        if choice.line:
            log.info("%s", choice.line)
        optim = replace(cfg.optim, speculative=choice.speculative)
        in_backward, why = update_mode(optim)
        log.info("optimizer updates: %s", why)
        updates = UnitUpdates(
            self.optimizer,
            self.model.bindings,
            self.blocks,
            shared_units=(0,) if self._tied_across and self.stage == 0 else (),
            overlap=optim.overlap,
            clip=optim.max_grad_norm > 0,
            threads=self.host_threads.optim_threads,
            delay_s=optim.test_delay_s,
            defer=not optim.update_in_backward,
            grad_sum=self.grad_sum_optim,  # in-backward: each unit's replica sum, on the optimizer thread
            on_final=self._poison,
            device=device,
            speculative=optim.speculative,
            max_grad_norm=optim.max_grad_norm,
        )
        assert updates.in_backward == in_backward
        return updates

    def _make_breakdown(self) -> StepBreakdown:
        n = sum(self.model.block_cost(i) for i in self.blocks)
        layers = sum(1 for i in self.blocks if 0 < i <= self.model.num_layers)
        per_token = flops_per_token(self.model.config, n, layers, self.cfg.train.seq_len)
        peak, source = self._peak
        static = {
            "peak_flops_source": source,
            "window_bytes": self.window.nbytes,
            "resident_bytes": self.window.resident_nbytes,
            "num_resident": len(self.window.resident),
            "resident_units": ",".join(self.model.units[i].name for i in self.window.resident),
            "store_bytes": self.store.nbytes,
        }
        return StepBreakdown(self.device, per_token, peak, static, self.topo.num_stages)

    # ---- set-up ------------------------------------------------------------------------------

    def _peak_flops(self) -> tuple[float, str]:
        """MFU's denominator (``breakdown.select_peak_flops``), logged with its source. A measured
        matmul's device memory goes back to the driver before the residency budget is read."""
        cuda = self.device.type == "cuda"
        name = torch.cuda.get_device_name(self.device) if cuda else None
        peak, source = select_peak_flops(
            self.cfg.train.peak_flops, name, self.cfg.hardware, hardware_profiles()
        )
        if peak is None:
            peak = measured_peak_flops(str(self.device), self.dtype, torch.get_num_threads())
            if cuda:
                torch.cuda.empty_cache()
        log.info(peak_flops_line(peak, source))
        return peak, source

    def _open_store(self, local_rank: int, run_id: str) -> HostStore:
        """Local rank 0 creates the node's store without allocating it, the others map it, and each
        rank allocates its own units' pages (after ``_host_threads`` bound it: first touch on its
        GPU's NUMA node); then the name goes (store.py's lifecycle). Collective over the world."""
        layout = StoreLayout(
            tuple(u.numel for u in self.model.units),
            self.dtype,
            tied_units=(0,) if self.model.tied else (),
            state=self.cfg.optim.state,
        )
        path = [None]
        if local_rank == 0:
            directory, cleanup = Path(self.cfg.store.dir), self.cfg.store.cleanup_stale
            store = HostStore.create(layout, directory, run_id, cleanup, populate=False)
            path = [str(store.path)]
        node = node_group(self.topo, self.cfg.dist.timeout_s)
        dist.broadcast_object_list(path, src=self.topo.node_root, group=node)  # one per node
        if local_rank != 0:
            store = HostStore.attach(layout, path[0])
        store.populate([u.index for u in self.units])
        dist.barrier()  # every rank has mapped it and allocated its units: the name can go
        store.unlink()
        return store

    def _init_weights(self, init_from) -> None:
        if self.cfg.optim.state == "lean":
            init_lean(self.optimizer, self.model, self.units, init_from, self.cfg.seed)
            dist.barrier()  # the tied embedding's transfer copy is read by the last stage
            return
        if init_from is not None:
            init_from(self.store, self.units)
        else:
            for u in self.units:
                self.model.init_unit(u, self.store.master(u.index), self.cfg.seed)
        for u in self.units:
            self.store.compute(u.index).copy_(self.store.master(u.index))
        dist.barrier()  # the tied embedding's transfer copy is read by the last stage

    def _uses(self) -> dict[int, tuple[int, int]]:
        """Per block, (loads, backwards) in one step of this stage's schedule (residency's ranking; the
        embedding counted as if it streamed whole: whether it goes by rows depends on this choice)."""
        rounds, per_round = step_rounds(
            self.cfg.pipeline.schedule, self.grad_accum, self.cfg.pipeline.microbatches
        )
        actions = build_schedule(self.cfg.pipeline.schedule, self.num_stages, self.stage, per_round) * rounds
        is_last = self.stage == self.num_stages - 1
        loads = Counter(b for a in actions for b in stage_loads(self.blocks, is_last, (), a.kind))
        backwards = Counter(b for a in actions for b in stage_offloads(self.blocks, is_last, a.kind))
        return {b: (loads[b], backwards[b]) for b in self.blocks}

    # ---- one step ----------------------------------------------------------------------------

    def _offload_sequence(self, actions, rounds: int) -> list[int]:
        """Blocks in the order their gradients are offloaded in a step (``StageRunner.offloads``: the
        head at each forward, the other blocks at each backward, in reverse)."""
        return [b for a in actions * rounds for b in self.runner.offloads(a.kind)]

    def _settle_grads(self) -> float:
        """Make the step's gradients final; returns this stage's Σ gradient² (0 on replicas ≠ 0,
        each stage is counted once, see replicas.py).

        In-backward (overlap.py), the units updated during the backward already had their replica
        sum and norm² on the optimizer thread: wait for those first (no collective of that thread may
        overlap the ones below), then the remaining units (the tied embedding) go through the tied
        sum and the replica sum here. Deferred, every unit does, and none was updated yet.
        """
        timeline = self.breakdown.timeline
        with timeline.phase("optim"):
            self.updates.wait_measured()
            later = self.updates.later_units
            if self._poison is not None:
                self._poison(*later)
            self._sum_tied_grads()
        with timeline.phase("bubble"):  # the cross-node sum, before any of these units is updated
            self.grad_sum([self.store.grad(u) for u in later])
        with timeline.phase("optim"):
            return self.updates.grad_sq_sum(self.window.run_host) if self.topo.replica == 0 else 0.0

    def _skip_step(self, step: int) -> None:
        """A NaN/inf step: no further update, gradients dropped (after every running update)."""
        self.updates.wait_all()  # an update still reading its gradient must not see it zeroed
        rolled_back = self.updates.rollback()  # speculative updates undone: the step skipped whole
        self.optimizer.drop_grads()
        if rolled_back:
            names = [self.model.units[u].name for u in rolled_back]
            log.warning(
                "step %d: loss or gradient norm is NaN/inf; speculative updates of %s rolled back, "
                "update skipped on every stage",
                step + 1,
                names,
            )
            return
        if not self.updates.in_backward or self.updates.speculative:
            log.warning("step %d: loss or gradient norm is NaN/inf; update skipped on every stage", step + 1)
            return
        names = [self.model.units[u].name for u in self.updates.nonfinite]
        later = [self.model.units[u].name for u in self.updates.later_units]
        log.warning(
            "step %d: loss or gradient norm is NaN/inf on some stage; rank %d left out %s (NaN/inf "
            "gradient) and %s (updated only after the step's all-reduce); with "
            "optim.update_in_backward=true the step's units with finite gradients were updated during "
            "the backward; set optim.update_in_backward=false to skip whole steps",
            step + 1,
            dist.get_rank(),
            names,
            later,
        )

    def _load_sequence(self, actions, rounds: int) -> list[int]:
        seq = []
        for _ in range(rounds):
            for a in actions:
                seq += self.runner.loads(a.kind)
        return seq

    def _run_round(self, actions, r: int, batch: StepBatch, loss_scale: float, train: bool, loss_sum) -> None:
        """Run one pipeline round's actions; the last stage adds each forward's summed token loss
        into ``loss_sum`` (an fp64 scalar on the device, read on the host once per step)."""
        base = r * sum(a.kind == "F" for a in actions)  # micro-batches of the earlier rounds
        groups = p2p_groups(actions, self.stage, self.num_stages)  # paired send/recv: NCCL-safe order
        out = None
        for a, group in zip(actions, groups[:-1], strict=True):
            got = self.p2p.exchange(group, out, base)
            mb = base + a.mb
            lab, pos, packed = batch.microbatch(mb)  # views of the step's device copies
            if a.kind == "F":
                x = batch.inputs[mb] if self.runner.is_first else got.to(self.device)
                out = self.runner.forward(mb, x, lab, train, pos, loss_scale, packed)
                if self.runner.is_last:
                    loss_sum += out  # on the device: no sync per micro-batch
            else:
                g = None if self.runner.is_last else got.to(self.device)
                out = self.runner.backward(mb, g, position_ids=pos, packed=packed)
        self.p2p.exchange(groups[-1], out, base)

    def _check_batch(self, inputs: torch.Tensor, labels: torch.Tensor, num_mb: int) -> None:
        t = self.cfg.train
        want = (num_mb, t.micro_batch_size, t.seq_len)
        if tuple(inputs.shape) != want or tuple(labels.shape) != want:
            raise ValueError(
                f"batch of shape {tuple(inputs.shape)}/{tuple(labels.shape)}; expected {want} "
                "(micro-batches, train.micro_batch_size, train.seq_len)"
            )

    def train_step(
        self,
        step: int,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        stop: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> StepResult:
        """One optimizer step over ``grad_accum × pipeline.microbatches`` micro-batches, in the
        pipeline rounds of :func:`~nodetrain.engine.pipeline.step_rounds` (1F1B: one round of all of them).

        Args:
            step: 0-based optimizer step (sets the learning rate).
            inputs: [N, B, T] int64 token ids of the global batch, N = grad_accum × microbatches ×
                replicas (same on all ranks; each replica runs its N / replicas, see replicas.py).
            labels: [N, B, T] int64 next-token ids, -100 where no loss is taken.
            stop: this rank was asked to stop (a signal); shared with every rank in ``StepResult.stop``.
            position_ids: [N, B, T] int64 positions of packed documents (restarting at 0 for each,
                see nodetrain/data/packing.py), or None (0..T-1 in every row).

        Raises:
            ValueError: a batch of the wrong shape.
        """
        t0, cpu0 = time.perf_counter(), time.process_time()
        timeline = self.breakdown.timeline
        timeline.start()
        m = self.cfg.pipeline.microbatches
        self._check_batch(inputs, labels, self.grad_accum * m * self.topo.num_replicas)
        tokens = int((labels != IGNORE_INDEX).sum())  # of the global batch: every replica scales by it
        inputs, labels, positions = self._replica_share(inputs, labels, position_ids)
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        rounds, per_round = step_rounds(self.cfg.pipeline.schedule, self.grad_accum, m)
        actions = build_schedule(self.cfg.pipeline.schedule, self.num_stages, self.stage, per_round)
        self._step[0] = step
        backwards = self._offload_sequence(actions, rounds)
        arrivals = arrival_order(backwards, self.window.resident)  # a resident block's: once, at its last
        self.updates.begin_step(lr, Counter(arrivals), arrivals)
        self.window.begin(self._load_sequence(actions, rounds), Counter(backwards))
        self.p2p.reset_timer()
        self.p2p.reset_peak()
        batch = StepBatch.of(self.runner, inputs, labels, positions, self.device)  # one H2D per tensor
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for r in range(rounds):
            self._run_round(actions, r, batch, 1.0 / max(tokens, 1), True, loss_sum)
        self.updates.end_backward()
        self.window.flush()
        with timeline.phase("bubble"):
            self.p2p.wait_sends()
        grad_sq = self._settle_grads()
        with timeline.phase("optim"):
            totals = self.comm.tensor([grad_sq, 0.0, float(stop)])  # on the group's device
            totals[1].copy_(loss_sum)  # the step's one read of the loss (with the all-reduce's)
        with timeline.phase("bubble"):
            self.comm.all_reduce(totals)  # NaN/inf on any stage makes the sums non-finite on every stage
        grad_sq_all, loss_all, stop_all = totals.tolist()  # one device → host copy
        grad_norm = math.sqrt(grad_sq_all)
        skipped = not math.isfinite(grad_sq_all + loss_all)
        with timeline.phase("optim"):  # the run's last step leaves the store final
            if skipped:
                self._skip_step(step)
            else:
                last = step + 1 == self.cfg.train.steps
                self.updates.finish_step(lr, clip_coef(grad_norm, self.cfg.optim.max_grad_norm), last)
        if self._tied_across:
            with timeline.phase("bubble"):
                dist.barrier()  # the last stage must not prefetch the embedding before stage 0 updated it
        phases = timeline.stop()
        now = time.perf_counter()
        busy = {**self.window.take_stats(), "optim_busy_s": self.updates.take_busy_s()}
        busy["optim_host_bytes"] = self.updates.take_host_bytes()
        busy["num_updates_in_backward"] = self.updates.take_in_backward_count()
        busy["num_rollbacks"] = self.updates.take_rollbacks()
        busy["p2p_peak_bytes"] = self.p2p.peak_bytes  # live P2P buffers' high-water mark (costs.stage_memory)
        busy["cpu_s"] = time.process_time() - cpu0
        record = self.breakdown.stage_record(now - t0, inputs.numel(), phases, busy)
        loss = loss_all / max(tokens, 1)
        stall_s, p2p_wait_s = self.window.stall_s, self.p2p.wait_s
        res = StepResult(step, loss, grad_norm, lr, tokens, now - t0, stall_s, p2p_wait_s, phases["optim_s"])
        res.skipped, res.stop = skipped, stop_all > 0
        res.breakdown = self.breakdown.gather(record)
        return res

    def wait_optimizer(self) -> None:
        """Block until every submitted AdamW update is done: call before reading master weights or
        optimizer state between steps (a checkpoint); a load of a unit always waits for it."""
        self.updates.wait_all()

    def _replica_share(self, inputs: torch.Tensor, labels: torch.Tensor, positions=None):
        """This replica's micro-batches of the global batch ([N, B, T] → [N/K, B, T]; see replicas.py)."""
        share = replica_slice(inputs.shape[0], self.topo.replica, self.topo.num_replicas)
        return inputs[share], labels[share], None if positions is None else positions[share]

    def _sum_tied_grads(self) -> None:
        """Tied embedding: stage 0 adds the last stage's gradient of the lm_head use to its own."""
        if not self._tied_across:
            return
        with self.breakdown.timeline.phase("bubble"):
            dist.barrier()  # the last stage's offloads into grad_tied are flushed
        if self.stage == 0:
            tied = self.store.buffer(0, "grad_tied")
            self.store.grad(0).add_(tied)
            tied.zero_()

    @torch.no_grad()
    def eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[float, int]:
        """Forward-only pass over N micro-batches ([N, B, T] each); returns (mean loss, tokens),
        identical on every rank. The replicas share the N micro-batches. No gradients, no optimizer
        state is touched; dropout is off (eval mode) and no random numbers are drawn."""
        self._check_batch(inputs, labels, inputs.shape[0])
        tokens = int((labels != IGNORE_INDEX).sum())
        inputs, labels, positions = self._replica_share(inputs, labels, position_ids)
        actions = [Action("F", i) for i in range(inputs.shape[0])]
        self.window.begin(self._load_sequence(actions, 1))
        batch = StepBatch.of(self.runner, inputs, labels, positions, self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with self.model.eval_mode():
            self._run_round(actions, 0, batch, 1.0, False, loss_sum)
        self.window.flush()
        self.p2p.wait_sends()
        total = self.comm.tensor([0.0])
        total[0].copy_(loss_sum)  # the evaluation's one read of the loss
        self.comm.all_reduce(total)
        return float(total[0]) / max(tokens, 1), tokens

    def close(self) -> None:
        self.updates.close()
        self.window.close()
        self.store.unpin()
