"""The stage engine: one rank's part of a training step, from micro-batches to updated weights.

Threads of a rank, what each alone writes, and the hand-offs between them (DESIGN invariant 9;
``NODETRAIN_CHECK_THREADS=1`` asserts the writers, threads.py):

    thread     writes (nobody else does)                       hands off by
    ---------  ----------------------------------------------  -----------------------------------------
    training   the step (StepPlan, P2P, StageRunner), the      H2D jobs (a queue) with their gate
               window's sequence, staging and byte counts;     (update futures); D2H jobs (a queue);
               UnitUpdates' futures: the step's ticket (one    the ticket, a message to the optimizer
               "measured" and one "updated" future per unit    thread; backward_done (an Event);
               final in the backward) and the futures loads    update jobs after the all-reduce (the
               wait for (_pending); settled units' gradients   optimizer's queue), each a Future
               (tied sum, replica sum, NaN drop of a skip)
    h2d        device slots, resident buffers, saved inputs    each load's and prefetch's Future (+ CUDA
               brought back (the copies, activations.py)       event)
    d2h        store.grad(u) of every unit not yet final       each offload's Future; an arrival
               (the accumulation), its scratch                 message per block (UnitUpdates.arrived);
                                                               an add's chunks lent to the idle
                                                               optimizer thread (SharedAdd, helper.py)
    optimizer  GradReadiness (the arrival counts, the stage's  resolves the ticket's futures (Final,
               norm² so far); store.grad/master/AdamW state    then updated); busy seconds and bytes
               of a unit from its "final" to its update's end  into a Tally (a lock); a lent add's
               (and, idle, the chunks of an add it claims)     chunks back, each before it completes
    tier       a unit's tier bytes, file ↔ store (tier=nvme;  a Future per read / write-back, waited for
               its pool: the optimizer thread's, tier.py)      by the optimizer (training: overlap=false)

A unit's gradient changes hands once a step: the D2H worker accumulates it until GradReadiness says
it is final (readiness.py: the one place that says so), then the thread that updates it owns it
(the optimizer thread; for settled units the training thread until the update is submitted).
Units kept on the device (``optim.on_device``, device_adamw.py) never change hands: the training
thread alone writes their gradient, state and update.

Owns: wiring store, window, stage runner, P2P and optimizer for this rank (each collaborator built
here and passed to the next's constructor), and the order of a step: pipeline rounds → flush
gradients → sum the tied embedding's two uses → sum gradients over the replicas (replicas.py) → one
all-reduce (global grad norm², loss, the stop request of a signal: every rank stops after the same
step) → clip → the updates the policy leaves for after it (core/update.py decides what each mode does,
overlap.py runs it; logged once at start-up), with the step's phases timed (breakdown.py). Does
not own: the config, data or logging (train.py).

A NaN/inf step is skipped on every stage (``StepResult.skipped``, ``train.max_bad_steps``); the loss
is token-weighted over the whole step (DESIGN invariant 2).

Why, with the step's timeline: docs/design.md#one-step and #threads-and-who-writes-what.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nodetrain.config.constants import DTYPES
from nodetrain.config.schema import Config
from nodetrain.core.run_shape import RunShape
from nodetrain.core.step_plan import StepPlan, row_blocks
from nodetrain.core.topology import replica_slice
from nodetrain.core.update import policy_for
from nodetrain.cost.shape import shape_of
from nodetrain.engine.comm.comm import Comm
from nodetrain.engine.comm.p2p import P2P
from nodetrain.engine.comm.replicas import ReplicaGradSum
from nodetrain.engine.device.activations import saved_offload
from nodetrain.engine.device.device_adamw import DeviceAdamW
from nodetrain.engine.device.window import Window
from nodetrain.engine.host.overlap import UnitUpdates
from nodetrain.engine.rounds import run_round
from nodetrain.engine.stage import IGNORE_INDEX, StageRunner
from nodetrain.engine.step_batch import StepBatch
from nodetrain.engine.threads import check_writer
from nodetrain.model import HFModel
from nodetrain.optim.adamw import clip_coef, lr_at
from nodetrain.run.breakdown import StepBreakdown, Timeline, flops_per_token
from nodetrain.run.inject import Faults

__all__ = ["Engine", "StepResult", "DTYPES"]

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step did, identical on every rank (``loss`` and ``grad_norm`` are all-reduced)."""

    step: int
    loss: float
    """Objective, nats/token: token-weighted mean cross-entropy (+ coef · aux_loss, HF's outputs.loss)."""
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
    in-backward updates, those of units whose own gradient was finite
    (docs/optimizer.md#the-four-update-modes)."""
    stop: bool = False
    """Some rank asked to stop (a signal) before this step's all-reduce: every rank stops after it."""
    breakdown: dict = field(default_factory=dict)
    """On rank 0: every stage's step breakdown, flat (see ``breakdown.combine_stages``); else {}."""
    aux_loss: float | None = None
    """Router auxiliary loss without its coefficient (HF's ``outputs.aux_loss``, moe.py), or None: none."""


class Engine:
    """This rank's stage: owns a contiguous range of units and trains them.

    Built by :func:`~nodetrain.engine.startup.build_engine` (which opens the store and resolves the
    run first); construction only wires the parts together.

    Args:
        cfg: the validated run config.
        run: the resolved run (``core.run_shape.resolve``): the batch, this stage's step and resident
            blocks, the update mode.
        model: the HF adapter (templates + units).
        opened: what the rank opened before (``startup.Opened``: topology, device, cores, peak, host
            store, optimizer).
        faults: test-only fault injection (run/inject.py).
    """

    def __init__(self, cfg: Config, run: RunShape, model: HFModel, opened, faults: Faults) -> None:
        self.cfg, self.run, self.model, self.device = cfg, run, model, opened.device
        self.topo = topo = opened.topo
        self.stage, self.num_stages = topo.stage, topo.num_stages
        self.dtype = DTYPES[cfg.train.dtype]
        self.faults = faults
        self.plan = run.plans[topo.stage]
        """This stage's step, the one expansion of its schedule (core/step_plan.py)."""
        self.blocks = range(self.plan.blocks[0], self.plan.blocks[-1] + 1)
        self.units = [model.units[i] for i in self.blocks]
        self._is_last = topo.stage == topo.num_stages - 1
        self.host_threads, self.store, self.optimizer = opened.cores, opened.store, opened.optimizer
        self._tied_across = model.tied and topo.num_stages > 1
        self.comm = Comm(self.device)
        # Two communicators for the cross-replica sums: the optimizer thread's (in-backward) and the
        # training thread's; NCCL forbids concurrent use of one from two threads (replicas.py).
        self.grad_sum = ReplicaGradSum(topo, cfg.dist.timeout_s, self.comm)
        self.grad_sum_optim = ReplicaGradSum(topo, cfg.dist.timeout_s, self.comm, kind="stage_optim")
        self._peak = opened.peak
        resident = sorted(run.resident[topo.stage])
        log.info("%s", run.placement_line(topo.stage, shape_of(model), self.dtype.itemsize))
        self.device_opt = DeviceAdamW(
            self.store, self.optimizer, model.bindings, run.on_device_of(topo.stage), self.device
        )  # the units of the stage's on-device blocks (optim.on_device); none: a no-op
        device_grads = dict(zip(self.device_opt.units, self.device_opt.grads, strict=True))
        self._poison = self.faults.nan_hook(self.store, self.units[-1].index, device_grads)  # None: off
        self.updates = self._make_updates(resident)
        self.timeline = Timeline(self.device)
        self.window = self._make_window(resident)
        self.device_opt.bind_weights(self.window.resident_views)
        self._loads = self.plan.window_loads(self.window.rows)  # the window's load sequence of a step
        self._arrivals = self.plan.arrivals([*self.window.resident, *self.window.grad_acc], self.window.rows)
        b = run.batch
        shape = (b.micro_batch_size, b.seq_len, model.config.hidden_size)
        offload = saved_offload(cfg.stream, self.plan, self.blocks, self._is_last, self.window, shape)
        kept = run.kept[topo.stage] if run.kept else frozenset()
        self.runner = StageRunner(model, self.blocks, self.window, self.dtype, offload, kept)
        self.p2p = P2P(
            topo.stage, topo.num_stages, shape, self.dtype, self.comm, topo.pipeline_ranks, self.timeline
        )
        self.breakdown = self._make_breakdown()
        self._log_layout()

    # ---- set-up ------------------------------------------------------------------------------

    def _make_window(self, resident) -> Window:
        rows = row_blocks(self.blocks, resident)  # a streamed embedding: by rows
        return Window(
            self.store,
            self.model.bindings,
            self.blocks,
            self.cfg.stream.slots,
            self.device,
            resident=resident,
            device_grads={b: self.device_opt.grad_views(b) for b in self.device_opt.blocks},
            grad_acc=self.run.grad_acc_of(self.stage),
            rows=rows,
            accum_threads=self.host_threads.accum_threads,
            wave=self.plan.wave,
            gate=self.updates.gate,
            on_arrival=self.updates.arrived,
            helper=self.updates.helper if self.cfg.stream.accum_help else None,  # the idle optimizer thread
            timeline=self.timeline,
            faults=self.faults,
        )

    def _make_updates(self, resident) -> UnitUpdates:
        """The overlapped optimizer, with the policy the run resolved (logged with its reason)."""
        policy = policy_for(self.cfg.optim, self.run.update.kind)
        log.info("optimizer updates: %s", policy.reason)
        return UnitUpdates(
            self.optimizer,
            self.model.bindings,
            self.blocks,
            policy,
            shared_units=(0,) if self._tied_across and self.stage == 0 else (),
            threads=self.host_threads.optim_threads,
            grad_sum=self.grad_sum_optim,  # in-backward: each unit's replica sum, on the optimizer thread
            on_final=self._poison,
            device=self.device,
            faults=self.faults,
        )

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
            "device_optimizer_bytes": self.device_opt.nbytes,
            "num_on_device": len(self.device_opt.blocks),
            "num_kept": len(self.runner.kept),
            "num_grad_on_device": len(self.window.grad_acc),
            "grad_acc_bytes": self.window.grad_acc_nbytes,
            "wave": self.plan.wave,
            "wave_bytes": self.window.sums.wave_nbytes,
        }
        return StepBreakdown(self.device, per_token, peak, static, self.topo.num_stages, self.timeline)

    def _log_layout(self) -> None:
        topo, units = self.topo, self.model.units
        log.info(
            "stage %d/%d (replica %d/%d): %s … %s, %d units, window %.1f MB (resident: %s; wave %d: "
            "%.1f MB of fp32 wave sums), host store %.1f MB, %.2f bytes/parameter (optim.state=%s)",
            topo.stage,
            topo.num_stages,
            topo.replica,
            topo.num_replicas,
            units[self.blocks[0]].name,
            units[self.blocks[-1]].name,
            len(self.blocks),
            self.window.nbytes / 1e6,
            ", ".join(units[i].name for i in self.window.resident) or "none",
            self.plan.wave,
            self.window.sums.wave_nbytes / 1e6,
            self.store.nbytes / 1e6,
            self.store.nbytes / sum(u.numel for u in units),
            self.cfg.optim.state,
        )

    # ---- one step ----------------------------------------------------------------------------

    def train_step(
        self,
        step: int,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        stop: bool = False,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> StepResult:
        """One optimizer step over the run's micro-batches (``run.batch.microbatches_per_step``), in the
        pipeline rounds of :func:`~nodetrain.engine.pipeline.step_rounds` (1F1B: one round of all of them).

        Args:
            step: 0-based optimizer step (sets the learning rate).
            inputs: [N, B, T] int64 token ids of the global batch, N = ``run.batch.global_microbatches``
                (same on all ranks; each replica runs its N / replicas, see replicas.py).
            labels: [N, B, T] int64 next-token ids, -100 where no loss is taken.
            stop: this rank was asked to stop (a signal); shared with every rank in ``StepResult.stop``.
            position_ids: [N, B, T] int64 positions of packed documents (restarting at 0 for each,
                see nodetrain/data/packing.py), or None (0..T-1 in every row).
            token_mask: [N, B, T] bool, False on the rows' padding (``PackedRows.token_mask``), which
                a router auxiliary loss leaves out; None = no padding.

        Raises:
            ValueError: a batch of the wrong shape.
        """
        check_writer("training", "the engine's step")
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.timeline.start()
        self._check_batch(inputs, labels, self.run.batch.global_microbatches)
        tokens = int((labels != IGNORE_INDEX).sum())  # of the global batch: every replica scales by it
        inputs, labels, positions = self._replica_share(inputs, labels, position_ids)
        if token_mask is not None:  # this replica's share, as the inputs'
            token_mask = token_mask[
                replica_slice(token_mask.shape[0], self.topo.replica, self.topo.num_replicas)
            ]
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        batch = StepBatch.of(self.runner, inputs, labels, positions, self.device, token_mask)  # one H2D each
        loss_sum = self._forward_backward(step, lr, batch, tokens)
        grad_sq = self._settle_grads(step)
        with self.timeline.phase("optim"):
            totals = self.comm.tensor([grad_sq, 0.0, float(stop), 0.0])  # on the group's device
            totals[1].copy_(loss_sum)  # the step's one read of the loss (with the all-reduce's)
            totals[3].copy_(self.runner.take_aux_loss())  # every stage's MoE layers' share
            self._add_device_grad_sq(totals)
        with self.timeline.phase("bubble"):
            self.comm.all_reduce(totals)  # NaN/inf on any stage makes the sums non-finite on every stage
        grad_sq_all, loss_all, stop_all, aux = totals.tolist()  # one device → host copy
        grad_norm = math.sqrt(grad_sq_all)
        skipped = not math.isfinite(grad_sq_all + loss_all + aux)
        self._update(step, lr, grad_norm, skipped)
        phases = self.timeline.stop()
        now = time.perf_counter()
        record = self.breakdown.stage_record(now - t0, inputs.numel(), phases, self._busy(cpu0))
        loss = loss_all / max(tokens, 1) + self.model.aux_coef * aux
        stall_s, p2p_wait_s = self.window.stall_s, self.p2p.wait_s
        res = StepResult(step, loss, grad_norm, lr, tokens, now - t0, stall_s, p2p_wait_s, phases["optim_s"])
        res.skipped, res.stop, res.aux_loss = skipped, stop_all > 0, aux if self.model.router_aux else None
        res.breakdown = self.breakdown.gather(record)
        return res

    def _add_device_grad_sq(self, totals: torch.Tensor) -> None:
        """Add the on-device units' Σ gradient² into ``totals[0]`` (the stage's norm², before the
        all-reduce) without a host sync; replicas ≠ 0 count none (replicas.py)."""
        if self.topo.replica == 0:
            totals[0].add_(self.device_opt.grad_sq().to(totals.device))

    def _forward_backward(self, step: int, lr: float, batch: StepBatch, tokens: int) -> torch.Tensor:
        """The step's pipeline rounds, with the window and the updates armed for them; returns the
        summed token loss (fp64 scalar on the device; 0 off the last stage). The gradients are all
        in the host store when it returns (flushed)."""
        self.device_opt.load()  # once: a resume has restored the store by now
        self.updates.begin_step(lr, self._arrivals, step)
        self.window.begin(self._loads, self.plan.backwards)
        self.p2p.reset_timer()
        self.p2p.reset_peak()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for r in range(self.plan.rounds):
            run_round(self, self.plan.actions, r, batch, 1.0 / max(tokens, 1), True, loss_sum, self.plan.wave)
        self.updates.end_backward()
        self.window.flush()
        with self.timeline.phase("bubble"):
            self.p2p.wait_sends()
        return loss_sum

    def _settle_grads(self, step: int) -> float:
        """Make the step's gradients final; returns this stage's Σ gradient² (0 on replicas ≠ 0,
        each stage is counted once, see replicas.py).

        In-backward (overlap.py), the units updated during the backward already had their replica
        sum and norm² on the optimizer thread: wait for those first (no collective of that thread may
        overlap the ones below), then the settled units (readiness.py: the tied embedding, or every
        unit when none is updated in the backward) go through the tied sum and the replica sum here.
        """
        with self.timeline.phase("optim"):
            self.updates.wait_measured()
            settled = self.updates.later_units
            if self._poison is not None:
                self._poison(step, *settled, *self.device_opt.units)
            self._sum_tied_grads()
            self.device_opt.sum_tied()
        with self.timeline.phase("bubble"):  # the cross-node sum, before any of these units is updated
            self.grad_sum([self.store.grad(u) for u in settled] + self.device_opt.grads)
        with self.timeline.phase("optim"):
            return self.updates.grad_sq_sum(self.window.run_host) if self.topo.replica == 0 else 0.0

    def _update(self, step: int, lr: float, grad_norm: float, skipped: bool) -> None:
        """After the all-reduce: the updates the policy leaves for now, or the skip of a NaN/inf step."""
        with self.timeline.phase("optim"):  # the run's last step leaves the store final
            last, coef = step + 1 == self.cfg.train.steps, clip_coef(grad_norm, self.cfg.optim.max_grad_norm)
            if skipped:
                self._skip_step(step)  # the device's gradients are overwritten by the next step's first
            else:
                self.updates.finish_step(lr, coef, last)
            if not skipped:
                self.device_opt.step(lr, coef)
            if last:  # the run's last step leaves the store final
                self.device_opt.save()
        if self._tied_across:
            with self.timeline.phase("bubble"):
                dist.barrier()  # the last stage must not prefetch the embedding before stage 0 updated it

    def _busy(self, cpu0: float) -> dict:
        """The step's busy seconds and bytes of every component (breakdown.py's record)."""
        busy = {**self.window.take_stats(), **self.updates.take_stats(), **self.runner.take_stats()}
        busy["p2p_peak_bytes"] = self.p2p.peak_bytes  # live P2P buffers' high-water mark (costs.stage_memory)
        busy["cpu_s"] = time.process_time() - cpu0
        return busy

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
        if self.updates.policy.kind != "in_backward":
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

    def _check_batch(self, inputs: torch.Tensor, labels: torch.Tensor, num_mb: int) -> None:
        b = self.run.batch
        want = (num_mb, b.micro_batch_size, b.seq_len)
        if tuple(inputs.shape) != want or tuple(labels.shape) != want:
            raise ValueError(
                f"batch of shape {tuple(inputs.shape)}/{tuple(labels.shape)}; expected {want} "
                "(micro-batches, train.micro_batch_size, train.seq_len)"
            )

    def wait_optimizer(self) -> None:
        """Block until every submitted AdamW update is done: call before reading master weights or
        optimizer state between steps (a checkpoint); a load of a unit always waits for it. The
        device-held state (``optim.on_device``) is written back into the host store first."""
        self.updates.wait_all()
        self.device_opt.save()

    def _replica_share(self, inputs: torch.Tensor, labels: torch.Tensor, positions=None):
        """This replica's micro-batches of the global batch ([N, B, T] → [N/K, B, T]; see replicas.py)."""
        share = replica_slice(inputs.shape[0], self.topo.replica, self.topo.num_replicas)
        return inputs[share], labels[share], None if positions is None else positions[share]

    def _sum_tied_grads(self) -> None:
        """Tied embedding: stage 0 adds the last stage's gradient of the lm_head use to its own."""
        if not self._tied_across:
            return
        with self.timeline.phase("bubble"):
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
        self.device_opt.load()  # once: a resume has restored the store by now
        plan = StepPlan.evaluation(inputs.shape[0], self.blocks, self._is_last)
        self.window.begin(plan.window_loads(self.window.rows))
        batch = StepBatch.of(self.runner, inputs, labels, positions, self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with self.model.eval_mode():
            run_round(self, plan.actions, 0, batch, 1.0, False, loss_sum)  # one micro-batch per item
        self.window.flush()
        self.p2p.wait_sends()
        total = self.comm.tensor([0.0])
        total[0].copy_(loss_sum)  # the evaluation's one read of the loss
        self.comm.all_reduce(total)
        return float(total[0]) / max(tokens, 1), tokens

    def close(self) -> None:
        """Stop the optimizer thread and the copy workers (after their work), let go of every view of
        the store they held, then close it: its mapping goes here (a checkpoint writer keeps none)."""
        self.updates.close()
        self.window.close()
        self.runner.close()
        self.optimizer.close()
        self.store.close()
