"""The run's shape: every ``auto`` of the config turned into a number once, at start-up.

Owns: :class:`RunShape` (frozen: the batch, every stage's step and placement, the update mode, and
the lines saying what ``auto`` became and why) and :func:`resolve`, which makes it from a config, the
model's shape and a :class:`~nodetrain.core.machine.Machine`. The engine, the planner, the report and
the logs all read the same object; nothing downstream re-derives micro-batches per step, budgets,
placements or the update mode. Pure: the engine measures its machine first (engine/startup.py).

    cfg ─┐                                          ┌─ engine: its stage's plan, resident blocks, policy
    shape ┼─ resolve_batch ─ plans ─ placement ─ update ─ RunShape ─┼─ planner: memory, step time, verdict
    machine ┘                                       └─ logs: lines
"""

from __future__ import annotations

from dataclasses import dataclass

from nodetrain.config.schema import Config
from nodetrain.core.batch import BatchShape, priced_batch, resolve_batch
from nodetrain.core.machine import Machine
from nodetrain.core.placement import AUTO, check_grad_fit, on_device_request
from nodetrain.core.step_plan import StepPlan
from nodetrain.core.update import UpdateChoice
from nodetrain.cost.memory import MARGIN_BYTES, on_device_bytes_per_param, resident_bytes_per_param
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.work import StageWork

__all__ = ["RunShape", "resolve"]


@dataclass(frozen=True)
class RunShape:
    """What the run does, every ``auto`` resolved (identical on every rank).

    Attributes:
        batch: the step's batch (micro-batches per step: ``batch.microbatches_per_step``).
        plans: per stage, its step (``StepPlan``: blocks, actions, loads, offloads).
        budgets: per stage, the device bytes its resident blocks may take.
        resident: per stage, the blocks kept on the device for the whole step.
        update: the update mode and why (``core.update.UpdateChoice``).
        machine: what it was resolved for.
        lines: what each ``auto`` became and why, one line each, for the start-up log.
        on_device: per stage, the resident blocks whose units' optimizer runs on the device
            (``optim.on_device``, core/placement.py); empty: none anywhere.
        kept: per stage, the decoder layers whose activations are kept from the forward to the
            backward, not recomputed (``stream.recompute``, ``core.recompute``).
        grad_acc: per stage, the streamed blocks whose fp32 gradient accumulates on the device and
            leaves once per step (``stream.grad_on_device``, core/placement.py); empty: none anywhere.
    """

    batch: BatchShape
    plans: tuple[StepPlan, ...]
    budgets: tuple[int, ...]
    resident: tuple[frozenset[int], ...]
    update: UpdateChoice
    machine: Machine
    lines: tuple[str, ...] = ()
    on_device: tuple[frozenset[int], ...] = ()
    kept: tuple[frozenset[int], ...] = ()
    grad_acc: tuple[frozenset[int], ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.plans)

    @property
    def stage_blocks(self) -> list[range]:
        """Per stage, its blocks (contiguous unit indices, ``core.schedule.partition``)."""
        return [range(p.blocks[0], p.blocks[-1] + 1) for p in self.plans]

    @property
    def works(self) -> list[StageWork]:
        """Per stage, its step as the cost model counts it, with its resident blocks."""
        return [
            p.work(r, self.on_device_of(k), self.kept[k] if self.kept else (), self.grad_acc_of(k))
            for k, (p, r) in enumerate(zip(self.plans, self.resident, strict=True))
        ]

    def on_device_of(self, stage: int) -> frozenset[int]:
        """Stage ``stage``'s blocks whose optimizer runs on the device (none when unset)."""
        return self.on_device[stage] if self.on_device else frozenset()

    def grad_acc_of(self, stage: int) -> frozenset[int]:
        """Stage ``stage``'s streamed blocks with a device gradient accumulator (none when unset)."""
        return self.grad_acc[stage] if self.grad_acc else frozenset()

    def placement_line(self, stage: int, shape: ModelShape, itemsize: int) -> str:
        """One stage's budget and resident blocks, for the start-up log."""
        resident, blocks = self.resident[stage], self.plans[stage].blocks
        held = sum(
            shape.load_numels[i]
            * (
                on_device_bytes_per_param(itemsize)
                if i in self.on_device_of(stage)
                else resident_bytes_per_param(itemsize)
            )
            for i in resident
        )
        return (
            f"stage {stage}: device budget {self.budgets[stage] / 1e6:.1f} MB, {len(resident)} of "
            f"{len(blocks)} blocks resident ({held / 1e6:.1f} MB with their fp32 gradient accumulators; "
            "chosen by link bytes saved per device byte, the head first); "
            f"{len(self.on_device_of(stage))} with their optimizer on the device; "
            f"{len(self.grad_acc_of(stage))} streamed with their fp32 gradient on the device"
        )


def _budget_lines(cfg: Config, machine: Machine, budgets, streamed) -> list[str]:
    """What ``stream.device_budget=auto`` became on each stage (none when it was given in bytes)."""
    if cfg.stream.device_budget not in AUTO:
        return []
    if machine.on_cpu:
        return ["stream.device_budget=auto: 0 on the CPU (the device is host memory: every block streams)"]
    gb = 1e9
    return [
        f"stream.device_budget=auto on stage {k}: {d / gb:.2f} GB usable - {m.window_bytes / gb:.2f} GB "
        f"window - {m.activation_bytes / gb:.2f} GB activations - {MARGIN_BYTES / gb:.2f} GB margin = "
        f"{x / gb:.2f} GB"
        for k, (d, m, x) in enumerate(zip(machine.device_bytes, streamed, budgets, strict=True))
    ]


def resolve(
    cfg: Config,
    shape: ModelShape,
    machine: Machine,
    num_stages: int,
    nodes: int = 1,
    batch: BatchShape | None = None,
) -> RunShape:
    """Resolve every ``auto`` of ``cfg`` for ``shape`` on ``machine``, once.

    The batch (:func:`~nodetrain.core.batch.resolve_batch`, unless ``batch`` is given: the engine
    resolves it before preparing the data), each stage's step (``StepPlan``), its device budget and
    resident blocks (``placement.place_stages`` over ``machine.device_bytes``), the layers that keep
    their activations in what the resident blocks leave of the budget (``recompute.decide_recompute``)
    and the update mode (``update.choose_update``).

    Args:
        cfg: a validated config; shape: its model; machine: what it runs on (or is planned for);
        num_stages: stages per pipeline; nodes: pipeline replicas.

    Raises:
        ConfigError: an automatic batch that no candidate fits.
    """
    lines: list[str] = []
    if batch is None:
        batch, lines = resolve_batch(cfg, shape, num_stages, nodes)
    fit, budgets, (resident, on_device, grads), recompute, update, _ = priced_batch(
        cfg, shape, machine, batch, num_stages
    )
    streamed = [fit.stage(k, batch.micro_batch_size) for k in range(num_stages)]
    check_grad_fit(cfg.stream.grad_on_device, streamed, machine.device_bytes)
    lines += _budget_lines(cfg, machine, budgets, streamed)
    lines += [update.line] if update.line else []
    lines.append(_on_device_line(cfg, shape, machine, resident, on_device))
    lines.append(_grad_line(cfg, machine, fit.plans, resident, grads))
    lines.append(_wave_line(fit.plans))
    lines += recompute.lines
    return RunShape(
        batch, fit.plans, budgets, resident, update, machine, tuple(lines), on_device, recompute.kept, grads
    )


def _wave_line(plans) -> str:
    """What ``pipeline.wave`` does: W micro-batches per item, its items per step and its bubble."""
    p = plans[0]
    s, items = len(plans), p.num_items // p.rounds
    bubble = (s - 1) / (items + s - 1)
    item = "item" if p.num_items == 1 else "items"
    mbs = "micro-batch" if p.wave == 1 else "micro-batches"
    return (
        f"pipeline.wave={p.wave}: {p.num_items} {item} of {p.wave} {mbs} per step, each streamed "
        f"block loaded once per item and its gradient shipped once per item; bubble {bubble:.1%}"
    )


def _grad_line(cfg: Config, machine: Machine, plans, resident, grads) -> str:
    """What ``stream.grad_on_device`` became: how many streamed blocks accumulate on the device."""
    asked = str(cfg.stream.grad_on_device).lower()
    got = sum(map(len, grads))
    streamed = sum(len(p.blocks) - len(r) for p, r in zip(plans, resident, strict=True))
    automatic = machine.on_cpu and cfg.stream.device_budget in ("auto", -1)
    why = " (the CPU's automatic budget is 0)" if automatic and asked == "auto" and not got else ""
    return (
        f"stream.grad_on_device={asked}: {got} of {streamed} streamed blocks accumulate their fp32 "
        f"gradient on the device and ship it once per step{why}"
    )


def _on_device_line(cfg: Config, shape: ModelShape, machine: Machine, resident, on_device) -> str:
    """What ``optim.on_device`` became: how many resident blocks keep their optimizer on the device, and
    why the others do not."""
    asked = cfg.optim.on_device
    _, why = on_device_request(asked, cfg.optim.state, cfg.store.tier)
    if why:
        return why
    if asked is False:
        return "optim.on_device=false: every unit's optimizer runs on the host"
    got, held = sum(map(len, on_device)), sum(map(len, resident))
    tied = shape.tied and len(resident) > 1
    notes = [
        "the CPU's automatic budget is 0"
        if machine.on_cpu and asked == "auto" and cfg.stream.device_budget in ("auto", -1)
        else "",
        "the tied embedding is read by two stages: it and the head keep their optimizer on the host"
        if tied
        else "",
    ]
    reason = "; ".join(n for n in notes if n)
    return (
        f"optim.on_device={str(asked).lower()}: {got} of {held} resident blocks keep their optimizer "
        "on the device" + (f" ({reason})" if reason else "")
    )
