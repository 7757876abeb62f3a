"""The update policy: what a step does with each unit, chosen once from ``optim``.

Owns: the four modes (:func:`update_kind` names them, :func:`policy_for` builds one, the engine logs
its :attr:`UpdatePolicy.reason` at start-up), the rule that picks speculative or deferred updates
from their predicted steps (:func:`choose_speculative`), and each mode's decisions, as small classes
testable alone: what happens to a unit whose gradient became final during the backward
(:meth:`UpdatePolicy.on_final`), which updates run after the step's all-reduce
(:meth:`UpdatePolicy.after_allreduce`), and what a NaN/inf step undoes
(:meth:`UpdatePolicy.rolled_back`). Does not own when a unit is final (step_plan.py, the engine's
readiness), the thread the updates run on or their futures (engine/host/overlap.py), the prices
(cost/exposure.py) or the AdamW arithmetic (optim/adamw.py).

Modes:
    serial (``optim.overlap=false``)  every unit at the step's end, on the training thread.
    deferred (clipping, or ``optim.update_in_backward=false``)  every unit after the all-reduce,
        overlapped with the next step's forward; a NaN/inf step is skipped whole.
    in_backward (no clipping, ``optim.update_in_backward``)  each unit as soon as its gradient is
        final; a unit whose gradient is NaN/inf is left out, the finite ones applied.
    speculative (clipping, ``optim.speculative``; SuperOffload, arXiv:2509.21271)  as in_backward
        with coefficient 1 and a backup first; a step that clipped rolls them back and redoes them,
        a NaN/inf step rolls them back; once the stage's own norm exceeds ``max_grad_norm`` the
        step surely clips and the rest of its units are held for the all-reduce.

Why, and what each costs: docs/optimizer.md#the-four-update-modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from nodetrain.config.schema import Config, OptimConfig
from nodetrain.core.machine import Machine
from nodetrain.core.pricing import host_rates, matmul_flops, priced_step
from nodetrain.cost.exposure import CLIP_FRACTION
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.step_time import StepTime
from nodetrain.cost.traffic import speculative_backup_bytes
from nodetrain.cost.work import StageWork

__all__ = [
    "KINDS",
    "SPECULATE_GAIN",
    "Final",
    "UpdateChoice",
    "UpdatePolicy",
    "choose_speculative",
    "choose_update",
    "speculation_applies",
    "policy_for",
    "update_kind",
    "update_mode",
]

KINDS = ("serial", "deferred", "in_backward", "speculative")

SPECULATE_GAIN = 0.02
"""``optim.speculative=auto`` speculates only when that shortens the predicted step by more than this
fraction: speculation costs 12 B/param of private host RAM and optimizer-thread work for a gain the
model must show clearly, not within its own error."""


def update_kind(cfg: OptimConfig) -> str:
    """Which update mode ``cfg`` runs: one of :data:`KINDS` (``cost/exposure.py`` prices each), or
    ``auto``: ``optim.speculative=auto`` where speculation applies (clipping, overlap,
    ``update_in_backward``), resolved once at start-up to speculative or deferred (run_shape.py)."""
    if not cfg.overlap:
        return "serial"
    if cfg.max_grad_norm > 0 and cfg.update_in_backward and cfg.speculative in (True, "auto"):
        return "speculative" if cfg.speculative is True else "auto"
    if cfg.max_grad_norm > 0 or not cfg.update_in_backward:
        return "deferred"
    return "in_backward"


def choose_speculative(deferred_step_s: float, speculative_step_s: float, backup_fits: bool) -> bool:
    """``optim.speculative=auto``: speculate when the backups fit host RAM and the predicted step
    (``cost.step_time.step_time``, speculative priced at ``cost.exposure.CLIP_FRACTION`` clipped steps)
    is shorter than the deferred one by more than :data:`SPECULATE_GAIN`."""
    return backup_fits and speculative_step_s < (1 - SPECULATE_GAIN) * deferred_step_s


@dataclass(frozen=True)
class UpdateChoice:
    """The update mode a run takes, and why."""

    kind: str
    """One of :data:`KINDS`."""
    line: str = ""
    """``optim.speculative=auto``'s start-up line (empty when the config fixed the mode)."""
    priced: dict[str, StepTime] = field(default_factory=dict)
    """The modes priced to choose (``deferred``, ``speculative``), each mode's step."""


def _not_speculating(cfg: Config) -> str:
    """Why ``optim.speculative=auto`` cannot speculate on this run, or "" when it may."""
    if update_kind(cfg.optim) != "auto":
        return "speculation needs optim.overlap, clipping and optim.update_in_backward"
    if cfg.optim.state == "lean":
        return "optim.state=lean keeps no fp32 state to back up"
    if cfg.store.tier == "nvme":
        return "store.tier=nvme keeps the fp32 state a backup would copy out of host RAM"
    return ""


def speculation_applies(cfg: Config) -> bool:
    """``optim.speculative=auto`` on a run that could speculate: the choice needs the step priced."""
    return cfg.optim.speculative == "auto" and not _not_speculating(cfg)


def choose_update(
    cfg: Config, shape: ModelShape, works: list[StageWork], machine: Machine, b: int
) -> UpdateChoice:
    """The update mode of ``cfg``: as configured, or for ``optim.speculative=auto`` speculative or
    deferred by :func:`choose_speculative` of both modes' steps priced on ``machine`` (its measured
    optimizer rate and peak when the engine measured them) and of whether the backups and every
    rank's ``plan.rank_overhead_gb`` fit ``machine.host_free_bytes``.

    Args:
        cfg: the run; shape: its model; works: per stage its step with its blocks placed;
        machine: what prices it; b: sequences per micro-batch.
    """
    o = cfg.optim
    if o.speculative != "auto":
        return UpdateChoice(update_kind(o))
    if why := _not_speculating(cfg):
        return UpdateChoice(
            update_kind(replace(o, speculative=False)), f"optim.speculative=auto: {why}; not speculating"
        )
    priced = {mode: priced_step(cfg, shape, works, machine, mode, b) for mode in ("deferred", "speculative")}
    backup = speculative_backup_bytes(shape, True)  # all ranks of the node (one stage each)
    headroom = len(works) * int(cfg.plan.rank_overhead_gb * 1e9)  # windows, activations to come
    fits = backup + headroom <= machine.host_free_bytes
    chosen = choose_speculative(priced["deferred"].step_s, priced["speculative"].step_s, fits)
    kind = "speculative" if chosen else "deferred"
    line = _choice_line(cfg, machine, priced, (backup, headroom, fits), kind, len(works))
    return UpdateChoice(kind, line, priced)


def _choice_line(cfg: Config, machine: Machine, priced: dict, memory, kind: str, num_stages: int) -> str:
    """The start-up line: the optimizer's rate, both modes' exposed optimizer and step, the backups'
    fit in RAM (``memory``: backup and headroom bytes, whether they fit) and the choice."""
    backup, headroom, fits = memory
    deferred, spec = priced["deferred"], priced["speculative"]
    x, ms, threads = spec.exposure, 1e3, machine.cores.optim_threads
    hw = machine.hardware.name
    if machine.optimizer_bytes_per_s:
        gbps, source = min(machine.optimizer_bytes_per_s) / 1e9, "measured, slowest rank"
    else:
        gbps, source = host_rates(machine, num_stages).rate(threads)[0] / 1e9, f"hardware={hw}"
    rate = f"{gbps:.1f} GB/s on {threads} thread(s) ({source})"
    peak = "lowest peak" if machine.peak_flops else "peak"
    return (
        f"optim.speculative=auto: AdamW {rate}, compute {matmul_flops(cfg, machine) / 1e12:.3g} TFLOP/s "
        f"({peak} × hardware={hw}'s matmul_efficiency); optimizer the next step waits for: deferred "
        f"{deferred.optimizer_exposed_s * ms:,.1f} ms, speculative {spec.optimizer_exposed_s * ms:,.1f} ms "
        f"({x.speculative_s * ms:,.1f} unclipped, {x.speculative_clipped_s * ms:,.1f} clipped, "
        f"{CLIP_FRACTION:.0%} of steps assumed to clip); step {deferred.step_s * ms:,.1f} vs "
        f"{spec.step_s * ms:,.1f} ms; backups {backup / 1e9:.3g} GB (+ {headroom / 1e9:.3g} GB headroom) "
        f"{'fit' if fits else 'do not fit'} in the available RAM "
        f"({machine.host_free_bytes / 1e9:.1f} GB here) → {kind} updates"
    )


@dataclass(frozen=True)
class Final:
    """The optimizer thread's verdict on a unit whose gradient became final in the backward."""

    sq: float
    """Its gradient's Σ g² (after the replica sum); NaN/inf when the gradient is."""
    dots: list | None
    """Speculative: its fp32 Σ g² terms (the deferred sum's own, for the same clip coefficient)."""
    action: str
    """``update`` (coefficient 1), ``speculate`` (backed up, then coefficient 1), ``hold`` (for the
    all-reduce) or ``drop`` (NaN/inf: left out, its gradient zeroed)."""


class UpdatePolicy:
    """Deferred: nothing in the backward; every unit after the all-reduce, in forward order."""

    kind = "deferred"
    overlap = True
    """Updates run on the optimizer thread (else on the training thread at the step's end)."""
    in_backward = False
    """Units are updated during the backward as their gradients become final."""
    keeps_dots = False

    def __init__(self, cfg: OptimConfig) -> None:
        self.max_grad_norm = cfg.max_grad_norm
        self.reason = _reason(self.kind, cfg)

    def on_final(self, sq: float, stage_sq: float) -> str:
        """The action (see :class:`Final`) for a final unit with Σ g² ``sq``, ``stage_sq`` the stage's
        Σ so far with it (optimizer thread, in-backward policies only)."""
        raise AssertionError(f"{self.kind}: no unit is final during the backward")

    def after_allreduce(self, owned, settled, finals: dict[int, Final], grad_scale: float) -> list:
        """(unit, ``update`` | ``redo``) to run once the clip coefficient ``grad_scale`` is known, in
        forward order: ``settled`` units (readiness.py) and those the backward held or must redo."""
        return [(u, "update") for u in settled]

    def rolled_back(self, finals: dict[int, Final]) -> list[int]:
        """Units whose update a NaN/inf step undoes (the step is then skipped whole)."""
        return []


class Serial(UpdatePolicy):
    kind, overlap = "serial", False


class InBackward(UpdatePolicy):
    kind, in_backward = "in_backward", True

    def on_final(self, sq: float, stage_sq: float) -> str:
        return "update" if math.isfinite(sq) else "drop"


class Speculative(UpdatePolicy):
    kind, in_backward, keeps_dots = "speculative", True, True

    def on_final(self, sq: float, stage_sq: float) -> str:
        if not math.isfinite(sq):
            return "drop"
        # the global norm² is at least this stage's: past the threshold the step surely clips
        return "hold" if math.sqrt(stage_sq) + 1e-6 > self.max_grad_norm else "speculate"

    def after_allreduce(self, owned, settled, finals: dict[int, Final], grad_scale: float) -> list:
        later = set(settled) | {u for u, f in finals.items() if f.action == "hold"}
        redo = {u for u, f in finals.items() if f.action == "speculate"} if grad_scale != 1.0 else set()
        return [(u, "update") if u in later else (u, "redo") for u in owned if u in later | redo]

    def rolled_back(self, finals: dict[int, Final]) -> list[int]:
        return [u for u, f in finals.items() if f.action == "speculate"]


_POLICIES = {
    "serial": Serial,
    "deferred": UpdatePolicy,
    "in_backward": InBackward,
    "speculative": Speculative,
}


def policy_for(cfg: OptimConfig, kind: str | None = None) -> UpdatePolicy:
    """The policy of mode ``kind`` (the run shape's, :func:`choose_update`), default ``cfg``'s own.

    Raises:
        ValueError: ``optim.speculative=auto`` not resolved (no ``kind`` given) where it applies.
    """
    kind = kind or update_kind(cfg)
    if kind == "auto":
        raise ValueError("optim.speculative=auto: resolve it to true or false first (core/run_shape.py)")
    return _POLICIES[kind](cfg)


def update_mode(cfg: OptimConfig) -> tuple[bool, str]:
    """Whether units are updated during the backward, and why (one line for the start-up log).

    Raises:
        ValueError: ``optim.speculative=auto`` not yet resolved where it applies.
    """
    policy = policy_for(cfg)
    return policy.in_backward, policy.reason


def _reason(kind: str, cfg: OptimConfig) -> str:
    if kind == "serial":
        return "optim.overlap=false: every unit is updated at the step's end on the training thread"
    if kind == "speculative":
        return (
            f"optim.max_grad_norm={cfg.max_grad_norm} with optim.speculative=true: each unit is updated "
            "during the backward as if the step were not clipped; a step that clips has those updates "
            "rolled back and redone with the clip coefficient, a NaN/inf step has them rolled back "
            "(skipped whole)"
        )
    if kind == "deferred" and cfg.max_grad_norm > 0:
        return (
            f"optim.max_grad_norm={cfg.max_grad_norm}: the clip needs the global norm, so updates run after "
            "the step's all-reduce, overlapped with the next step's forward; a NaN/inf step is skipped whole"
        )
    if kind == "deferred":
        return (
            "optim.update_in_backward=false: updates run after the step's all-reduce, overlapped with the "
            "next step's forward; a NaN/inf step is skipped whole"
        )
    return (
        "no clipping and optim.update_in_backward=true: each unit is updated during the backward as soon "
        "as its gradient is final; a unit with a NaN/inf gradient is left out, the finite ones applied"
    )
