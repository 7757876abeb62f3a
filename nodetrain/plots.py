"""PNG plots of a run for people who work offline: loss, tokens/s and where each step's time went.

Owns: reading a run's ``metrics.jsonl`` and drawing it with matplotlib (Agg backend, no display).
Does not own: the numbers (the engine measures, metrics.py writes them). Rank 0 calls
:func:`write_plots` at the end of a run; redraw at any time, also while a run is going::

    python -m nodetrain.plots runs/2025-01-31_12-00-00_p4242        # one run
    python -m nodetrain.plots runs/multirun_2025-01-31_12-00-00_p42   # every job of a sweep

Files, under ``<run dir>/plots/``: ``loss.png`` (train loss per step and validation loss),
``tokens_per_s.png``, ``time.png`` (every per-step timing in the records: the keys ending in
``_s`` except rates and per-stage copies, e.g. ``step_s``, ``stall_s``, ``optim_s``) and
``summary.png`` (the three side by side).
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

from nodetrain.metrics import METRICS_FILE

__all__ = ["PLOTS_DIR", "read_records", "timing_keys", "write_plots", "main"]

log = logging.getLogger(__name__)

PLOTS_DIR = "plots"
"""Subdirectory of the run directory the PNGs go to."""
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


def timing_keys(records: Sequence[dict[str, Any]]) -> list[str]:
    """Per-step durations present in the records: numeric keys ending in ``_s`` (seconds), not rates
    (``*_per_s``) and not one stage's copy (``stage<s>/…``, ``replica<r>/…``), in first-seen order."""
    keys: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k.endswith("_s") and not k.endswith("_per_s") and "/" not in k and _number(v):
                keys.setdefault(k)
    return list(keys)


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


def _plot_time(ax: Axes, records: Sequence[dict[str, Any]]) -> bool:
    drawn = False
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # a dozen step-level timings, distinct colours
    for key in timing_keys(records):
        x, y = _series(records, key)
        ax.plot(x, y, label=key.removesuffix("_s"))
        drawn = drawn or bool(x)
    ax.set(title="time per step", xlabel="step", ylabel="seconds")
    return drawn


_PANELS: dict[str, Callable[[Axes, Sequence[dict[str, Any]]], bool]] = {
    "loss": _plot_loss,
    "tokens_per_s": _plot_tokens,
    "time": _plot_time,
}


def _finish(ax: Axes, drawn: bool) -> None:
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize="x-small", ncol=2)
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)


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
    out_dir = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, panel in _PANELS.items():
        fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
        _finish(ax, panel(ax, records))
        fig.suptitle(run_dir.name, fontsize="small")
        written.append(out_dir / f"{name}.png")
        fig.savefig(written[-1], dpi=_DPI)
        plt.close(fig)
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(15, 4), layout="constrained")
    for ax, panel in zip(axes, _PANELS.values(), strict=True):
        _finish(ax, panel(ax, records))
    fig.suptitle(run_dir.name, fontsize="small")
    written.append(out_dir / "summary.png")
    fig.savefig(written[-1], dpi=_DPI)
    plt.close(fig)
    return written


def _run_dirs(path: Path) -> list[Path]:
    """``path`` if it is a run directory, else its job directories (a sweep), sorted."""
    if (path / METRICS_FILE).is_file():
        return [path]
    return sorted(p.parent for p in path.glob(f"*/{METRICS_FILE}"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nodetrain.plots RUN_DIR [RUN_DIR ...]``: (re)draw the plots of runs or sweeps."""
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
    return status


if __name__ == "__main__":
    raise SystemExit(main())
