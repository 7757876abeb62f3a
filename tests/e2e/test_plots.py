"""Plots of a run (nodetrain/run/plots.py): PNG files that Pillow decodes, of a real size, that change with
the data, from ``metrics.jsonl`` as the trainer writes it; and the ``python -m nodetrain.plots`` command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from conftest import ROOT
from PIL import Image

from nodetrain.run import plots
from nodetrain.run.breakdown import PHASES
from nodetrain.run.plots import SWEEP_PLOT, main, sweep_curves, time_bars, write_plots

NAMES = ["loss.png", "tokens_per_s.png", "time.png", "summary.png"]


def _write_metrics(run_dir: Path, steps: int = 30, slope: float = -0.05, extra_key: str = "") -> None:
    run_dir.mkdir(parents=True)
    records = [{"step": 0, "val_loss": 8.0}]
    for s in range(1, steps + 1):
        r = {"step": s, "loss": 8.0 + slope * s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 512}
        r |= {
            "tokens_per_s": 1000.0 + 10 * s,
            "step_s": 0.5,
            "stall_s": 0.1,
            "p2p_wait_s": 0.05,
            "optim_s": 0.2,
        }
        if extra_key:
            r[extra_key] = 0.01 * s
        if s % 10 == 0:
            r["val_loss"] = 8.1 + slope * s
        records.append(r)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 31, "lo')  # a run still writing: torn last line


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def test_plots_are_valid_pngs_of_real_size(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_metrics(run)
    written = write_plots(run)
    assert [p.name for p in written] == NAMES and all(p.parent == run / "plots" for p in written)
    for path in written:
        with Image.open(path) as im:
            im.verify()  # checks every chunk's CRC
        pixels = _pixels(path)
        width = {"summary.png": 1500, "time.png": 1200}.get(path.name, 600)
        assert pixels.shape == (400, width, 3)
        assert path.stat().st_size > 10_000, f"{path.name}: {path.stat().st_size} bytes"
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20, f"{path.name} looks blank"


def test_plots_follow_the_data(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "down", slope=-0.05)
    _write_metrics(tmp_path / "up", slope=+0.05, extra_key="compute_s")
    down, up = write_plots(tmp_path / "down"), write_plots(tmp_path / "up")
    assert not np.array_equal(_pixels(down[0]), _pixels(up[0])), "the loss plot ignores the loss"
    assert not np.array_equal(_pixels(down[2]), _pixels(up[2])), "the time plot ignores the compute phase"


def _breakdown_records() -> list[dict]:
    """Records as train.py logs them: step_s the slowest rank, phases the mean over ranks, cpu_s apart."""
    rng = np.random.default_rng(0)
    records = [{"step": 0, "val_loss": 8.0}]  # evaluation before the first step: no bar
    for s in range(1, 9):
        phases = {f"{p}_s": float(rng.uniform(0.01, 0.2)) for p in PHASES}
        step_s = sum(phases.values()) + float(rng.uniform(0.0, 0.05))
        records.append(
            {"step": s, "loss": 5.0, "step_s": step_s, **phases, "cpu_s": 3 * step_s, "p2p_wait_s": 0.1}
        )
    return records


def test_time_plot_bars_stack_the_phases_to_the_step_time(tmp_path: Path) -> None:
    records = _breakdown_records()
    steps, bars = time_bars(records)
    assert steps == list(range(1, 9)) and list(bars) == [*PHASES, "other"]
    fig, ax = plt.subplots()
    plots._plot_time(ax, records)
    heights: dict[float, float] = {}
    for patch in ax.patches:  # what was drawn: each step's stacked rectangles
        x = round(patch.get_x() + patch.get_width() / 2, 6)
        assert patch.get_y() == pytest.approx(heights.get(x, 0.0))  # stacked, no gap or overlap
        heights[x] = heights.get(x, 0.0) + patch.get_height()
    assert len(ax.patches) == 8 * 6
    want = {float(r["step"]): r["step_s"] for r in records[1:]}
    assert heights == pytest.approx(want, rel=1e-12)
    assert max(heights.values()) < min(r["cpu_s"] for r in records[1:])  # CPU seconds are not drawn here
    plt.close(fig)


def test_time_plot_legends_sit_beside_the_data(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _breakdown_records()))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    plots._finish(axes[0], plots._plot_time(axes[0], _breakdown_records()), outside=True)
    plots._finish(axes[1], plots._plot_cpu(axes[1], _breakdown_records()), outside=True)
    fig.canvas.draw()
    for ax in axes:
        legend, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= frame.x1, "the legend covers the plot"
    assert [t.get_text() for t in axes[1].get_legend().get_texts()] == ["cpu"]
    plt.close(fig)
    assert _pixels(write_plots(run)[2]).shape == (400, 1200, 3)


def test_no_steps_yet_still_draws(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 8.0}\n')
    for path in write_plots(tmp_path, out_dir=tmp_path / "out"):
        assert path.parent == tmp_path / "out" and _pixels(path).size > 0


def test_command_draws_every_job_of_a_sweep(tmp_path: Path) -> None:
    for job, lr in (("0", "0.001"), ("1", "0.0003")):
        _write_metrics(tmp_path / "sweep" / job, slope=-float(lr))
        (tmp_path / "sweep" / job / ".hydra").mkdir()
        (tmp_path / "sweep" / job / ".hydra" / "overrides.yaml").write_text(
            f"- train.steps=30\n- optim.lr={lr}\n"
        )
    assert main([str(tmp_path / "sweep")]) == 0
    assert sorted(p.name for p in (tmp_path / "sweep" / "1" / "plots").iterdir()) == sorted(NAMES)
    assert _pixels(tmp_path / "sweep" / SWEEP_PLOT).shape == (450, 800, 3)
    curves = sweep_curves(tmp_path / "sweep")  # one line per job, labelled by what differs
    assert [label for label, _, _ in curves] == ["0: optim.lr=0.001", "1: optim.lr=0.0003"]
    assert curves[1][1] == list(range(1, 31)) and curves[1][2][0] == pytest.approx(8.0 - 0.0003)
    assert main([str(tmp_path / "nothing")]) == 1
    proc = subprocess.run(  # as a user types it
        [sys.executable, "-m", "nodetrain.plots", str(tmp_path / "sweep" / "0")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.split() == [str(tmp_path / "sweep" / "0" / "plots" / n) for n in NAMES]
