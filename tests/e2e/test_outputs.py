"""A run's claim on its outputs (nodetrain/run/outputs.py), in process: locks, stale locks, another run's
checkpoints, unwritable and too small directories, and which run ``checkpoint.resume=auto`` continues."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import time
from collections import namedtuple
from pathlib import Path

import pytest
from conftest import TINY_RUN, job_env, start_job, torchrun_cmd
from omegaconf import OmegaConf

from nodetrain.checkpoint import state as st
from nodetrain.config.schema import ConfigError
from nodetrain.run import outputs
from nodetrain.run.jobs import LiveRunGuard
from nodetrain.run.outputs import (
    LOCK_NAME,
    RunOutputs,
    check_space,
    check_writable,
    refuse_if_held,
    refuse_overwrite,
    run_to_continue,
)


def _checkpoint(ckpts: Path, step: int, config_hash: str, run_dir: Path) -> Path:
    """A complete ``step-N`` as far as ownership is concerned: ``trainer_state.json`` is what makes it so."""
    ckpt = ckpts / st.step_dir_name(step)
    ckpt.mkdir(parents=True)
    state = {"step": step, "config_hash": config_hash, "run_dir": str(run_dir), "config": {"seed": 1}}
    (ckpt / st.TRAINER_STATE).write_text(json.dumps(state))
    return ckpt


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_live_lock_refuses_a_second_run_naming_the_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = RunOutputs(run, run / "checkpoints", "", "a" * 64)
    first.acquire()
    lock = json.loads((run / LOCK_NAME).read_text())
    assert lock["pid"] == os.getpid() and lock["run_dir"] == str(run)
    assert (run / "checkpoints" / LOCK_NAME).is_file()
    second = RunOutputs(run, run / "checkpoints", "", "b" * 64)
    with pytest.raises(ConfigError) as info:
        second.acquire()
    msg = str(info.value)
    assert f"hydra.run.dir={run}: another run is writing there" in msg
    assert f"pid {os.getpid()}" in msg and "a" * 12 in msg and str(run) in msg
    with pytest.raises(ConfigError) as info:  # the check before Hydra writes (jobs.LiveRunGuard)
        refuse_if_held("hydra.run.dir", run)
    assert str(info.value) == msg
    first.release()
    assert not (run / LOCK_NAME).exists() and not (run / "checkpoints" / LOCK_NAME).exists()
    refuse_if_held("hydra.run.dir", run)  # free: no error, and no lock file made
    assert not (run / LOCK_NAME).exists()
    second.acquire()  # free again once the first let go
    second.release()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    run.mkdir()
    pid = _dead_pid()
    stale = {"pid": pid, "host": os.uname().nodename, "run_dir": "old", "config_hash": "x", "started": "t"}
    (run / LOCK_NAME).write_text(json.dumps(stale))
    caplog.set_level(logging.WARNING)
    claim = RunOutputs(run, run / "checkpoints", "", "c" * 64)
    claim.acquire()
    assert f"taking over the lock of dead process {pid}" in caplog.text
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    claim.release()


def test_another_runs_checkpoints_are_refused_unless_resumed(tmp_path: Path) -> None:
    ckpts = tmp_path / "shared"
    other_run = tmp_path / "run_a"
    _checkpoint(ckpts, 2, "d" * 64, other_run)
    _checkpoint(ckpts, 4, "d" * 64, other_run)
    before = sorted(p.name for p in ckpts.iterdir())
    claim = RunOutputs(tmp_path / "run_b", ckpts, "", "e" * 64)
    with pytest.raises(ConfigError) as info:
        claim.acquire()
    msg = str(info.value)
    assert f"checkpoint.dir={ckpts}: holds step-2, step-4 of another run (run dir {other_run}" in msg
    assert "d" * 12 in msg and "set another checkpoint.dir" in msg
    assert "checkpoint.resume=auto" not in msg  # another config: resuming it would not fit this model
    assert sorted(p.name for p in ckpts.iterdir()) == before, "a refused run left its lock behind"
    assert not (tmp_path / "run_b" / LOCK_NAME).exists()
    with pytest.raises(
        ConfigError, match=r"\(the same config\).*continue that run with checkpoint.resume=auto"
    ):
        RunOutputs(tmp_path / "run_b", ckpts, "", "d" * 64).acquire()  # the same config may resume them
    for resume in ("auto", str(ckpts / "step-2")):  # resuming them is what they are for
        claim = RunOutputs(tmp_path / "run_b", ckpts, resume, "e" * 64)
        assert claim.acquire() == str(ckpts)
        claim.release()


@pytest.mark.parametrize("which", ["hydra.run.dir", "checkpoint.dir"])
def test_unwritable_output_dir_is_refused_with_key_and_path(tmp_path: Path, which: str) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # chmod would not stop root; a path under a file does
    bad = blocker / "sub"
    run, ckpts = (bad, tmp_path / "ckpts") if which == "hydra.run.dir" else (tmp_path / "run", bad)
    claim = RunOutputs(run, ckpts, "", "f" * 64)
    with pytest.raises(ConfigError, match=f"{which}={bad}: cannot write there"):
        claim.acquire()
    assert not list(tmp_path.rglob(LOCK_NAME)), "locks taken before the refusal were not released"


def test_too_little_space_for_a_checkpoint_is_refused_with_the_numbers(tmp_path: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 5 * 10**6, 5 * 10**6))
    with pytest.raises(ConfigError) as info:
        check_space(tmp_path, 12_345_678, "checkpoint.dir")
    assert f"checkpoint.dir={tmp_path}: a checkpoint needs 12.3 MB" in str(info.value)
    assert "has 5.0 MB free" in str(info.value)
    check_space(tmp_path, 4 * 10**6, "checkpoint.dir")  # fits: no error


def test_resume_auto_continues_the_newest_run_of_the_same_config(tmp_path: Path, caplog) -> None:
    runs = tmp_path / "runs"
    old, other, newest = runs / "r1", runs / "r2", runs / "r3"
    a = _checkpoint(old / "checkpoints", 2, "h" * 64, old)
    b = _checkpoint(newest / "checkpoints", 4, "h" * 64, newest)
    c = _checkpoint(other / "checkpoints", 6, "z" * 64, other)
    for i, ckpt in enumerate((a, b, c)):  # other's checkpoint is the newest file, of another config
        os.utime(ckpt / st.TRAINER_STATE, (1000 + i, 1000 + i))
    me = runs / "r4"
    me.mkdir()
    caplog.set_level(logging.WARNING)
    assert run_to_continue(me, "h" * 64) == newest / "checkpoints"
    assert f"continuing run {newest} from its step 4" in caplog.text
    assert run_to_continue(me, "n" * 64, {"seed": 2}) is None
    assert f"the newest run with checkpoints, {other}, has another config (seed: 1 -> 2)" in caplog.text
    claim = RunOutputs(me, me / "checkpoints", "auto", "h" * 64)
    assert claim.acquire(search=True) == str(newest / "checkpoints")
    assert (newest / "checkpoints" / LOCK_NAME).is_file()  # a live r3 would refuse this run here
    claim.release()
    caplog.clear()
    claim = RunOutputs(me, me / "checkpoints", "auto", "q" * 64)
    assert claim.acquire(search=True) == str(me / "checkpoints")
    assert "starting from scratch" in caplog.text and caplog.records[-1].levelname == "WARNING"
    claim.release()


def _earlier_run(run: Path, steps: int = 3) -> bytes:
    """A run directory an earlier launch left: its metrics.jsonl (``steps`` rows) and .hydra/."""
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 1\n")
    rows = "".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in range(1, steps + 1))
    (run / "metrics.jsonl").write_text(rows)
    return rows.encode()


def _guard_config(run: Path, ckpt_dir: str = "", resume: str = ""):
    return OmegaConf.create(
        {"hydra": {"run": {"dir": str(run)}}, "checkpoint": {"dir": ckpt_dir, "resume": resume}}
    )


def test_a_launch_from_scratch_into_an_earlier_run_is_refused_before_hydra_writes(
    tmp_path: Path, capsys
) -> None:
    """Issue 25 case 4: a from-scratch launch into a run directory holding results (another
    checkpoint.dir, or resume=auto after the checkpoints moved) is refused by the Hydra callback
    that runs before Hydra rewrites .hydra/, naming the run and both ways on; metrics.jsonl is kept."""
    run = tmp_path / "run"
    rows = _earlier_run(run)
    moved = tmp_path / "moved"  # resume=auto where the checkpoints are not (any more)
    for ckpt_dir, resume in ((str(tmp_path / "other"), ""), (str(moved), "auto"), ("", "auto")):
        with pytest.raises(SystemExit):
            LiveRunGuard().on_run_start(_guard_config(run, ckpt_dir, resume))
        err = capsys.readouterr().err
        assert f"hydra.run.dir={run}: holds an earlier run (metrics.jsonl: 3 row(s) up to step 3)" in err, err
        assert "start fresh in a new run directory" in err and "checkpoint.resume=auto" in err
        assert "nothing was changed there" in err
    assert (run / "metrics.jsonl").read_bytes() == rows and (run / ".hydra" / "config.yaml").is_file()
    with pytest.raises(ConfigError, match="holds an earlier run"):  # and again where the outputs are claimed
        RunOutputs(run, tmp_path / "other", "", "a" * 64).acquire()
    assert (run / "metrics.jsonl").read_bytes() == rows


def test_a_launch_that_continues_the_run_in_its_directory_may(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _earlier_run(run)
    ckpts = run / "checkpoints"
    ckpts.mkdir()
    (ckpts / "step-2").mkdir()
    (ckpts / "step-2" / st.TRAINER_STATE).write_text("{}")
    refuse_overwrite(run, ckpts, "auto")  # a complete checkpoint to continue
    refuse_overwrite(run, tmp_path / "elsewhere", str(ckpts / "step-2"))  # an explicit resume
    refuse_overwrite(tmp_path / "fresh", tmp_path / "x", "")  # a new run directory
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")  # a launch that never logged a step
    refuse_overwrite(tmp_path / "empty", tmp_path / "x", "")
    LiveRunGuard().on_run_start(_guard_config(run, "", "auto"))


def test_a_runs_root_that_is_not_a_writable_directory_is_refused_by_name(tmp_path: Path, capsys) -> None:
    """A runs root that is a file: the refusal names hydra.run.dir and the reason (it used to be
    Hydra's OSError traceback from every rank)."""
    root = tmp_path / "runs"
    root.write_text("a file")
    with pytest.raises(SystemExit):
        LiveRunGuard().on_run_start(_guard_config(root / "2026-01-01_00-00-00_ab12"))
    err = capsys.readouterr().err
    assert f"hydra.run.dir={root / '2026-01-01_00-00-00_ab12'}: cannot write there" in err, err
    assert "Traceback" not in err


def test_a_store_dir_that_is_not_a_writable_directory_is_refused_by_name(tmp_path: Path) -> None:
    """store.dir is not created by the run (a tmpfs is mounted, not made): a missing path or a file is
    refused as not a directory, one it cannot write to with the system's reason."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"store.dir={blocker}: not a directory; create it"):
        check_writable("store.dir", blocker, create=False)
    with pytest.raises(ConfigError, match=f"store.dir={tmp_path / 'none'}: not a directory"):
        check_writable("store.dir", tmp_path / "none", create=False)
    check_writable("store.dir", tmp_path, create=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"], "the probe was left behind"


# ----------------------------------------------------------------------------- real launches


def _launch(overrides: list[str], runs: Path, faults: str = "", nproc: int = 2) -> subprocess.Popen:
    cmd = torchrun_cmd(nproc, "-m", "nodetrain.train", *overrides)
    return start_job(cmd, job_env(NODETRAIN_RUNS=str(runs), NODETRAIN_FAULTS=faults))


def _sha256s(directory: Path) -> dict[str, str]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_run_b_refuses_run_a_checkpoint_dir_and_leaves_it_intact(tmp_path: Path, corpus, shm_dir) -> None:
    """Run A (qwen3_tiny, one rank: it only leaves checkpoints) then run B (mistral_tiny, two ranks)
    with one checkpoint.dir: B is refused before it allocates anything, naming A's run dir, once (by
    rank 0), and A's checkpoints are byte for byte what A wrote."""
    shared = tmp_path / "shared_ckpts"
    common = [*corpus, *TINY_RUN[5:], f"checkpoint.dir={shared}", f"store.dir={shm_dir}", "train.steps=2"]
    common += ["train.eval_every=0", "checkpoint.every=1", "logging.wandb=false", "logging.plots=false"]
    a = _launch(["model=qwen3_tiny", f"hydra.run.dir={tmp_path / 'a'}", *common], tmp_path, nproc=1)
    out_a = a.communicate(timeout=240)[0]
    assert a.returncode == 0, out_a[-4000:]
    before = _sha256s(shared)
    assert {"step-1/trainer_state.json", "step-2/trainer_state.json"} <= before.keys()
    b = _launch(["model=mistral_tiny", f"hydra.run.dir={tmp_path / 'b'}", *common], tmp_path)
    out_b = b.communicate(timeout=240)[0]
    assert b.returncode != 0
    assert f"checkpoint.dir={shared}: holds step-1, step-2 of another run (run dir {tmp_path / 'a'}" in out_b
    assert out_b.count("holds step-1, step-2 of another run") == 1  # printed once, by rank 0
    assert _sha256s(shared) == before
    assert not list(tmp_path.rglob(LOCK_NAME)), "a lock outlived its run"


def test_two_launches_on_one_run_dir_the_second_is_refused(tmp_path: Path, corpus, shm_dir) -> None:
    """While a run trains, a second launch with its hydra.run.dir is refused naming it (pid, run dir)
    before Hydra writes its config snapshot or log lines there; the first goes on alone (its records
    are not interleaved) and lets go of its locks when it stops."""
    run = tmp_path / "run"
    args = [*corpus, *TINY_RUN, f"hydra.run.dir={run}", f"store.dir={shm_dir}", "train.eval_every=0"]
    args += ["logging.wandb=false", "logging.plots=false", "train.steps=500", "checkpoint.on_signal=exit"]
    first = _launch(args, tmp_path, "copy_delay_s=0.05")  # slow steps: still running later
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file():
            assert first.poll() is None, first.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the first launch never started training"
            time.sleep(0.1)
        owner = json.loads((run / LOCK_NAME).read_text())
        snapshot = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
        second = _launch(args, tmp_path)
        out2 = second.communicate(timeout=120)[0]
        assert first.poll() is None, "the first run ended before the second was refused"
        # refused before Hydra wrote there: the first's snapshot (its overrides differ) and rank logs
        assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == snapshot
        for rank_log in run.glob("rank*.log"):
            text = rank_log.read_text()
            assert text.count("process group:") == 1 and "another run" not in text, rank_log
        first.send_signal(signal.SIGTERM)  # torchrun forwards it: every rank stops after one step
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode != 0
    assert f"hydra.run.dir={run}: another run is writing there" in out2 and f"pid {owner['pid']}" in out2
    assert out2.count("another run is writing there") == 1  # by rank 0, once ...
    assert "/nodetrain/" not in out2  # ... without a traceback of ours (torchrun prints its own)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)), steps  # one writer: no interleaved records
    assert not (run / LOCK_NAME).exists() and not (run / "checkpoints" / LOCK_NAME).exists()
