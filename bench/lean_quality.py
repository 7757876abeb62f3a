"""Does ``optim.state=lean`` train as well as ``full``? The default job in both, side by side.

    python bench/lean_quality.py                     # README's default job, 250 steps, ~2 x 4-12 min
    python bench/lean_quality.py --steps 20          # a quick look
    python bench/lean_quality.py --runs DIR --reuse  # rerun only what DIR lacks

Runs the real entry point (``torchrun --nproc_per_node 2 -m nodetrain.train``, README's default config:
llama_10m on Shakespeare, ``logging.wandb=false``) once with ``optim.state=full`` and once with
``optim.state=lean``, reads each run's ``metrics.jsonl``, prints both final validation losses, their
relative difference (target: lean within 1 % of full) and each store's bytes per parameter (the
start-up log line), and draws both training and validation curves on one PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._launch import train_cmd  # noqa: E402

_BYTES = re.compile(r"([\d.]+) bytes/parameter \(optim\.state=(\w+)\)")


def run(state: str, steps: int, runs: Path, shm: str) -> tuple[list[dict], float]:
    """One 2-rank launch; returns (rank 0's metrics records, store bytes per parameter)."""
    out = runs / state
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    cmd = train_cmd(2, out, f"optim.state={state}", f"train.steps={steps}")
    cmd += ["logging.wandb=false", f"store.dir={shm}", f"data.dir={ROOT / 'data'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    match = _BYTES.search((out / "rank0.log").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, float(match[1]) if match else float("nan")


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--out", default=str(ROOT / "docs" / "lean_quality.png"))
    ap.add_argument("--runs", default="", help="directory for the two runs (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="keep a finished run found in --runs")
    args = ap.parse_args()
    runs = Path(args.runs or tempfile.mkdtemp(prefix="nt-lean-quality-"))
    runs.mkdir(parents=True, exist_ok=True)
    shm = tempfile.mkdtemp(prefix="nt-lean-", dir="/dev/shm")
    results = {}
    try:
        for state in ("full", "lean"):
            done = runs / state / "metrics.jsonl"
            if args.reuse and done.is_file() and f'"step": {args.steps},' in done.read_text():
                log = (runs / state / "rank0.log").read_text()
                records = [json.loads(line) for line in done.read_text().splitlines()]
                results[state] = records, float(_BYTES.search(log)[1])
            else:
                shutil.rmtree(runs / state, ignore_errors=True)
                results[state] = run(state, args.steps, runs, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for state, (records, bpp) in results.items():
        ax.plot(*_series(records, "loss"), alpha=0.45, lw=1, label=f"{state} train ({bpp:.2f} B/param)")
        ax.plot(*_series(records, "val_loss"), "o-", lw=2, label=f"{state} validation")
    ax.set(xlabel="step", ylabel="loss", title="llama_10m on Shakespeare: optim.state full vs lean")
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    final = {s: _series(r, "val_loss")[1][-1] for s, (r, _) in results.items()}
    rel = (final["lean"] - final["full"]) / final["full"]
    for state, (_, bpp) in results.items():
        print(f"{state}: final validation loss {final[state]:.4f}, store {bpp:.2f} bytes/parameter")
    print(f"lean - full: {rel:+.2%} of full (target within 1%): {'PASS' if abs(rel) <= 0.01 else 'FAIL'}")
    print(f"curves: {args.out}; runs: {runs}")


if __name__ == "__main__":
    main()
