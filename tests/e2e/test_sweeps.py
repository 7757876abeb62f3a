"""Sweeps and launchers, as a user runs them: Hydra ``--multirun`` under torchrun, the sweep launcher
that changes the world size, and the multi-node and Slurm scripts.

The multirun and launcher tests run the real entry points (gloo, CPU) in subprocesses; the wandb
runs are read back from their offline files with wandb's own protobuf schema. The Slurm template
and the by-hand multi-node script run with stand-ins for ``srun``, ``scontrol`` and ``torchrun`` that
record what they were asked to run.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import tqdm
from conftest import ROOT, TINY_RUN, torchrun_cmd
from wandb_log import read_run

from nodetrain.config.schema import OptimConfig
from nodetrain.run.jobs import Release
from nodetrain.run.plots import SWEEP_PLOT, sweep_curves

TINY = [*TINY_RUN, "train.eval_batches=1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _env(tmp_path: Path, wandb_mode: str, faults: str = "") -> dict[str, str]:
    wandb_home = str(tmp_path / "wandb_home")
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        NODETRAIN_RUNS=str(tmp_path / "runs"),
        OMP_NUM_THREADS="1",
        WANDB_MODE=wandb_mode,
        WANDB_CONFIG_DIR=wandb_home,
        WANDB_CACHE_DIR=wandb_home,
        WANDB_DATA_DIR=wandb_home,
        NODETRAIN_FAULTS=faults,
    )


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    return proc


def _records(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


def test_release_ignores_tqdm_monitor_but_reports_a_jobs_thread(tmp_path: Path, caplog) -> None:
    """tqdm's monitor thread (``datasets`` starts it with a records run) lives for the process, like
    wandb's: no "job left behind" for it; a thread the job started and left is still reported."""
    release, stop = Release(), threading.Event()
    monitor = tqdm._monitor.TMonitor(tqdm.tqdm, 1000)  # what tqdm starts: a thread named tqdm_monitor
    try:
        assert monitor.name == "tqdm_monitor" and monitor.is_alive()
        still, threads = release.check(tmp_path / "store")
        assert not still and threads == []
        assert "job left behind" not in caplog.text
        leak = threading.Thread(target=stop.wait, name="copy_worker")
        leak.start()
        assert release.check(tmp_path / "store")[1] == ["copy_worker"]
    finally:
        stop.set()
        monitor.exit()


# ----------------------------------------------------------------------------- --multirun


def test_multirun_of_two_learning_rates_on_two_ranks(
    tmp_path: Path, corpus: list[str], shm_dir: Path
) -> None:
    lrs, steps = ("0.001", "0.0003"), 2
    overrides = [*TINY, *corpus, f"train.steps={steps}", f"train.eval_every={steps}", f"store.dir={shm_dir}"]
    overrides += ["logging.tags=[lr-sweep]", f"optim.lr={','.join(lrs)}", "logging.plots=true"]
    cmd = torchrun_cmd(2)
    proc = _run([*cmd, "-m", "nodetrain.train", "--multirun", *overrides], _env(tmp_path, "offline"), 400)
    exited = time.time()
    console = proc.stdout + proc.stderr
    info_ranks = set(re.findall(r"^\[[^\]]+\]\[rank(\d+)\]\[[^\]]+\]\[INFO\]", console, re.MULTILINE))
    assert info_ranks == {"0"}, f"INFO lines on the console from ranks {info_ranks}:\n{console[-3000:]}"
    assert re.search(r"^step 2/2 100% \| 0:00:\d\d elapsed \| ETA 0:00:00 \| loss", console, re.MULTILINE)

    (sweep,) = (tmp_path / "runs").iterdir()  # one sweep directory, one job directory per value
    assert sweep.name.startswith("multirun_")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"], "a third directory"
    warmup = OptimConfig().warmup_steps
    runs = []
    for num, lr in enumerate(lrs):
        job = sweep / str(num)
        records = _records(job)
        assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
        assert records[1]["lr"] == pytest.approx(float(lr) / warmup, rel=1e-9)  # this job's lr, step 1
        assert f"optim.lr={lr}" in (job / ".hydra" / "overrides.yaml").read_text()
        logs = [(job / f"rank{r}.log").read_text() for r in (0, 1)]
        assert re.search(r"stage 1/2 \(replica 0/1\): layers\.1 … head, 2 units", logs[1]), logs[1][-2000:]
        for r, log in enumerate(logs):  # every line of a rank's own log carries its rank
            starts = [ln for ln in log.splitlines() if re.match(r"\[\d{4}-", ln)]
            assert starts and all(f"][rank{r}][" in ln for ln in starts), log[-2000:]
        for log in logs:  # one process group for the sweep; each job let go of its store and threads
            assert ("process group: reused" in log) == (num == 1), log[-2000:]
            assert "job released: host store" in log and "no threads left" in log
        for png in ("loss", "tokens_per_s", "time", "summary"):
            assert (job / "plots" / f"{png}.png").read_bytes().startswith(PNG_SIGNATURE)

        (wandb_file,) = (job / "wandb").glob("offline-run-*/run-*.wandb")
        run = read_run(wandb_file)
        assert run.exit_code == 0, f"job {num}: the wandb run was not finished"
        assert (run.group, run.name, run.tags) == (sweep.name, f"optim.lr={lr}", ["lr-sweep"])
        assert run.config["optim"]["lr"] == float(lr) and run.config["train"]["steps"] == steps
        logged = [h for h in run.history if "step" in h]
        assert [h["step"] for h in logged] == [r["step"] for r in records]
        assert all(h["loss"] == r["loss"] for h, r in zip(logged[1:], records[1:], strict=True))
        runs.append(run.run_id)
    assert runs[0] != runs[1], "both jobs logged into one wandb run"
    assert (sweep / SWEEP_PLOT).read_bytes().startswith(PNG_SIGNATURE)
    curves = sweep_curves(sweep)  # one line per job, named by the swept value
    assert [(label, steps) for label, steps, _ in curves] == [
        (f"{n}: optim.lr={lr}", [1, 2]) for n, lr in enumerate(lrs)
    ]

    last_step = max((sweep / str(n) / "metrics.jsonl").stat().st_mtime for n in (0, 1))
    assert exited - last_step < 30, f"exited {exited - last_step:.1f}s after the last step"


def test_a_refused_later_job_of_a_sweep_is_printed_once_by_rank_0(
    tmp_path: Path, corpus: list[str], shm_dir
) -> None:
    """Job 1 of a sweep has a bad key (optim.lr=inf): its refusal reaches the console once (rank 0
    waits for its peers at the job's start instead of being killed while finishing job 0)."""
    overrides = [
        *TINY,
        *corpus,
        "train.steps=1",
        "train.eval_every=0",
        f"store.dir={shm_dir}",
        "optim.lr=1e-3,inf",
    ]
    cmd = [*torchrun_cmd(2), "-m", "nodetrain.train", "--multirun", *overrides]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(tmp_path, "disabled"), capture_output=True, text=True, timeout=300
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert console.count("optim.lr=inf: must be a finite number") == 1, console[-4000:]
    (sweep,) = (tmp_path / "runs").iterdir()
    assert "optim.lr=inf: must be a finite number" in (sweep / "1" / "rank0.log").read_text()


def test_multirun_job_failing_on_one_rank_ends_the_sweep(tmp_path: Path, corpus: list[str], shm_dir) -> None:
    """Rank 1 of 2 raises at step 2 of job 0 (``NODETRAIN_FAULTS=fail_rank=1,fail_step=2``); rank 0 is then
    waiting for it in the pipeline. Hydra would start job 1 after a failed job; instead every rank exits
    within seconds, job 1 never starts, rank 1's traceback is torchrun's root cause, and nothing of the run is
    left in /dev/shm (DESIGN invariant 7; issue 5's 2-rank failure)."""
    overrides = [*TINY, *corpus, "train.steps=20", "train.eval_every=0", "logging.plots=false"]
    overrides += [f"store.dir={shm_dir}", "optim.lr=1e-3,3e-4"]
    cmd = torchrun_cmd(2)
    cmd += ["-m", "nodetrain.train", "--multirun", *overrides]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=_env(tmp_path, "disabled", "fail_rank=1,fail_step=2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    exited = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    (sweep,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"], "job 1 started after a failure"
    log = (sweep / "0" / "rank1.log").read_text()
    assert "job failed; ending this rank" in log and "fail_step=2: injected failure" in log
    assert [r["step"] for r in _records(sweep / "0")] == [1], "step 2 must not complete"
    failed = re.search(r"^\[([\d\- :,]+)\]\[rank1\]\[nodetrain\.run\.jobs\]\[ERROR\] - job failed", log, re.M)
    failed_at = failed[1]
    since_s = exited - datetime.strptime(failed_at, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert since_s < 60, f"the ranks took {since_s:.0f}s to exit after the failure"
    root = out[out.index("Root Cause (first observed failure)") :]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root) and "injected failure" in root, root[:3000]
    assert not [p.name for p in Path("/dev/shm").iterdir() if sweep.name in p.name]


# ----------------------------------------------------------------------------- launch/sweep.py


def test_sweep_launcher_starts_one_torchrun_per_world_size(
    tmp_path: Path, corpus: list[str], shm_dir
) -> None:
    overrides = [*TINY, *corpus, "train.steps=1", "train.eval_every=0", f"store.dir={shm_dir}"]
    overrides += ["logging.plots=false", "pipeline.stages=1,2"]
    cmd = [sys.executable, str(ROOT / "launch" / "sweep.py"), "--multirun", *overrides]
    _run(cmd, _env(tmp_path, "disabled"), 400)

    (sweep,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for num, stages in enumerate((1, 2)):
        job = sweep / str(num)
        assert [r["step"] for r in _records(job) if "loss" in r] == [1]
        assert sorted(p.name for p in job.glob("rank*.log")) == [f"rank{r}.log" for r in range(stages)]
        assert f"stage {stages - 1}/{stages}" in (job / f"rank{stages - 1}.log").read_text()
        assert "torch.distributed.run --standalone" in (job / "launcher.log").read_text()
        child = (job / ".hydra" / "overrides.yaml").read_text()  # written by the child's rank 0
        assert (
            f"logging.name='pipeline.stages={stages}'" in child and f"logging.group='{sweep.name}'" in child
        )


# ----------------------------------------------------------------------------- shell launchers

_RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "node": os.environ.get("SLURM_NODEID"),
                        "run_id": os.environ.get("NODETRAIN_RUN_ID")}) + "\\n")
"""
_SRUN = """#!/usr/bin/env bash
# stand-in for srun on a 2-node allocation: record the options, then run the command once per node
opts=(); while [[ "$1" == --* ]]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$CALLS.srun"
for node in 0 1; do SLURM_NODEID=$node "$@"; done
"""
_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2 $3" == "show hostnames gpu-a[01-02]" ]] && printf 'gpu-a01\\ngpu-a02\\n'
"""


def _stubs(tmp_path: Path, **scripts: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls.jsonl")}


def _calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_slurm_template_runs_torchrun_on_two_nodes_of_eight_gpus(tmp_path: Path) -> None:
    script = ROOT / "launch" / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    header = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in header and "#SBATCH --gpus-per-node=8" in header
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NODETRAIN_"))}
    env.update(_stubs(tmp_path, torchrun=_RECORDER, srun=_SRUN, scontrol=_SCONTROL))
    env.update(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="8",
        SLURM_JOB_NODELIST="gpu-a[01-02]",
        SLURM_SUBMIT_DIR=str(tmp_path),
    )
    subprocess.run(["bash", str(script), "model=llama3_8b", "train.seq_len=4096"], env=env, check=True)

    calls = _calls(tmp_path)
    expected = "--nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint gpu-a01:29500 "
    expected += "--rdzv_id 4242 -m nodetrain.train model=llama3_8b train.seq_len=4096"
    assert [c["node"] for c in calls] == ["0", "1"] and {c["prog"] for c in calls} == {"torchrun"}
    assert all(" ".join(c["argv"]) == expected for c in calls), calls
    run_ids = {c["run_id"] for c in calls}  # one run directory for every node
    assert len(run_ids) == 1 and run_ids.pop().endswith("_slurm4242")
    assert (tmp_path / "calls.jsonl.srun").read_text().split() == [
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]


def test_multi_node_script_passes_node_rank_and_master(tmp_path: Path) -> None:
    script = ROOT / "launch" / "multi_node.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = dict(os.environ, **_stubs(tmp_path, torchrun=_RECORDER), NNODES="2", NODE_RANK="1")
    env.update(MASTER_ADDR="10.1.2.3", RUN_ID="llama-a")
    subprocess.run(["bash", str(script), "8", "model=llama3_8b"], env=env, check=True)
    (call,) = _calls(tmp_path)
    assert " ".join(call["argv"]) == (
        "--nnodes 2 --node_rank 1 --nproc_per_node 8 --master_addr 10.1.2.3 --master_port 29500 "
        "-m nodetrain.train model=llama3_8b"
    )
    assert call["run_id"] == "llama-a"
    del env["RUN_ID"]
    proc = subprocess.run(["bash", str(script), "8"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "RUN_ID" in proc.stderr
