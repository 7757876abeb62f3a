"""Exposed optimizer time: the seconds of a step's CPU AdamW that the next step waits for, per update mode.

Owns: a max-plus model of the engine's pipeline schedule (:func:`pipeline_times`) and of the
optimizer thread's FIFO queue in each of :data:`MODES` (``engine/host/overlap.py`` runs that queue),
giving how late the next step's first use of each unit is (:func:`exposed_s`). Pure arithmetic on
seconds; ``step_time.py`` turns a model, a batch shape and rates into the seconds. Does not own: the
modes' rules and the choice between them (``core/update.py``), the rates or FLOPs (step_time.py), the
bytes (traffic.py), or running anything.

Why, with the timeline this models: docs/optimizer.md#how-much-adamw-a-step-waits-for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = [
    "MODES",
    "CLIP_FRACTION",
    "UnitTiming",
    "OptimizerExposure",
    "pipeline_times",
    "exposed_s",
    "exposed_split",
]

MODES = ("serial", "deferred", "in_backward", "speculative", "speculative_clipped")

CLIP_FRACTION = 0.3
"""Fraction of steps assumed to clip when speculative updates are priced (each such step pays the
rollback and redo): the default job clipped 18 of 60 steps, most of them in the warm-up
(bench/RESULTS.md#speculative-updates). An assumption: the engine cannot know it at start-up."""


@dataclass(frozen=True)
class UnitTiming:
    """One owned unit as the optimizer thread and the next step see it (seconds)."""

    update_s: float
    """One AdamW update (with the transfer-copy refresh) on the optimizer thread."""
    final_s: float
    """When its gradient is final in the step (its last offload), from the step's start."""
    forward_s: float
    """Its block's forward of one micro-batch (the next step's first use)."""
    load_s: float = 0.0
    """Its block's H2D load, which starts only once the update is done (``Window`` gate)."""
    backup_s: float = 0.0
    """A speculative update's backup (read and write 12 B/param)."""
    redo_s: float = 0.0
    """A clipped speculative step's rollback and second update."""
    shared: bool = False
    """Another stage reads it: updated after the all-reduce and waited for before the step ends."""
    pass_s: float = -1.0
    """Its block's forward as the pipeline priced it, loads prefetched (``blocks.py``: max(F, H2D));
    the first forward without the updates takes these in turn. -1: ``forward_s`` after its load, the
    loads from the step's start in turn (no pass model)."""


@dataclass(frozen=True)
class OptimizerExposure:
    """Exposed optimizer seconds of one step in each mode (the latest stage decides)."""

    serial_s: float
    deferred_s: float
    in_backward_s: float
    speculative_s: float
    """A speculative step that does not clip."""
    speculative_clipped_s: float
    """A speculative step that clips (rollback and redo)."""

    def of(self, mode: str, clip_fraction: float = CLIP_FRACTION) -> float:
        """Seconds of ``mode``; ``speculative`` is the expectation over ``clip_fraction`` clipped steps."""
        if mode == "speculative":
            return (1 - clip_fraction) * self.speculative_s + clip_fraction * self.speculative_clipped_s
        if mode not in MODES:
            raise ValueError(f"unknown update mode {mode!r}: use one of {MODES}")
        return getattr(self, f"{mode}_s")


def pipeline_times(actions, forward_s, backward_s) -> list[list[tuple[float, float]]]:
    """Start and end of every action of every stage, schedule as the engine runs it (no P2P time).

    Args:
        actions: per stage, its actions (``pipeline.build_schedule`` × rounds: objects with ``kind``
            "F"/"B" and ``mb``; the k-th occurrence of an (kind, mb) pairs with the k-th on the
            neighbour, so repeated rounds are fine).
        forward_s, backward_s: per stage, seconds of one micro-batch's forward / backward.

    Returns:
        per stage, (start, end) of each action, from the step's start (stage 0's first forward at 0).

    Raises:
        ValueError: the schedules wait on each other forever.
    """
    num_stages = len(actions)
    done: dict[tuple[int, str, int, int], float] = {}
    out: list[list[tuple[float, float]]] = [[] for _ in actions]
    seen = [Counter() for _ in actions]
    free = [0.0] * num_stages
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(actions):
            while len(out[s]) < len(acts):
                a = acts[len(out[s])]
                k = seen[s][a.kind, a.mb]
                peer = s - 1 if a.kind == "F" else s + 1
                dep = (peer, a.kind, a.mb, k) if 0 <= peer < num_stages else None
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = start + (forward_s[s] if a.kind == "F" else backward_s[s])
                out[s].append((start, free[s]))
                done[s, a.kind, a.mb, k] = free[s]
                seen[s][a.kind, a.mb] += 1
                progress = True
    if any(len(o) < len(a) for o, a in zip(out, actions, strict=True)):
        raise ValueError("the stages' schedules wait on each other forever")
    return out


def _queue(jobs) -> tuple[dict[int, float], dict[int, float]]:
    """The optimizer thread's FIFO: ``jobs`` = (unit, release, seconds) in submission order; returns
    each unit's start of its first job and end of its last."""
    t, start, end = float("-inf"), {}, {}
    for unit, release, seconds in jobs:
        t = max(t, release)
        start.setdefault(unit, t)
        t += seconds
        end[unit] = t
    return start, end


def _early_jobs(units: list[UnitTiming], mode: str) -> list[tuple[int, float, float]]:
    """In-backward and speculative: the jobs submitted as units become final, in that order (ties,
    one instant, in the backward's reverse block order, as the D2H worker offloads them)."""
    if mode == "deferred":
        return []
    backup = mode.startswith("speculative")
    early = sorted((k for k, u in enumerate(units) if not u.shared), key=lambda k: (units[k].final_s, -k))
    return [(k, units[k].final_s, units[k].update_s + (units[k].backup_s if backup else 0.0)) for k in early]


def _reduce_s(units: list[UnitTiming], step_end_s: float, mode: str) -> float:
    """When this stage reaches the all-reduce: the pipeline's end, or later, in-backward, once the
    last unit's update has begun (its norm² is taken first: ``UnitUpdates.wait_measured``)."""
    jobs = _early_jobs(units, mode)
    starts, _ = _queue(jobs)
    return max([step_end_s, *(starts[k] for k, _, _ in jobs[-1:])])


def _done_times(units: list[UnitTiming], mode: str, reduce_s: float) -> dict[int, float]:
    """Each unit's update end; what waits for the all-reduce is released at ``reduce_s``, in forward
    order: every unit (deferred), the shared ones and a clipped speculative step's redos."""
    jobs = _early_jobs(units, mode)
    for k, u in enumerate(units):
        if u.shared or mode == "deferred":
            jobs.append((k, reduce_s, u.update_s))
        elif mode == "speculative_clipped":
            jobs.append((k, reduce_s, u.redo_s))
    return _queue(jobs)[1]


def exposed_s(stages: list[list[UnitTiming]], step_end_s: float, mode: str, fills=None) -> float:
    """Exposed optimizer seconds of a step in ``mode``: how much later the next step's pipeline runs.

    The all-reduce waits for every stage (in-backward: for its last norm²), the step's end for the
    shared units' updates (the engine's barrier), so every stage starts the next step at the same
    T0; a stage whose first forward of a unit is late delays every later action of the pipeline
    (the first micro-batch's path has no slack), so the latest unit of any stage decides.

    Args:
        stages: per stage, its units in forward order (:class:`UnitTiming`).
        step_end_s: when the pipeline's last action ends, from the step's start.
        mode: one of :data:`MODES`.
        fills: per stage, when its first action of the next step would start, from that step's
            start (the pipeline fill: time the updates of a later stage have before their first
            use); default 0.

    Returns:
        seconds ≥ 0.

    Raises:
        ValueError: an unknown mode.
    """
    return exposed_split(stages, step_end_s, mode, fills)[0]


def exposed_split(stages: list[list[UnitTiming]], step_end_s: float, mode: str, fills=None):
    """(:func:`exposed_s`, of it the seconds the next step's compute waits for updates): the rest
    is the gated loads' copies after their updates, which the engine counts as ``stall``
    (``Window.acquire``: ``optim`` while the gate is pending, ``stall`` while the copy runs).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown update mode {mode!r}: use one of {MODES}")
    if mode == "serial":  # each stage's training thread updates after the all-reduce
        total = max((sum(u.update_s for u in us) for us in stages), default=0.0)
        return total, total
    fills = fills or [0.0] * len(stages)
    reduce_s = max(_reduce_s(us, step_end_s, mode) for us in stages)
    dones = [_done_times(us, mode, reduce_s) for us in stages]
    shared = [d[k] for us, d in zip(stages, dones, strict=True) for k, u in enumerate(us) if u.shared]
    start = max([reduce_s, *shared])
    late = [_first_forward_late(us, d, start, fill) for us, d, fill in zip(stages, dones, fills, strict=True)]
    k = max(range(len(late)), key=lambda j: late[j][0]) if late else 0
    exposed = start - step_end_s + max([0.0, *(x for x, _ in late)])
    waits = start - step_end_s + (min(late[k][1], max(0.0, late[k][0])) if late else 0.0)
    return exposed, min(exposed, waits)


def _first_forward_late(
    units: list[UnitTiming], done: dict[int, float], start: float, fill: float
) -> tuple[float, float]:
    """(how much later the stage's first forward of the next step ends than without the updates, of
    it the compute's waits for a pending update; the rest waits for a gated load's copy)."""
    load = base_load = start  # the H2D worker's loads, in forward order
    compute = base = start + fill  # the stage's compute; the first block waits for the fill
    waits = 0.0
    for k, u in enumerate(units):
        waits += max(0.0, done[k] - compute)
        load = max(load, done[k]) + u.load_s
        base_load += u.load_s
        compute = max(compute, load) + u.forward_s
        base = base + u.pass_s if u.pass_s >= 0 else max(base, base_load) + u.forward_s
    return compute - base, waits
