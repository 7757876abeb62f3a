"""A full disk is a refusal that names the path and the bytes, and leaves nothing half-written.

In this process: ``checkpoint.dir`` (checked before a save writes anything, and a write that still
runs out of space, with the partial ``step-N.tmp`` removed and the previous checkpoint intact), on
a world of one gloo rank with a real CheckpointWriter, and ``data.dir`` (a preparation whose write
came up short). ``metrics.jsonl`` is in tests/unit/test_metrics.py, and here end to end: a run whose
row cannot be written stops, its checkpoint carries the rows, and the resume writes them back.
ENOSPC is simulated: a small tmpfs is not available, and a file-size rlimit gives EFBIG, not ENOSPC.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, TINY_HF, TINY_RUN, job_env, torchrun_cmd

from nodetrain.checkpoint import state as st
from nodetrain.checkpoint import writer as writer_mod
from nodetrain.checkpoint.writer import CheckpointWriter
from nodetrain.config.disk import DiskFullError
from nodetrain.config.schema import CheckpointConfig, DataConfig, ModelConfig, OptimConfig
from nodetrain.data import datasets
from nodetrain.model import HFModel, build_hf_config
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.run.jobs import REFUSALS
from nodetrain.store import HostStore, StoreLayout


@pytest.fixture
def writer(tmp_path: Path, shm_dir: Path, one_rank_world):
    """A CheckpointWriter of a tiny model's whole store, rank 0 of a world of one (gloo)."""
    model = HFModel(build_hf_config(ModelConfig(name="t", hf=TINY_HF)))
    store = HostStore.create(
        StoreLayout(tuple(u.numel for u in model.units), torch.bfloat16), shm_dir, "disk"
    )
    store.unlink()
    for u in model.units:
        model.init_unit(u, store.master(u.index), 0)
    cfg = CheckpointConfig(async_write=True)
    group = dist.new_group(backend="gloo")
    w = CheckpointWriter(
        tmp_path / "ckpts",
        cfg,
        model,
        store,
        model.units,
        StoreAdamW(store, model.units, OptimConfig()),
        group,
    )
    (tmp_path / "ckpts").mkdir()
    yield w
    w.close(ok=False)


def _state(step: int) -> dict:
    return {"step": step, "weights": {"master": "master"}}


def test_a_write_that_runs_out_of_space_is_a_refusal_and_keeps_the_previous_checkpoint(writer, monkeypatch):
    writer.save(1, _state(1))
    writer.finish()
    before = st.verify(writer.dir / "step-1")["files"]
    calls = []

    def full_after_two(tensors, path, metadata=None):  # as safetensors reports ENOSPC (no errno)
        calls.append(path)
        if len(calls) > 2:
            Path(path).write_bytes(b"\0" * 100)  # what was written before the disk filled
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_file(tensors, path, metadata=metadata)

    save_file = writer_mod.save_file
    monkeypatch.setattr(writer_mod, "save_file", full_after_two)
    writer.save(2, _state(2))
    with pytest.raises(DiskFullError) as info:
        writer.finish()
    message = str(info.value)
    need = writer._nbytes()
    assert message.startswith(
        f"checkpoint.dir={writer.dir}: the filesystem is full: checkpoint step-2 needs {need / 1e6:,.1f} MB"
    ), message
    assert "the newest checkpoint, step-1, is intact" in message and "checkpoint.resume=auto" in message
    assert isinstance(info.value, REFUSALS)
    assert not (writer.dir / "step-2.tmp").exists() and not (writer.dir / "step-2").exists()
    assert st.verify(writer.dir / "step-1")["files"] == before


def test_a_save_that_cannot_fit_is_refused_before_it_writes(writer, monkeypatch):
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(writer_mod.shutil, "disk_usage", lambda p: usage(*real(p)[:2], 1000))
    with pytest.raises(DiskFullError, match=r"checkpoint step-1 needs .* MB and 0\.0 MB is free") as info:
        writer.save(1, _state(1))
    assert "no checkpoint of this run was written" in str(info.value)
    assert list(writer.dir.iterdir()) == [], "nothing may be written before the refusal"


def test_a_full_data_dir_is_a_refusal_naming_the_space(tmp_path: Path, monkeypatch):
    """numpy's short write (``350032 requested and 14615 written``, no errno) becomes a refusal naming
    data.dir and the bytes needed; the half-built dataset is removed."""
    (tmp_path / "corpus.txt").write_text("Shall I compare thee to a summer's day?\n" * 400)
    cfg = DataConfig(source=str(tmp_path / "corpus.txt"), dir=str(tmp_path / "prepared"), vocab_size=300)

    def short_write(*args, **kwargs):
        raise OSError("350032 requested and 14615 written")

    monkeypatch.setattr(datasets, "_split", short_write)
    with pytest.raises(DiskFullError) as info:
        datasets.prepare(cfg)
    message = str(info.value)
    text_mb = (tmp_path / "corpus.txt").stat().st_size / 1e6
    assert message.startswith(
        f"data.dir={cfg.dir}: the filesystem is full (350032 requested and 14615 written)"
    )
    assert f"({text_mb:,.1f} MB of text) needs up to {4 * 1.05 * text_mb:,.1f} MB" in message
    assert "MB is free" in message and "data.dir to a larger filesystem" in message
    assert [p.name for p in (tmp_path / "prepared").iterdir()] == [".file_hashes.json"]


def test_a_full_disk_under_metrics_jsonl_loses_no_trained_step_s_row(tmp_path: Path, corpus) -> None:
    """Issue 32, item 6, as a user meets it (2 ranks): from step 8 on the run directory's disk is full
    (``NODETRAIN_FAULTS=metrics_full_step=8``), so the run stops after step 9 with a refusal and the
    checkpoint of step 9; once space is freed, ``checkpoint.resume=auto`` finishes, and metrics.jsonl holds
    every step 1..12 once: the checkpoint carried the rows of steps 8 and 9."""
    run = tmp_path / "run"
    base = [*TINY_RUN, *corpus, "logging.wandb=false", "logging.plots=false", f"store.dir={tmp_path}"]
    base += ["train.eval_every=0", "train.steps=12", "checkpoint.every=0", f"hydra.run.dir={run}"]
    kw = {"cwd": ROOT, "env": job_env(), "capture_output": True, "text": True, "timeout": 240}
    full_env = job_env(NODETRAIN_FAULTS="metrics_full_step=8")
    full = subprocess.run(torchrun_cmd(2, "-m", "nodetrain.train", *base), **{**kw, "env": full_env})
    assert full.returncode != 0
    assert "the filesystem is full: the row of step 8 in metrics.jsonl" in full.stdout + full.stderr
    rows = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 8))
    carried = json.loads((run / "checkpoints" / "step-9" / "trainer_state.json").read_text())["metrics_rows"]
    assert [r["step"] for r in carried] == [8, 9]
    resumed = subprocess.run(torchrun_cmd(2, "-m", "nodetrain.train", *base, "checkpoint.resume=auto"), **kw)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert (
        rows[7]["loss"] == carried[0]["loss"]
        and "step(s) 8, 9 the checkpoint of step 9 carried" in (run / "rank0.log").read_text()
    )
