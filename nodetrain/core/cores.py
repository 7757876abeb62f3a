"""A rank's host cores split between its two host workers: gradient accumulation and the optimizer.

Owns: :class:`CoreSplit` and :func:`split_cores`, the one rule the engine binds its worker teams by
and the planner prices them by. Pure. Does not own reading the machine's cores or binding threads
(engine/host/binding.py) or what the workers compute.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CoreSplit", "split_cores"]


@dataclass(frozen=True)
class CoreSplit:
    """OpenMP team sizes of a rank's two host workers."""

    accum_threads: int
    """The D2H worker: adds offloaded gradients into the host store's fp32 accumulators."""
    optim_threads: int
    """The optimizer thread: the CPU AdamW update."""
    reason: str
    """One line for the start-up log: where the numbers come from."""


def split_cores(cores: int, accum_threads: int = 0, optim_threads: int = 0) -> CoreSplit:
    """Split a rank's ``cores`` between gradient accumulation and the optimizer.

    Both paths stream host memory (an fp32 add: 4 + e bytes read and 4 written per element; AdamW:
    ~44), so each gets its own team. Auto (0) gives the optimizer half the share rounded up and the
    accumulation the rest; one set explicitly leaves the rest to the other; each gets at least 1
    (with 1 core the two teams share it).

    Args:
        cores: this rank's share of the node's cores (``fair_share_threads``), ≥ 1.
        accum_threads: ``stream.accum_threads`` (0 = auto).
        optim_threads: ``optim.threads`` (0 = auto).
    """
    assert cores >= 1 and accum_threads >= 0 and optim_threads >= 0, (cores, accum_threads, optim_threads)
    optim = optim_threads or (max(1, cores - accum_threads) if accum_threads else (cores + 1) // 2)
    accum = accum_threads or max(1, cores - optim)
    keys = (("stream.accum_threads", accum, accum_threads), ("optim.threads", optim, optim_threads))
    how = [f"{key}={value}" + ("" if given else " (auto)") for key, value, given in keys]
    over = " (oversubscribed: the teams share cores)" if accum + optim > cores else ""
    reason = f"host threads of this rank's {cores} core(s): {', '.join(how)}{over}"
    return CoreSplit(accum, optim, reason)
