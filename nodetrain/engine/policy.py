"""The update policy: what a step does with each unit, chosen once from ``optim``.

Owns: the four modes (:func:`update_kind` names them, :func:`policy_for` builds one, the engine logs
its :attr:`UpdatePolicy.reason` at start-up) and each one's decisions, as small classes testable
alone: what happens to a unit whose gradient became final during the backward
(:meth:`UpdatePolicy.on_final`), which updates run after the step's all-reduce
(:meth:`UpdatePolicy.after_allreduce`), and what a NaN/inf step undoes
(:meth:`UpdatePolicy.rolled_back`). Does not own when a unit is final (readiness.py), the thread the
updates run on or their futures (overlap.py), or the AdamW arithmetic (optim/adamw.py).

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
from dataclasses import dataclass

from nodetrain.config.schema import OptimConfig

__all__ = ["Final", "UpdatePolicy", "policy_for", "update_kind", "update_mode"]

KINDS = ("serial", "deferred", "in_backward", "speculative")


def update_kind(cfg: OptimConfig) -> str:
    """Which update mode ``cfg`` runs: one of :data:`KINDS` (``plan/exposure.py`` prices each), or
    ``auto``: ``optim.speculative=auto`` where speculation applies (clipping, overlap,
    ``update_in_backward``), resolved at start-up to speculative or deferred (update_choice.py)."""
    if not cfg.overlap:
        return "serial"
    if cfg.max_grad_norm > 0 and cfg.update_in_backward and cfg.speculative in (True, "auto"):
        return "speculative" if cfg.speculative is True else "auto"
    if cfg.max_grad_norm > 0 or not cfg.update_in_backward:
        return "deferred"
    return "in_backward"


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


def policy_for(cfg: OptimConfig) -> UpdatePolicy:
    """The policy ``cfg`` runs (``optim.speculative=auto`` resolved first, update_choice.py).

    Raises:
        ValueError: ``optim.speculative=auto`` not yet resolved where it applies.
    """
    kind = update_kind(cfg)
    if kind == "auto":
        raise ValueError(
            "optim.speculative=auto: resolve it to true or false first (engine/update_choice.py)"
        )
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
