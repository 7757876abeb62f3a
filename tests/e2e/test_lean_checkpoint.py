"""Lean state (``optim.state=lean``) through checkpoints: bit-exact resume, full → lean, lean → full refused.

Five cheap launches of a 2-layer, hidden-64 Llama (TINY_RUN) on a sonnet corpus: the lean run and its
resume on 2 ranks; full → lean and lean → full (what a checkpoint holds, not how stages split it) on
one. The reference of "exact" is the uninterrupted lean run itself: its losses and its final
checkpoint's files, read with safetensors' own loader.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_RUN, job_env, torchrun_cmd
from safetensors.torch import load_file

from nodetrain.checkpoint import state as st

COMMON = [*TINY_RUN, "train.steps=4", "train.eval_every=0", "logging.wandb=false", "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def work(corpus):
    shm = Path(tempfile.mkdtemp(prefix="nt-lean-", dir="/dev/shm"))
    root = Path(tempfile.mkdtemp(prefix="nt-lean-"))
    yield root, [*corpus, f"store.dir={shm}"]
    left = sorted(p.name for p in shm.iterdir())
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    assert not left, f"host stores left in /dev/shm: {left}"


def _train(work, name: str, overrides: list[str], ok: bool = True, nproc: int = 2) -> tuple[Path, str]:
    root, data = work
    cmd = torchrun_cmd(
        nproc, "-m", "nodetrain.train", f"hydra.run.dir={root / name}", *COMMON, *data, *overrides
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}"
    return root / name, out


def _losses(run: Path) -> dict[int, float]:
    recs = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _files(ckpt: Path, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob(f"{prefix}-*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def lean_run(work) -> Path:
    run, out = _train(work, "lean", ["optim.state=lean", "checkpoint.every=2"])
    assert "bytes/parameter (optim.state=lean)" in out
    return run


def test_lean_resume_is_bit_exact(work, lean_run: Path) -> None:
    step2, want = lean_run / "checkpoints" / "step-2", lean_run / "checkpoints" / "step-4"
    saved = json.loads((step2 / st.TRAINER_STATE).read_text())
    assert saved["optim_state"] == "lean" and saved["weights"]["master"] == "model"  # bf16: one copy
    opt = _files(step2, "optimizer")
    assert {t.dtype for k, t in opt.items() if k.startswith("nodetrain.lean.")} == {
        torch.uint8,
        torch.float32,
    }
    assert {t.dtype for t in _files(step2, "model").values()} == {torch.bfloat16}  # the HF export stays bf16
    resumed, _ = _train(work, "lean-resumed", ["optim.state=lean", f"checkpoint.resume={step2}"])
    got_losses, want_losses = _losses(resumed), _losses(lean_run)
    assert [got_losses[s] for s in (3, 4)] == [want_losses[s] for s in (3, 4)]
    got = resumed / "checkpoints" / "step-4"
    for prefix in ("model", "optimizer"):
        a, b = _files(got, prefix), _files(want, prefix)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (prefix, k)


def test_full_to_lean_quantizes_and_lean_to_full_is_refused(work, lean_run: Path) -> None:
    """One rank each: a full checkpoint resumed with lean state is quantized; lean_run's step-2 (two
    stages) resumed with full state is refused, naming the way out."""
    full, _ = _train(work, "full", ["train.steps=2"], nproc=1)
    _, out = _train(
        work,
        "full-to-lean",
        ["optim.state=lean", f"checkpoint.resume={full / 'checkpoints' / 'step-2'}"],
        nproc=1,
    )
    assert "quantized to 4 / 8 bits" in out
    _, out = _train(
        work, "lean-to-full", [f"checkpoint.resume={lean_run / 'checkpoints' / 'step-2'}"], ok=False, nproc=1
    )
    assert "holds lean optimizer state" in out and "optim.state=lean" in out and "model.init_from=" in out
