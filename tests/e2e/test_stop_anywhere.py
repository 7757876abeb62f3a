"""Issue 25, in every phase: a signal is honoured within seconds during set-up (data preparation),
a long evaluation and the wait for a checkpoint write; a second signal says what is not saved; and
imported weights holding NaN/inf are refused by name before anything is written. Pure cases first,
then the real entry point under torchrun (gloo, CPU), each a few seconds of training.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import transformers
from test_faults import NAN_HF, TINY, _finish, _kill_job, _launch

from nodetrain.checkpoint import state as st
from nodetrain.run import faults as faults_mod
from nodetrain.run.faults import StopRequest


def test_a_second_signal_says_that_no_checkpoint_of_the_step_is_written(caplog) -> None:
    with StopRequest(unsaved=lambda: "the newest checkpoint is /ckpts/step-4") as stop, stop.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        stop._first_s -= 10
        with caplog.at_level("WARNING"), pytest.raises(faults_mod.Stopped) as info:
            os.kill(os.getpid(), signal.SIGINT)
    assert info.value.code == 128 + signal.SIGINT
    assert "SIGINT again: ending this rank now" in caplog.text
    assert (
        "no checkpoint of the step in progress is written (the newest checkpoint is /ckpts/step-4)"
        in caplog.text
    )


def test_a_signal_before_the_loop_ends_the_launch_at_once() -> None:
    """Set-up (data preparation, building the store): no step to finish, so the first signal ends it."""
    with StopRequest() as stop, pytest.raises(faults_mod.Stopped) as info:
        os.kill(os.getpid(), signal.SIGTERM)
    assert info.value.code == 128 + signal.SIGTERM and stop.signum == signal.SIGTERM


def _nan_model(model_dir: Path) -> None:
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**NAN_HF))
    with torch.no_grad():
        model.lm_head.weight[7, 3] = float("nan")  # the last stage's (rank 1's) unit
        model.model.layers[0].self_attn.q_proj.weight[0, :2] = float("inf")  # rank 0's
    model.save_pretrained(model_dir)


def test_non_finite_imported_weights_are_refused_naming_every_tensor(
    tmp_path: Path, corpus, shm_dir: Path
) -> None:
    """model.init_from holding NaN/inf: refused before training, by rank 0 once, naming the tensors
    of both stages; nothing written, no store left (a short run used to exit 0 with a NaN checkpoint)."""
    _nan_model(tmp_path / "hf")
    hf = [f"++model.hf.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in NAN_HF.items()]
    overrides = [*TINY, *corpus, *hf, f"model.init_from={tmp_path / 'hf'}", "data.tokenizer=bpe"]
    overrides += [f"store.dir={shm_dir}", "train.steps=2"]
    rc, out, _ = _finish(_launch(2, overrides, tmp_path))
    assert rc != 0
    assert out.count("2 tensor(s) hold NaN or inf") == 1, out[-4000:]
    assert "lm_head.weight: 1 of 19200 values are NaN/inf (model.safetensors)" in out
    assert "model.layers.0.self_attn.q_proj.weight: 2 of 4096 values are NaN/inf" in out
    assert "refused before training" in out and "/nodetrain/" not in out  # no traceback of ours
    (run,) = (tmp_path / "runs").iterdir()
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step-*"))
    assert not (run / "metrics.jsonl").exists()


def _wait_for(root: Path, pattern: str, text: str, job: subprocess.Popen, timeout_s: float = 180) -> Path:
    """The first file under ``root`` matching ``pattern`` that holds ``text``; fails if the job ends first."""
    deadline = time.monotonic() + timeout_s
    while True:
        for path in root.glob(pattern):
            if path.is_file() and text in path.read_text(errors="replace"):
                return path
        assert job.poll() is None, job.stdout.read()[-4000:]
        assert time.monotonic() < deadline, f"never saw {text!r} in {root}/{pattern}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stopped_at_step_2(tmp_path_factory, corpus) -> Path:
    """A run directory (``train.steps=6``) that stopped after its step-2 checkpoint
    (checkpoint.stop_after_steps=2), copied by the test that resumes it."""
    tmp = tmp_path_factory.mktemp("stopped_at_step_2")
    store = Path(tempfile.mkdtemp(prefix="nt-test-", dir="/dev/shm"))
    run = tmp / "run"
    overrides = [*TINY, *corpus, f"store.dir={store}", "train.steps=6", f"hydra.run.dir={run}"]
    try:
        rc, out, _ = _finish(_launch(2, [*overrides, "checkpoint.stop_after_steps=2"], tmp))
        left = sorted(p.name for p in store.iterdir())
    finally:
        shutil.rmtree(store, ignore_errors=True)
    assert rc == 0, out[-4000:]
    assert not left, f"files left in the store directory: {left}"
    return run


def test_a_stop_during_a_long_evaluation_is_honoured_within_seconds(
    tmp_path: Path, corpus, shm_dir: Path, stopped_at_step_2: Path
) -> None:
    """A run resumed at step 2 evaluates 100,000 batches at step 3, showing its progress (rank 0,
    every 5 s); a SIGTERM to torchrun ends it between two batches on every rank: step 3 is saved
    (checkpoint.on_signal=save) and the ranks are gone well before torchrun's 30 s shutdown kill (they
    used to evaluate on, unsupervised). kill -9 of torchrun reaches the ranks as the same SIGTERM (the
    parent-death signal): test_faults.py's test_kill9_of_the_launcher_stops_every_rank_within_seconds."""
    run = tmp_path / "run"
    shutil.copytree(stopped_at_step_2, run, symlinks=True)
    overrides = [*TINY, *corpus, f"store.dir={shm_dir}", "train.steps=6", f"hydra.run.dir={run}"]
    overrides += ["checkpoint.resume=auto", "train.eval_every=3", "train.eval_batches=100000"]
    job = _launch(2, overrides, tmp_path)
    ranks: list[psutil.Process] = []
    try:
        log0 = _wait_for(run, "rank0.log", "evaluation at step 3: ", job)
        ranks = psutil.Process(job.pid).children()
        t0 = time.monotonic()
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=120)
        _, alive = psutil.wait_procs(ranks, timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        if job.poll() is None:
            _kill_job(job)
        for p in ranks:
            if p.is_running():
                p.kill()
    assert not alive and stopped_s < 20, f"ranks still running {stopped_s:.0f}s after the stop request"
    text = log0.read_text()
    assert re.search(r"the evaluation at step 3 ends after \d+ of 100000 batches", text), text[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and records[-1].get("stopped") is True and "val_loss" not in records[-1]
    assert [p.name for _, p in st.complete_checkpoints(run / "checkpoints")] == ["step-2", "step-3"]
    st.verify(run / "checkpoints" / "step-3")


def test_a_stop_while_the_last_checkpoint_is_written_finishes_it(
    tmp_path: Path, corpus, shm_dir: Path
) -> None:
    """SIGTERM while the final save is being written (1 s per file): the rank says at once that it
    finishes the save first, and step-2 is committed whole (it used to be cut off by the signal)."""
    overrides = [*TINY, *corpus, f"store.dir={shm_dir}", "train.steps=2"]
    job = _launch(2, overrides, tmp_path, "write_delay_s=1")
    try:
        deadline = time.monotonic() + 180
        while not list((tmp_path / "runs").glob("*/checkpoints/step-2.tmp/*")):
            assert job.poll() is None and time.monotonic() < deadline, "no save to interrupt"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        _finish(job, timeout_s=120)
    finally:
        if job.poll() is None:
            _kill_job(job)
    (run,) = (tmp_path / "runs").iterdir()
    text = (run / "rank0.log").read_text()
    assert "stop requested while checkpoint step-2 is being written: finishing it first" in text, text[-3000:]
    assert st.verify(run / "checkpoints" / "step-2")["step"] == 2
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_a_signal_during_data_preparation_ends_the_launch_within_seconds(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Ctrl-C while the BPE merges in Rust (tens of seconds on this corpus): the launch ends within
    seconds, says so, and leaves no half-built dataset (it used to wait for the BPE to finish)."""
    rng = np.random.default_rng(0)  # 200,000 made-up words of 3-11 letters, each with a space after
    words = rng.integers(ord("a"), ord("z") + 1, (200_000, 12), dtype=np.uint8)
    words[np.arange(12) >= rng.integers(3, 12, (200_000, 1))] = 0  # a 0 is no character (dropped)
    words = np.concatenate([words, np.full((200_000, 1), ord(" "), np.uint8)], axis=1)
    lines = words[rng.integers(0, len(words), (20_000, 200))].reshape(20_000, -1)  # 200 words a line
    lines = np.concatenate([lines, np.full((20_000, 1), ord("\n"), np.uint8)], axis=1)
    (tmp_path / "big.txt").write_bytes(lines[lines != 0].tobytes())  # ~32 MB: a BPE of 30k ids merges long
    overrides = [*TINY, f"data.source={tmp_path / 'big.txt'}", f"data.dir={tmp_path / 'prepared'}"]
    overrides += ["data.vocab_size=30000", f"store.dir={shm_dir}", "train.steps=1"]
    job = _launch(2, overrides, tmp_path)
    try:
        _wait_for(tmp_path / "runs", "*/rank0.log", "data: training a byte-level BPE", job)
        time.sleep(3)  # into the merges
        t0 = time.monotonic()
        job.send_signal(signal.SIGINT)
        rc, out, _ = _finish(job, timeout_s=120)
        stopped_s = time.monotonic() - t0
    finally:
        if job.poll() is None:
            _kill_job(job)
    assert rc != 0 and stopped_s < 10, f"the launch ended {stopped_s:.0f}s after Ctrl-C:\n{out[-3000:]}"
    assert "SIGINT: stopping before training started (nothing to save)" in out
    assert not [p.name for p in (tmp_path / "prepared").iterdir() if ".tmp-" in p.name]
