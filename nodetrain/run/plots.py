"""PNG plots of a run for people who work offline: loss, tokens/s and where each step's time went.

Owns: reading a run's ``metrics.jsonl`` and drawing it with matplotlib (Agg backend, no display).
Does not own: the numbers (the engine measures, metrics.py writes them). Rank 0 calls
:func:`write_plots` at the end of a run (and :func:`write_sweep_plot` after each job of a sweep);
redraw at any time, also while a run is going::

    python -m nodetrain.plots runs/2025-01-31_12-00-00_p4242        # one run
    python -m nodetrain.plots runs/multirun_2025-01-31_12-00-00_p42   # every job of a sweep + comparison

Files, under ``<run dir>/plots/``: ``loss.png`` (train loss per step and validation loss),
``tokens_per_s.png``, ``time.png`` (left: one stacked bar per logged step of the phases that sum to
the step's wall time, see :func:`time_bars`; right, apart because it is not wall-clock time: the CPU
seconds of all ranks' threads and the busy seconds of the copy and optimizer workers, which overlap
the step) and ``summary.png`` (loss, throughput and the stacked bars side by side). A sweep also
gets ``<sweep dir>/sweep_loss.png``: every job's train loss on one axis (see :func:`sweep_curves`).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, safe on a cluster node and in threads
import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.axes import Axes

from nodetrain.run.metrics import METRICS_FILE

__all__ = [
    "PLOTS_DIR",
    "SWEEP_PLOT",
    "STEP_PHASES",
    "read_records",
    "time_bars",
    "sweep_curves",
    "write_plots",
    "write_sweep_plot",
    "main",
]

log = logging.getLogger(__name__)

PLOTS_DIR = "plots"
"""Subdirectory of the run directory the PNGs go to."""
SWEEP_PLOT = "sweep_loss.png"
"""File in a sweep directory comparing its jobs' loss curves."""
STEP_PHASES = ("compute", "stall", "d2h_wait", "optim", "bubble")
"""breakdown.PHASES, which sum with ``other`` to a step's wall time (not imported: breakdown needs torch)."""
_CPU_KEYS = ("cpu_s", "h2d_busy_s", "d2h_busy_s", "optim_busy_s")
"""Seconds that are not a share of the step's wall time: CPU time of all threads, workers' busy time."""
_DPI = 100


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` in order; a torn last line (a run still writing) is skipped.

    Raises:
        FileNotFoundError: no such file.
    """
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if _number(r.get(key)) and _number(r.get("step"))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot_loss(ax: Axes, records: Sequence[dict[str, Any]]) -> bool:
    drawn = False
    for key, label, style in (("loss", "train", "-"), ("val_loss", "validation", "o-")):
        x, y = _series(records, key)
        if x:
            ax.plot(x, y, style, label=label, markersize=3)
            drawn = True
    ax.set(title="loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    return drawn


def _plot_tokens(ax: Axes, records: Sequence[dict[str, Any]]) -> bool:
    x, y = _series(records, "tokens_per_s")
    ax.plot(x, y, label="tokens/s")
    ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    return bool(x)


def time_bars(records: Sequence[dict[str, Any]]) -> tuple[list[int], dict[str, list[float]]]:
    """The stacked bars of the time plot: per logged step with a ``step_s``, the seconds of each of
    :data:`STEP_PHASES` (0 where a record lacks one) and ``other`` = ``step_s`` minus their sum, so
    each bar's height is the step's wall time (``step_s``: the slowest rank; the phases: the mean
    over ranks, so ``other`` also holds the ranks' difference from the slowest).

    Returns:
        (steps, {phase or "other": seconds per step}), in the order the bars stack.
    """
    rows = [r for r in records if _number(r.get("step_s")) and _number(r.get("step"))]
    bars = {p: [float(r.get(f"{p}_s") or 0.0) for r in rows] for p in STEP_PHASES}
    bars["other"] = [r["step_s"] - sum(bars[p][i] for p in STEP_PHASES) for i, r in enumerate(rows)]
    return [r["step"] for r in rows], bars


def _plot_time(ax: Axes, records: Sequence[dict[str, Any]]) -> bool:
    steps, bars = time_bars(records)
    bottom = [0.0] * len(steps)
    colors = plt.get_cmap("tab10").colors
    for i, (name, seconds) in enumerate(bars.items()):
        ax.bar(steps, seconds, bottom=bottom, width=0.8, label=name, color=colors[i], linewidth=0)
        bottom = [b + s for b, s in zip(bottom, seconds, strict=True)]
    ax.set(title="wall time per step (stacked phases)", xlabel="step", ylabel="seconds")
    return bool(steps)


def _plot_cpu(ax: Axes, records: Sequence[dict[str, Any]]) -> bool:
    drawn = False
    for key in _CPU_KEYS:
        x, y = _series(records, key)
        if x:
            ax.plot(x, y, label=key.removesuffix("_s"), marker="." if len(x) < 50 else None)
            drawn = True
    ax.set(title="CPU and worker-busy time per step (overlaps the step)", xlabel="step", ylabel="seconds")
    return drawn


_PANELS: dict[str, Callable[[Axes, Sequence[dict[str, Any]]], bool]] = {
    "loss": _plot_loss,
    "tokens_per_s": _plot_tokens,
    "time": _plot_time,
}


def _finish(ax: Axes, drawn: bool, outside: bool = False) -> None:
    ax.grid(alpha=0.3)
    if drawn and outside:  # beside the axes: never over the data; stacked bars list top-down
        handles, labels = ax.get_legend_handles_labels()
        if ax.patches:
            handles, labels = handles[::-1], labels[::-1]
        kwargs = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0}
        ax.legend(handles, labels, fontsize="x-small", **kwargs)
    elif drawn:
        ax.legend(fontsize="x-small")
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)


def _save(fig, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize="small")
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def write_plots(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw the run's metrics into PNG files.

    Args:
        run_dir: a run (or sweep job) directory holding ``metrics.jsonl``.
        out_dir: where the PNGs go; default ``<run_dir>/plots``.

    Returns:
        The written files: ``loss.png``, ``tokens_per_s.png``, ``time.png``, ``summary.png``.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    records = read_records(run_dir / METRICS_FILE)
    title = f"{run_dir.parent.name}/{run_dir.name}" if run_dir.name.isdigit() else run_dir.name
    out_dir = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, panel in _PANELS.items():
        if name == "time":
            fig, (ax, cpu_ax) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
            _finish(cpu_ax, _plot_cpu(cpu_ax, records), outside=True)
        else:
            fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
        _finish(ax, panel(ax, records), outside=name == "time")
        written.append(_save(fig, out_dir / f"{name}.png", title))
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(15, 4), layout="constrained")
    for ax, (name, panel) in zip(axes, _PANELS.items(), strict=True):
        _finish(ax, panel(ax, records), outside=name == "time")
    written.append(_save(fig, out_dir / "summary.png", title))
    return written


def _overrides(job_dir: Path) -> list[str]:
    """The job's command-line overrides (``.hydra/overrides.yaml``, written by rank 0), or []."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf  # only for a sweep's labels

    return [str(o) for o in OmegaConf.load(path)]


def sweep_curves(sweep_dir: Path) -> list[tuple[str, list[float], list[float]]]:
    """One train-loss curve per job of a sweep, as drawn in :data:`SWEEP_PLOT`.

    Returns:
        (label, steps, losses) per job directory holding ``metrics.jsonl``, in job order; the label is
        the job's number and the overrides that differ between the jobs (e.g. ``0: optim.lr=0.001``).
    """
    jobs = sorted(_run_dirs(Path(sweep_dir)), key=lambda p: (len(p.name), p.name))  # job 2 before 10
    overrides = [_overrides(job) for job in jobs]
    shared = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    curves = []
    for job, job_overrides in zip(jobs, overrides, strict=True):
        label = ", ".join(o for o in job_overrides if o not in shared)
        steps, losses = _series(read_records(job / METRICS_FILE), "loss")
        curves.append((f"{job.name}: {label}" if label else job.name, steps, losses))
    return curves


def write_sweep_plot(sweep_dir: Path) -> Path:
    """Draw every job's train loss of a sweep on one axis into ``<sweep_dir>/sweep_loss.png``.

    Raises:
        FileNotFoundError: no job directory with a ``metrics.jsonl`` under ``sweep_dir``.
    """
    sweep_dir = Path(sweep_dir)
    curves = sweep_curves(sweep_dir)
    if not curves:
        raise FileNotFoundError(f"{sweep_dir}: no job directory with a {METRICS_FILE}")
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for label, steps, losses in curves:
        ax.plot(steps, losses, label=label)
    ax.set(title="train loss of each job", xlabel="step", ylabel="cross-entropy (nats/token)")
    _finish(ax, any(steps for _, steps, _ in curves), outside=True)
    return _save(fig, sweep_dir / SWEEP_PLOT, sweep_dir.name)


def _run_dirs(path: Path) -> list[Path]:
    """``path`` if it is a run directory, else its job directories (a sweep), sorted."""
    if (path / METRICS_FILE).is_file():
        return [path]
    return sorted(p.parent for p in path.glob(f"*/{METRICS_FILE}"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nodetrain.plots RUN_DIR [RUN_DIR ...]``: (re)draw the plots of runs or sweeps (a
    sweep also gets its jobs' loss comparison)."""
    parser = argparse.ArgumentParser(prog="python -m nodetrain.plots", description=main.__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories, or sweep directories")
    args = parser.parse_args(argv)
    status = 0
    for path in args.run_dirs:
        dirs = _run_dirs(path)
        if not dirs:
            print(f"{path}: no {METRICS_FILE} here or in its subdirectories; give a run directory")
            status = 1
        for run_dir in dirs:
            for png in write_plots(run_dir):
                print(png)
        if dirs and dirs != [path]:
            print(write_sweep_plot(path))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
