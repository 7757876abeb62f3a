"""Shared cores: a step's CPU seconds when the stages compute on the node's cores (a CPU profile).

Owns: a stage's CPU seconds in a step (:func:`core_seconds`: its compute plus the bytes its threads
move at one core's bandwidth) and the step's floor from them (:func:`shared_cores_floor`). Pure
arithmetic; ``step_time.py`` applies it (docs/planner.md, the step-time model's last paragraph).
"""

from __future__ import annotations

from nodetrain.cost.traffic import StageTraffic

__all__ = ["core_seconds", "shared_cores_floor"]


def shared_cores_floor(seconds, traffic, core_bytes_per_s: float, shared_cores: int):
    """(per stage its CPU seconds, the step's floor from them) when the stages share ``shared_cores``
    cores (else ``([], 0.0)``): work-conserving, every stage's CPU seconds over the node's cores, and
    at least the busiest stage's over its share of them. ``seconds``: per stage, its compute seconds
    first (``step_time._Stages.seconds``); ``traffic``: per stage its bytes; ``core_bytes_per_s``:
    one core's bandwidth (bytes/s)."""
    if not shared_cores:
        return [], 0.0
    core_s = [core_seconds(p[0], x, core_bytes_per_s) for p, x in zip(seconds, traffic, strict=True)]
    per_stage = max(1, shared_cores // len(core_s))
    return core_s, max(sum(core_s) / shared_cores, max(core_s) / per_stage)


def core_seconds(compute_s: float, x: StageTraffic, core_bytes_per_s: float, optimizer: bool = True) -> float:
    """A stage's CPU seconds in a step when its device is the CPU: ``compute_s``, plus the bytes its
    H2D and D2H copies move (each byte read and written: 2 per byte copied), its gradient
    accumulation and (``optimizer``) its optimizer move, at one core's bandwidth."""
    moved = 2 * x.h2d_bytes + 2 * x.d2h_bytes + x.accum_bytes + (x.optimizer_bytes if optimizer else 0)
    return compute_s + moved / core_bytes_per_s
