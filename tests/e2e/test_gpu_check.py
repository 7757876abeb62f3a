"""``bench/gpu_check.sh``: its syntax, its usage errors, and its dry run on CPU end to end.

The dry run goes through the same steps as on a GPU machine (``pytest -m gpu``, which skips here,
the copy bandwidths of ``bench/copy_bandwidth.py`` on the CPU, the 2-rank vs 1-rank loss check of
``bench/gpu_two_rank.py`` on gloo, the sync counts, a streamed ``torchrun -m nodetrain.train`` of a
tiny Llama-3.2-3B-like shape, the peers of ``bench/gpu_peers.py`` (plain PyTorch, FSDP2 with CPU
offload on a gloo CPU mesh), a tiny Qwen3-MoE run and the resume check of ``bench/gpu_resume.py``)
and must leave the JSON files the GPU run leaves, with the fields the closing note reports, in one
``check.json``. The comparisons the check makes (resumed vs uninterrupted, ratios to the peers, the
start-up read from a log) are checked on their own below, each with a case that must fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
sys.path.insert(0, str(ROOT))
from bench import _check_json, copy_bandwidth  # noqa: E402
from bench._gpu_shapes import DENSE, MOE  # noqa: E402

LINK_KEYS = (
    "h2d_pinned_gbps",
    "d2h_pinned_gbps",
    "h2d_while_d2h_gbps",
    "d2h_while_h2d_gbps",
    "h2d_pageable_gbps",
    "d2h_pageable_gbps",
)
"""bench/copy_bandwidth.py's link figures, GB/s, in copy_bandwidth.json and check.json's step."""


def test_syntax_and_usage(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    no_args = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert no_args.returncode == 2 and "usage" in no_args.stderr
    bad = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "--fast"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--dry-run" in bad.stderr


def test_dry_run_writes_the_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--dry-run"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads((out / "check.json").read_text())
    assert check["dry_run"] and check["passed"] and check["gpu"] is None
    steps = check["steps"]
    assert set(steps) == set(_check_json.STEPS)
    assert all(s["passed"] and s["rc"] == 0 and s["s"] >= 0 for s in steps.values()), steps
    assert steps["gpu_tests"]["tests"] == steps["gpu_tests"]["skipped"] > 0  # no CUDA here
    assert steps["copy_bandwidth"]["h2d_store_gbps"] > 0
    assert 0 <= steps["two_rank"]["max_abs_diff"] <= 1e-5 and "gloo" in steps["two_rank"]["backend_2rank"]
    assert steps["gpu_syncs"]["grows_with_microbatches"] is False  # the CPU counter's, on a dry run
    streamed = steps["train"]["streamed"]
    assert streamed["mfu"] > 0 and streamed["peak_flops_source"] == "measured matmul (CPU)"
    assert streamed["startup_s"] > 0 and streamed["startup_gbps"] > 0
    loss = streamed["loss_first_last"]
    assert loss[1] < loss[0]
    peers = steps["peers"]
    for shape, peer in (("dense", "plain"), ("dense", "fsdp2_offload"), ("moe", "plain")):
        assert peers[shape][peer]["tokens_per_s"] > 0 and peers[shape][peer]["mfu"] > 0, (shape, peer)
    assert peers["dense"]["plain"]["layers"] == steps["train"]["layers"] == 4
    assert streamed["vs_plain"] > 0 and streamed["vs_fsdp2_offload"] > 0
    moe = steps["train_moe"]["moe"]
    assert steps["train_moe"]["layers"] == peers["moe"]["plain"]["layers"] == 2
    assert moe["vs_plain"] > 0 and moe["mfu"] > 0 and "vs_fsdp2_offload" not in moe
    resume = steps["resume"]
    assert resume["steps_equal"] and resume["checkpoint_equal"] and resume["tensors"] > 0
    two = json.loads((out / "two_rank" / "two_rank.json").read_text())
    assert len(two["losses_1rank"]) == len(two["losses_2rank"]) == 5
    copies = json.loads((out / "copy_bandwidth.json").read_text())
    for key in (*LINK_KEYS, "h2d_store_gbps", "d2h_staging_gbps", "offload_gbps"):
        assert copies[key] > 0 and steps["copy_bandwidth"][key] == copies[key], key
    assert copies["device"] == "cpu" and not copies["staging_pinned"] and not copies["host_pinned"]
    assert steps["copy_bandwidth"]["errors"] == {} and steps["copy_bandwidth"]["d2h_mb"] == 8.0
    lines = copy_bandwidth.profile_lines(out / "check.json")  # the documented --profile-lines
    assert any("DRY RUN" in line for line in lines) and lines[-1].startswith("host_link_d2h_gbps: ")
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"]["streamed"]
    for key in ("tflops", "mfu", "h2d_gbps", "d2h_gbps", "stall_pct", "step_s", "shares_pct"):
        assert key in run, key
    assert run["h2d_gbps"] > 0 and 0 < run["mfu"]
    last = json.loads((out / "streamed.json").read_text())["last_step"]
    assert "stage0/compute_s" in last and last["num_resident"] == 0
    # no checkpoint unless asked (gpu_train.py --checkpoint): the 3B run's would be ~45 GB
    assert summary["failed"] == {} and "ckpt_stall_s" not in last
    assert not list(out.rglob("step-*")), sorted(str(p.relative_to(out)) for p in out.rglob("step-*"))
    written = [str(p.relative_to(out)) for d in out.rglob("checkpoints") for p in d.iterdir()]
    assert written == []  # each run's checkpoint.dir only held its lock file while the run lived


def test_peers_train_transformers_own_models(one_rank_world) -> None:
    """The dry run's peers step in this process (what of the check calls transformers directly, so
    CI's oldest-transformers leg runs this and leaves the whole dry run to the first leg):
    ``AutoModelForCausalLM.from_config`` of each shape's nodetrain config in the peer's dtype, trained
    with ``labels`` for a step (forward and backward of each micro-batch, the optimizer step), plain
    and under FSDP2 with CPU offload, on one decoder layer (the dry run's models have 4 and 2).
    Randomly initialised (std 0.02), the loss is the uniform guess's, ln(vocab size)."""
    spec = importlib.util.spec_from_file_location("gpu_peers", ROOT / "bench" / "gpu_peers.py")
    gpu_peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_peers)
    device = torch.device("cpu")
    for name, peer, _, _ in gpu_peers.PEERS:
        shape = DENSE if name == "dense" else MOE
        layers = 1
        got = gpu_peers.measure(shape, peer, 1, layers, device, True, (1e12, "test"))
        vocab = shape.hf_model(layers, True).config.vocab_size
        assert got["peer"] == peer and got["layers"] == layers and len(got["steps"]) == 1
        assert abs(got["losses"][0] - math.log(vocab)) < 0.1, (name, peer, got["losses"])
        assert got["tokens_per_s"] > 0 and got["mfu"] > 0 and got["peak_flops_source"] == "test"


def _gpu_train():
    """bench/gpu_train.py as a module (it is a script beside the package)."""
    spec = importlib.util.spec_from_file_location("gpu_train", ROOT / "bench" / "gpu_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoint_space_is_checked_up_front(tmp_path: Path) -> None:
    """``--checkpoint`` is refused before any launch unless the free space of ``--out`` holds the
    checkpoint, less the host store's size when the store is on the same filesystem."""
    gpu_train, gb = _gpu_train(), 1 << 30
    free = shutil.disk_usage(tmp_path).free
    other = "/dev/shm"
    assert os.stat(other).st_dev != os.stat(tmp_path).st_dev
    assert gpu_train.checkpoint_refusal(tmp_path, other, free, free // 2) is None  # the store lives elsewhere
    refusal = gpu_train.checkpoint_refusal(tmp_path, str(tmp_path), free // 2 + gb, free // 2)
    assert refusal is not None and "less the host store's" in refusal and "without --checkpoint" in refusal
    refusal = gpu_train.checkpoint_refusal(tmp_path, other, 0, free + 4 * gb)
    assert refusal is not None and f"{(free + 4 * gb) / 1e9:.1f} GB" in refusal
    # the 3B model's checkpoint: 14 bytes per parameter (bf16 export, fp32 master, exp_avg, exp_avg_sq)
    params = sum(u.numel for u in DENSE.hf_model(28, False).units)
    assert 3.2e9 < params < 3.3e9 and gpu_train.checkpoint_nbytes(28, False) >= 14 * params


def test_shapes_of_the_check() -> None:
    """The models the check trains, as their docstrings state them: the 3B store fits a 128 GiB node's
    /dev/shm, and the shortened MoE's store, total and active parameters are what ``MOE`` says."""
    from bench._gpu_shapes import store_bytes

    assert 59e9 < store_bytes(DENSE, 28, False) < 60e9
    moe = MOE.hf_model(2, False)
    assert 1.86e9 < sum(u.numel for u in moe.units) < 1.88e9
    assert 0.42e9 < sum(moe.block_cost(i) for i in range(len(moe.units))) < 0.43e9
    assert 33e9 < store_bytes(MOE, 2, False) < 35e9


def test_startup_is_read_from_the_log(tmp_path: Path) -> None:
    """From the first line of build_engine to the engine's layout line; None without both."""
    gpu_train = _gpu_train()
    lines = [
        "[2026-12-04 17:48:02,339][rank0][nodetrain][INFO] - process group: nccl, world size 1",
        "[2026-12-04 17:48:05,259][rank0][nodetrain.engine.host.binding][INFO] - host threads of this rank's",
        "[2026-12-04 17:48:38,896][rank0][nodetrain.store][INFO] - page-locked 6425.5 MB of the host store",
        "[2026-12-04 17:48:39,598][rank0][nodetrain.engine.engine][INFO] - stage 0/1 (replica 0/1): embed",
    ]
    log = tmp_path / "rank0.log"
    log.write_text("\n".join(lines))
    assert abs(gpu_train.startup(log) - 34.339) < 1e-9
    log.write_text("\n".join(lines[:3]))
    assert gpu_train.startup(log) is None


def test_ratios_to_the_peers_need_the_same_model() -> None:
    """vs_plain / vs_fsdp2_offload: tok/s over the peer's at the same layer count; None otherwise."""
    summary = {"layers": 28, "runs": {"streamed": {"tokens_per_s": 8000.0}}, "failed": {}}
    peers = {"dense": {"plain": {"tokens_per_s": 20000.0, "layers": 28}, "fsdp2_offload": None}}
    step = {"passed": True}
    _check_json._training(step, summary, peers, "dense")
    assert step["streamed"]["vs_plain"] == 0.4 and step["streamed"]["vs_fsdp2_offload"] is None
    peers["dense"]["plain"]["layers"] = 27  # a shortened peer is not the same model
    _check_json._training(step, summary, peers, "dense")
    assert step["streamed"]["vs_plain"] is None and step["passed"]
    _check_json._training(
        step, {**summary, "failed": {"auto_residency": "the loss did not go down"}}, peers, "dense"
    )
    assert not step["passed"]


def _gpu_resume():
    spec = importlib.util.spec_from_file_location("gpu_resume", ROOT / "bench" / "gpu_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resume_comparison_fails_on_any_difference(tmp_path: Path) -> None:
    """The resume check compares the steps after K exactly and every checkpoint tensor with torch.equal:
    one changed loss bit or one changed weight element fails it."""
    gpu_resume = _gpu_resume()
    k = gpu_resume.K
    full = [
        {"step": s, "loss": 5.0 - s / 7, "grad_norm": 1.0 + s / 3} for s in range(1, gpu_resume.STEPS + 1)
    ]
    resumed = [dict(r) for r in full if r["step"] > k]
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        save_file({"model.w": torch.arange(6.0).view(2, 3)}, str(d / "master-00001-of-00001.safetensors"))
    assert gpu_resume.compare(full, resumed, a, b)["checkpoint_equal"]
    assert gpu_resume.compare(full, resumed, a, b)["steps_equal"]
    resumed[-1]["loss"] = math.nextafter(resumed[-1]["loss"], math.inf)  # one bit off
    assert not gpu_resume.compare(full, resumed, a, b)["steps_equal"]
    w = torch.arange(6.0).view(2, 3)
    w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(10.0))
    save_file({"model.w": w}, str(b / "master-00001-of-00001.safetensors"))
    result = gpu_resume.compare(full, full[k:], a, b)
    assert (
        result["steps_equal"]
        and not result["checkpoint_equal"]
        and result["tensors_differ"] == ["master/model.w"]
    )


def test_the_check_runs_every_file_with_a_gpu_marked_test() -> None:
    """gpu_check.sh's pytest step (``GPU_TESTS``) names every test file holding a gpu-marked test:
    a CUDA case left out runs nowhere (CI has no GPU)."""
    listed = re.search(r"GPU_TESTS=\(([^)]*)\)", SCRIPT.read_text()).group(1).split()
    marked = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if re.search(r"pytest\.mark\.gpu\b", p.read_text())
    ]
    assert sorted(listed) == sorted(marked)
    assert all((ROOT / f).is_file() for f in listed)


def test_the_copy_figures_go_into_check_json_and_the_profile_lines(tmp_path: Path) -> None:
    """copy_bandwidth.json's figures land in check.json's copy_bandwidth step, which fails when a part
    of the bench failed; ``--profile-lines`` prints pastable ``hardware`` lines from it (pinned, each
    direction alone), the other figures in comments."""
    figures = dict(zip(LINK_KEYS, (52.5, 49.25, 40.0, 38.0, 9.0, 6.5), strict=True))
    copies = {"device": "cuda:0", "h2d_mb": 201.4, "d2h_mb": 402.8, "repeats": 10, "errors": {}}
    copies.update(figures, host_pinned=True, both_overlapped=True, passed=True)
    (tmp_path / "copy_bandwidth.json").write_text(json.dumps(copies))
    (tmp_path / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}))
    n = len(_check_json.STEPS)
    check = _check_json.collect(tmp_path, False, [0] * n, [1] * n)
    step = check["steps"]["copy_bandwidth"]
    assert step["passed"] and {k: step[k] for k in LINK_KEYS} == figures and step["both_overlapped"]
    (tmp_path / "check.json").write_text(json.dumps(check))
    lines = copy_bandwidth.profile_lines(tmp_path / "check.json")
    assert "NVIDIA H200" in lines[0] and not any("DRY RUN" in line for line in lines)
    values = yaml.safe_load("\n".join(lines))
    assert values == {"host_link_gbps": 52.5, "host_link_d2h_gbps": 49.2}  # one decimal, as printed
    assert (
        "alone (201 MB copies, median of 10); 40.0 with the other direction running, 9.0 pageable" in lines[1]
    )
    assert "D2H alone (403 MB copies, median of 10); 38.0 with the other" in lines[2]
    from nodetrain.config.hardware import HardwareConfig

    assert set(values) <= {f.name for f in dataclasses.fields(HardwareConfig)}
    copies.update(passed=False, errors={"window": "RuntimeError: cudaHostRegister failed"})
    (tmp_path / "copy_bandwidth.json").write_text(json.dumps(copies))
    step = _check_json.collect(tmp_path, False, [0] * n, [1] * n)["steps"]["copy_bandwidth"]
    assert not step["passed"] and step["errors"] == copies["errors"] and step["h2d_pinned_gbps"] == 52.5


def test_a_killed_job_leaves_no_rank_behind() -> None:
    """``bench._launch.kill_job`` (the check's and the tests' launches, at a timeout or an interrupt):
    a launcher whose "rank" runs in a session of its own, as torchrun starts its ranks, leaves
    nothing behind; killing the launcher's process group alone, as before, left the rank running."""
    import psutil

    from bench._launch import kill_job

    spawn = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
        "time.sleep(60)"
    )
    for fixed in (False, True):
        proc = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
        launcher = psutil.Process(proc.pid)
        while not launcher.children():
            time.sleep(0.01)
        (rank,) = launcher.children()
        if fixed:
            kill_job(proc)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        try:
            rank.wait(timeout=5 if fixed else 0.5)
            survived = False
        except psutil.TimeoutExpired:
            rank.kill()  # the old way's leftover
            survived = True
        assert survived != fixed
