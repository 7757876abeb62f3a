"""How long a checkpoint stalls training, for the default model (llama_10m, 2 ranks on CPU).

Not a test: run by hand. Two short runs of the shipped default job save every 2 steps, once with
the background writer (``checkpoint.async_write=true``: training waits only for the snapshot copy)
and once writing from the host store while training waits (``false``). Printed per save: the stall
(``ckpt_stall_s`` of metrics.jsonl), the write time of the slowest rank (``save_timing_s`` in
trainer_state.json), the checkpoint's size, and a training step's time for scale.

    python bench/checkpoint_save.py [--steps 6] [--data-dir data]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._launch import train_cmd  # noqa: E402


def _run(
    run_dir: Path, steps: int, data_dir: str, async_write: bool
) -> list[tuple[int, float, float, float]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = train_cmd(2, run_dir, f"train.steps={steps}", "train.eval_every=0")
    cmd += [f"data.dir={data_dir}", "checkpoint.every=2", "checkpoint.keep_last=0", "logging.wandb=false"]
    cmd += [f"checkpoint.async_write={str(async_write).lower()}"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = []
    for r in recs:
        if "ckpt_stall_s" in r:
            ckpt = run_dir / "checkpoints" / f"step-{r['step']}"
            timing = json.loads((ckpt / "trainer_state.json").read_text())["save_timing_s"]
            size = sum(f.stat().st_size for f in ckpt.iterdir())
            out.append((r["step"], r["ckpt_stall_s"], max(timing["write"]), size))
    steps_s = sorted(r["step_s"] for r in recs if "step_s" in r)
    return out, steps_s[len(steps_s) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--data-dir", default=str(ROOT / "data"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nt-bench-save-") as tmp:
        print("default model llama_10m (7.9M parameters), 2 ranks, bf16 export + fp32 master and AdamW state")
        print(f"{'mode':<28} {'step':>4} {'stall':>8} {'write':>8} {'size':>9} {'median step':>12}")
        for async_write in (True, False):
            saves, step_s = _run(Path(tmp) / f"async_{async_write}", args.steps, args.data_dir, async_write)
            mode = "snapshot + background write" if async_write else "write while training waits"
            for step, stall, write, size in saves:
                print(
                    f"{mode:<28} {step:>4} {stall:>7.3f}s {write:>7.3f}s {size / 2**20:>5.1f} MiB "
                    f"{step_s:>11.3f}s"
                )


if __name__ == "__main__":
    main()
