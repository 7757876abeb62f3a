"""Plots of a run (nodetrain/plots.py): PNG files that Pillow decodes, of a real size, that change with
the data, from ``metrics.jsonl`` as the trainer writes it; and the ``python -m nodetrain.plots`` command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import ROOT
from PIL import Image

from nodetrain.plots import main, timing_keys, write_plots

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
        wide = path.name == "summary.png"
        assert pixels.shape == ((400, 1500, 3) if wide else (400, 600, 3))
        assert path.stat().st_size > 10_000, f"{path.name}: {path.stat().st_size} bytes"
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20, f"{path.name} looks blank"


def test_plots_follow_the_data_and_every_timing_key(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "down", slope=-0.05)
    _write_metrics(tmp_path / "up", slope=+0.05, extra_key="h2d_wait_s")
    down, up = write_plots(tmp_path / "down"), write_plots(tmp_path / "up")
    assert not np.array_equal(_pixels(down[0]), _pixels(up[0])), "the loss plot ignores the loss"
    assert not np.array_equal(_pixels(down[2]), _pixels(up[2])), "the time plot ignores a new timing key"
    records = [json.loads(line) for line in (tmp_path / "up" / "metrics.jsonl").read_text().splitlines()[:-1]]
    records[0]["stage1/compute_s"] = records[0]["replica0/step_s"] = 0.5  # per-stage copies: not drawn
    assert timing_keys(records) == ["step_s", "stall_s", "p2p_wait_s", "optim_s", "h2d_wait_s"]


def test_no_steps_yet_still_draws(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 8.0}\n')
    for path in write_plots(tmp_path, out_dir=tmp_path / "out"):
        assert path.parent == tmp_path / "out" and _pixels(path).size > 0


def test_command_draws_every_job_of_a_sweep(tmp_path: Path) -> None:
    for job in ("0", "1"):
        _write_metrics(tmp_path / "sweep" / job)
    assert main([str(tmp_path / "sweep")]) == 0
    assert sorted(p.name for p in (tmp_path / "sweep" / "1" / "plots").iterdir()) == sorted(NAMES)
    assert main([str(tmp_path / "nothing")]) == 1
    proc = subprocess.run(  # as a user types it
        [sys.executable, "-m", "nodetrain.plots", str(tmp_path / "sweep" / "0")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.split() == [str(tmp_path / "sweep" / "0" / "plots" / n) for n in NAMES]
