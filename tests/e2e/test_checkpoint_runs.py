"""Checkpoints end to end: ``torchrun -m nodetrain.train`` imports, saves, is killed, resumes, exports.

Every launch is the real entry point (Hydra, gloo, CPU, fp32 compute) on a tiny corpus whose
training split holds 19 windows of 16 tokens; a step takes 4 of them, so a resume after step 3
starts mid-epoch and step 5 crosses into the second, reshuffled epoch.

* Import: sharded ``save_pretrained`` directories (Llama fp32 on 1 stage, tied Qwen3 bf16 on 2) as
  ``model.init_from``: the first loss equals ``transformers``' loss on the same batch (1e-5).
* ``Q``: Qwen3, tied embeddings, 4 layers, fp32 export, no dropout. Its uninterrupted 2-stage run
  is the reference for resuming on 2 → 4 and 4 → 1 stages (to 1e-6) and for a run killed with
  SIGKILL while writing a checkpoint and resumed with ``auto`` (bitwise).
* ``D``: Llama with attention dropout 0.1, bf16 export, validation every 3 steps. Run 6 steps;
  run 3 and stop; resume to 6: bitwise. Resuming with the ranks' RNG states swapped (restored
  from the wrong rank) must not match, so the comparison can fail.

Exports are checked with ``transformers`` itself: ``from_pretrained`` of a checkpoint directory.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import job_env, prepared_dir, torchrun_cmd
from safetensors.torch import load_file

from nodetrain.checkpoint import state as st
from nodetrain.checkpoint.resume import (
    check_training_state,
    choose_checkpoint,
    load_training_state,
    restore_steps,
)
from nodetrain.config.schema import ModelConfig, OptimConfig
from nodetrain.cost.memory import store_layout
from nodetrain.cost.shape import shape_of
from nodetrain.data import reader
from nodetrain.model import HFModel, build_hf_config
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.run.outputs import checkpoint_bytes
from nodetrain.store import HostStore, StoreLayout

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
WORDS = (
    "shall compare thee summer day thou art more lovely and temperate rough winds do shake the "
    "darling buds of may lease hath all too short a date"
).split()
COMMON = [
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "pipeline.microbatches=2",
    "train.dtype=float32",
    f"train.steps={STEPS}",
    "optim.warmup_steps=2",
    "logging.wandb=false",
    "data.vocab_size=300",
    "data.val_fraction=0.2",
    "logging.plots=false",  # a second of matplotlib per launch, and no test here reads them
]
Q = ["model=qwen3_tiny", "train.eval_every=0", "checkpoint.export_dtype=float32"]
D = [
    "model.hf.hidden_size=64",
    "model.hf.num_hidden_layers=2",
    "model.hf.num_attention_heads=4",
    "model.hf.num_key_value_heads=2",
    "model.hf.intermediate_size=128",
    "+model.hf.attention_dropout=0.1",
    "train.eval_every=3",
    "train.eval_batches=1",
]
RECORD_KEYS = ("loss", "lr", "grad_norm", "tokens")


@pytest.fixture(scope="module")
def work() -> Path:
    """Module scratch: the corpus, its prepared tokens, a private store directory in /dev/shm."""
    root = Path(tempfile.mkdtemp(prefix="nt-ckpt-"))
    rng = random.Random(0)
    (root / "corpus.txt").write_text(
        "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(22))
    )
    shm = Path(tempfile.mkdtemp(prefix="nt-ckpt-", dir="/dev/shm"))
    (root / "shm").symlink_to(shm)
    yield root
    left = sorted(p.name for p in shm.iterdir())
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    assert not left, f"host stores left in /dev/shm: {left}"


def _cmd(
    work: Path, nproc: int, run_dir: Path, overrides: list[str], corpus: Path | None = None, faults: str = ""
) -> tuple[list[str], dict]:
    """The launch of a run on the module's corpus, or on ``corpus`` (prepared beside it), with the
    test-only ``faults`` (``NODETRAIN_FAULTS``, nodetrain/run/inject.py)."""
    source = corpus or work / "corpus.txt"
    prepared = corpus.parent / "prepared" if corpus else work / "prepared"
    data = [f"data.source={source}", f"data.dir={prepared}", f"store.dir={work / 'shm'}"]
    cmd = torchrun_cmd(nproc, "-m", "nodetrain.train", f"hydra.run.dir={run_dir}")
    return cmd + COMMON + data + overrides, job_env(NODETRAIN_FAULTS=faults)


def train(
    work: Path, nproc: int, run_dir: Path, overrides: list[str], corpus: Path | None = None, faults: str = ""
) -> str:
    cmd, env = _cmd(work, nproc, run_dir, overrides, corpus, faults)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}"
    return out


def records(run_dir: Path) -> dict[int, dict]:
    """The last record of each step in metrics.jsonl (a resumed run appends to it)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec
    return out


def master(ckpt: Path) -> dict[str, torch.Tensor]:
    """fp32 master weights of a checkpoint, read with safetensors' own loader."""
    prefix = json.loads((ckpt / st.TRAINER_STATE).read_text())["weights"]["master"]
    out = {}
    for f in ckpt.glob(f"{prefix}-*.safetensors"):
        out.update(load_file(str(f)))
    return out


def optimizer(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in ckpt.glob("optimizer-*.safetensors"):
        out.update(load_file(str(f)))
    return out


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (weights, AdamW moments, step counts), from all its safetensors files."""
    out = {}
    for f in ckpt.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


LAUNCH_STATE = ("config", "config_hash", "run_dir", "save_timing_s", "metrics_rows", "files", "state_sha256")
"""The trainer-state keys that name the launch (its config and that config's hash, its run dir, save
timings, the metrics rows a resume restores, which carry the launch's placement counts) or hash its
files (whose tensors are compared one by one)."""


def resume_state(ckpt: Path) -> dict:
    """What a resume continues from in a checkpoint's trainer state: step, LR schedule, data cursor and
    dataset, every rank's RNG, stages, weight files, lineage (the parent by name: its digest covers
    the parent's config), without :data:`LAUNCH_STATE`."""
    state = {k: v for k, v in st.read_state(ckpt).items() if k not in LAUNCH_STATE}
    if state.get("parent"):
        state["parent"] = state["parent"]["name"]
    return state


def check_resume_across(work: Path, nproc: int, key: str, overrides: list[str]) -> dict[str, str]:
    """Family Q with ``overrides`` and ``key=true`` vs ``key=false`` (a setting that must not change a
    number), in three launches:

    * ``A``: ``key=false``, 6 steps uninterrupted, saving step 3 and step 6;
    * ``B``: A's step 3 resumed with ``key=true`` ends bit for bit where A ends (records of steps 4-6,
      master weights, AdamW moments): a checkpoint saved with false loads into true;
    * ``C``: ``key=true``, 6 steps uninterrupted, is A bit for bit: every record, and its step-3 and
      step-6 checkpoints (every tensor: master weights, moments, step counts; and the trainer state a
      resume reads, :func:`resume_state`): true trains and saves as false does.

    So C's step 3 resumed with false would be A's step 3 (the same bytes) resumed with false, A's own
    setting: a plain resume, which q_ref and its resumes check bit for bit (for
    ``stream.grad_on_device=false`` with every unit streamed, A is q_ref's placement). Returns each
    value's start-up output (A's, C's), for its placement lines."""
    a, b, c = (work / f"{key}_{name}" for name in ("a_false", "b_false_to_true", "c_true"))
    extra = ["checkpoint.every=3", "checkpoint.keep_last=0"]
    said = {"false": train(work, nproc, a, [*Q, *overrides, *extra, f"{key}=false"])}
    want, end = records(a), a / "checkpoints" / f"step-{STEPS}"
    train(
        work, nproc, b, [*Q, *overrides, f"{key}=true", f"checkpoint.resume={a / 'checkpoints' / 'step-3'}"]
    )
    _assert_same_steps(records(b), want, range(4, STEPS + 1))
    last = b / "checkpoints" / f"step-{STEPS}"
    _assert_same_tensors(master(last), master(end))
    _assert_same_tensors(optimizer(last), optimizer(end))
    said["true"] = train(work, nproc, c, [*Q, *overrides, *extra, f"{key}=true"])
    got = records(c)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), sorted(got)
    _assert_same_steps(got, want, range(1, STEPS + 1))
    for step in (3, STEPS):
        mine, theirs = c / "checkpoints" / f"step-{step}", a / "checkpoints" / f"step-{step}"
        _assert_same_tensors(tensors(mine), tensors(theirs))
        state, ref = resume_state(mine), resume_state(theirs)
        assert state == ref, (step, sorted(k for k in ref if state.get(k) != ref[k]))
    return said


@pytest.fixture(scope="module")
def q_ref(work: Path) -> Path:
    """Family Q, 2 stages, uninterrupted, saving step-3 and step-6."""
    run = work / "q_ref"
    train(work, 2, run, [*Q, "checkpoint.every=3", "checkpoint.keep_last=0"])
    return run


@pytest.fixture(scope="module")
def d_full(work: Path) -> Path:
    """Family D, 2 stages, uninterrupted, saving only step-6."""
    run = work / "d_full"
    train(work, 2, run, [*D, "checkpoint.every=0"])
    return run


# ----------------------------------------------------------------------------- import

SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
IMPORTS = [
    # id, model YAML, dtype of the saved shards, stages, every HF field the YAML sets (vocab: the tokenizer's)
    (
        "llama-fp32-1stage",
        "llama_10m",
        torch.float32,
        1,
        {
            **SHAPE,
            "num_hidden_layers": 2,
            "max_position_embeddings": 1024,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
        },
    ),
    (
        "qwen3-bf16-tied-2stages",
        "qwen3_tiny",
        torch.bfloat16,
        2,
        {
            **SHAPE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "initializer_range": 0.02,
        },
    ),
]


@pytest.mark.parametrize("case", IMPORTS, ids=lambda c: c[0])
def test_import_step0_loss_equals_transformers(work: Path, case, tmp_path: Path) -> None:
    """A sharded ``save_pretrained`` directory as ``model.init_from`` (and ``model.config_path``): the
    first step's loss is transformers' own loss for that model on the same batch."""
    _, yaml, dtype, stages, fields = case
    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    model = [
        f"model={yaml}",
        f"model.config_path={hf_dir}",
        f"model.init_from={hf_dir}",
        "data.tokenizer=bpe",
    ]
    model += [f"model.hf.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
    arch = {"llama_10m": "LlamaForCausalLM", "qwen3_tiny": "Qwen3ForCausalLM"}[yaml]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**fields, vocab_size=300)
    torch.manual_seed(5)
    getattr(transformers, arch)(config).to(dtype).save_pretrained(hf_dir, max_shard_size="100KB")
    assert len(list(hf_dir.glob("model-*.safetensors"))) > 2, "the import must read several shards"
    train(work, stages, run, [*model, "train.steps=1", "train.eval_every=0"])
    got = records(run)[1]["loss"]

    seed = st.read_state(run / "checkpoints" / "step-1")["config"]["seed"]
    x, y = reader.batch(
        reader.TokenDataset.open(prepared_dir(work / "prepared"), "train"), seed, 0, 4, 16
    )  # step 0's batch
    ref = getattr(transformers, arch).from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(input_ids=x).logits  # [4, 16, 300]
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert got == pytest.approx(want, rel=1e-5, abs=0)


# ----------------------------------------------------------------------------- exact resume


def _assert_same_steps(got: dict[int, dict], want: dict[int, dict], steps, rtol: float = 0.0) -> None:
    for s in steps:
        for k in RECORD_KEYS:
            if rtol == 0:
                assert got[s][k] == want[s][k], f"step {s} {k}: {got[s][k]!r} != {want[s][k]!r}"
            else:
                assert got[s][k] == pytest.approx(want[s][k], rel=rtol, abs=0), f"step {s} {k}"


def _assert_same_tensors(got: dict, want: dict, atol: float = 0.0, rtol: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        if atol == 0 and rtol == 0:
            assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k] - want[k]).abs().max():.3e}"
        else:
            torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def test_resume_mid_epoch_with_dropout_is_bitwise(work: Path, d_full: Path) -> None:
    full, part = d_full, work / "d_part"
    train(work, 2, part, [*D, "checkpoint.stop_after_steps=3"])
    meta = json.loads((prepared_dir(work / "prepared") / "meta.json").read_text())
    windows = (meta["num_train_tokens"] - 1) // 16
    assert 3 * 4 < windows < STEPS * 4, f"{windows} windows: the resume must start mid-epoch and cross one"
    stopped = records(part)
    assert sorted(stopped) == [1, 2, 3] and [
        c.name for _, c in st.complete_checkpoints(part / "checkpoints")
    ] == ["step-3"]
    saved = json.loads((part / "checkpoints" / "step-3" / st.TRAINER_STATE).read_text())
    assert saved["step"] == 3 and saved["data"]["next_batch_index"] == 3 and len(saved["rng"]) == 2
    assert saved["rng"][0]["torch_cpu"] != saved["rng"][1]["torch_cpu"], "the ranks' RNG streams are distinct"
    want = records(full)
    assert saved["lr_schedule"]["next_lr"] == want[4]["lr"]

    out = train(work, 2, part, [*D, "checkpoint.resume=auto"])
    assert "resuming from" in out and "step-3" in out
    got = records(part)
    _assert_same_steps(got, want, range(4, STEPS + 1))
    assert got[6]["val_loss"] == want[6]["val_loss"]
    assert "val_loss" in got[3] and got[3]["val_loss"] == want[3]["val_loss"]
    end_full, end_part = full / "checkpoints" / "step-6", part / "checkpoints" / "step-6"
    _assert_same_tensors(master(end_part), master(end_full))
    _assert_same_tensors(optimizer(end_part), optimizer(end_full))

    # Restored from the wrong rank (swapped states), the dropout masks — and the loss — differ.
    wrong = work / "d_wrong"
    shutil.copytree(part / "checkpoints" / "step-3", wrong / "step-3")
    state = json.loads((wrong / "step-3" / st.TRAINER_STATE).read_text())
    state["rng"] = state["rng"][::-1]
    st.write_state(wrong / "step-3" / st.TRAINER_STATE, state)  # resealed: an edit alone is refused
    train(work, 2, wrong, [*D, f"checkpoint.resume={wrong / 'step-3'}", "checkpoint.stop_after_steps=1"])
    assert records(wrong)[4]["loss"] != want[4]["loss"], "the RNG restore is not what makes the run exact"


def test_resume_on_other_stage_counts(work: Path, q_ref: Path) -> None:
    want = records(q_ref)
    four = work / "q_four"
    args = [*Q, "checkpoint.every=1", "checkpoint.keep_last=0"]
    out = train(work, 4, four, [*args, f"checkpoint.resume={q_ref / 'checkpoints' / 'step-3'}"])
    assert "written on 2 stages" in out
    state = json.loads((four / "checkpoints" / "step-4" / st.TRAINER_STATE).read_text())
    assert len(state["stages"]) == 4 and state["step"] == 4
    one = work / "q_one"
    train(work, 1, one, [*args, f"checkpoint.resume={four / 'checkpoints' / 'step-4'}"])
    _assert_same_steps(records(four), want, range(4, STEPS + 1), rtol=1e-6)
    _assert_same_steps(records(one), want, range(5, STEPS + 1), rtol=1e-6)
    ref_end = master(q_ref / "checkpoints" / "step-6")
    for run in (four, one):
        _assert_same_tensors(master(run / "checkpoints" / "step-6"), ref_end, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- crash safety


def _kill9(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank at once. torchrun starts each rank in a session of its own,
    so killing torchrun's process group would leave the ranks running (and finishing the save)."""
    job = [psutil.Process(proc.pid)]
    job += job[0].children(recursive=True)
    for p in job:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(job[1:], timeout=30)


def test_kill_during_save_keeps_the_previous_checkpoint_and_auto_resumes(work: Path, q_ref: Path) -> None:
    run = work / "q_crash"
    ckpts = run / "checkpoints"
    cmd, env = _cmd(
        work,
        2,
        run,
        [*Q, "checkpoint.every=2", "checkpoint.keep_last=2"],
        faults="write_delay_s=0.5",
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while not (
            (ckpts / "step-2" / st.TRAINER_STATE).is_file() and list((ckpts / "step-4.tmp").glob("*"))
        ):
            assert proc.poll() is None, proc.stdout.read().decode()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint write to interrupt"
            time.sleep(0.05)
    finally:
        _kill9(proc)
    assert not (ckpts / "step-4").exists() and (ckpts / "step-4.tmp").is_dir()
    assert st.verify(ckpts / "step-2")["step"] == 2  # every file's size and sha256 as written

    out = train(work, 2, run, [*Q, "checkpoint.every=2", "checkpoint.keep_last=2", "checkpoint.resume=auto"])
    assert "step-4.tmp, an interrupted checkpoint save" in out and "resuming from" in out
    want, got = records(q_ref), records(run)
    _assert_same_steps(got, want, range(3, STEPS + 1))
    _assert_same_tensors(master(ckpts / "step-6"), master(q_ref / "checkpoints" / "step-6"))
    assert [c.name for _, c in st.complete_checkpoints(ckpts)] == ["step-4", "step-6"], "keep_last=2"
    assert not list(ckpts.glob("*.tmp"))


def test_sigterm_saves_the_step_every_rank_stopped_after_and_resume_is_exact(work: Path, q_ref: Path) -> None:
    """SIGTERM to torchrun (a scheduler's pre-emption) once step 2 is logged, i.e. during step 3:
    torchrun forwards it to both ranks, which agree (in the step's all-reduce) on the step to stop
    after, save it (``checkpoint.on_signal=save``) and exit; ``auto`` resumes exactly (bitwise).

    The relaunch is the README's: ``checkpoint.resume=auto`` with no ``hydra.run.dir``: the new
    launch finds the stopped run (same config hash) under the runs root, continues it bitwise as
    ``q_ref`` ran uninterrupted, and writes its checkpoints there. Logged to wandb (offline): the
    wandb run id goes into trainer_state.json and the resumed launch logs into that same wandb run (a
    second offline segment of it, not a new run)."""
    runs = work / "runs_signal"
    args = [
        *COMMON,
        *Q,
        "checkpoint.every=0",
        "checkpoint.on_signal=save",
        f"data.source={work / 'corpus.txt'}",
    ]
    args += [f"data.dir={work / 'prepared'}", f"store.dir={work / 'shm'}", "logging.wandb=true"]
    env = job_env(NODETRAIN_RUNS=str(runs), WANDB_MODE="offline")
    cmd = torchrun_cmd(2, "-m", "nodetrain.train", *args)
    proc = subprocess.Popen(  # ~1 s steps, same arithmetic
        cmd,
        cwd=ROOT,
        env={**env, "NODETRAIN_FAULTS": "copy_delay_s=0.05"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not any(2 in records(m.parent) for m in runs.glob("*/metrics.jsonl")):
            assert proc.poll() is None, proc.stdout.read().decode()[-4000:]
            assert time.monotonic() < deadline, "step 2 never completed"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            _kill9(proc)
    assert proc.returncode != 0, "a stopped run must not look finished"
    (run,) = list(runs.iterdir())
    done = records(run)
    last = max(done)
    assert last in (3, 4) and done[last].get("stopped") is True, out[-4000:]
    for r in (0, 1):  # every rank stopped after the same step
        assert f"every rank stops after step {last}" in (run / f"rank{r}.log").read_text()
    ckpts = run / "checkpoints"
    assert [c.name for _, c in st.complete_checkpoints(ckpts)] == [f"step-{last}"]
    assert st.verify(ckpts / f"step-{last}")["step"] == last

    proc = subprocess.run(
        torchrun_cmd(2, "-m", "nodetrain.train", *args, "checkpoint.resume=auto"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"step-{last}" in out
    first, second = sorted(runs.iterdir())  # run ids start with the launch time
    assert first == run and "continuing run" in (second / "rank0.log").read_text()
    got = records(second)  # the first run's rows of steps 1-last, then this launch's
    assert sorted(got) == [1, 2, 3, 4, 5, 6], sorted(got)  # resumed at step last, not started over
    _assert_same_steps(got, records(q_ref), range(1, STEPS + 1))
    assert [p.name for _, p in st.complete_checkpoints(ckpts)] == [f"step-{last}", "step-6"]
    end, ref_end = ckpts / "step-6", q_ref / "checkpoints" / "step-6"
    _assert_same_tensors(master(end), master(ref_end))
    _assert_same_tensors(optimizer(end), optimizer(ref_end))

    (segment,) = list((first / "wandb").glob("offline-run-*"))
    run_id = segment.name.rsplit("-", 1)[1]
    ids = [p.name.rsplit("-", 1)[1] for p in (second / "wandb").glob("offline-run-*")]
    assert ids == [run_id], (run_id, ids)
    for step in (last, 6):
        assert json.loads((ckpts / f"step-{step}" / st.TRAINER_STATE).read_text())["wandb_run_id"] == run_id


@pytest.mark.parametrize("family", ["q_ref", "d_full"])
def test_checkpoint_size_estimate_matches_the_files_written(family: str, request) -> None:
    """The free-space check before the store (outputs.checkpoint_bytes) predicts what a save writes:
    the tensor files' bytes on disk, less only their safetensors headers (fp32 export: no master files;
    bf16: with them)."""
    ckpt = st.complete_checkpoints(request.getfixturevalue(family) / "checkpoints")[-1][1]
    export = json.loads((ckpt / st.TRAINER_STATE).read_text())["export_dtype"]
    model = HFModel(transformers.AutoConfig.from_pretrained(ckpt))
    files = list(ckpt.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    estimate = checkpoint_bytes(model, export)
    assert 0 <= on_disk - estimate <= 4096 * len(files), (on_disk, estimate, len(files))


def test_truncated_file_refused_and_auto_falls_back(work: Path, q_ref: Path, tmp_path: Path, caplog) -> None:
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(q_ref / "checkpoints", ckpts)
    victim = sorted((ckpts / "step-6").glob("model-*.safetensors"))[1]
    os.truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(st.CheckpointError, match=victim.name):
        choose_checkpoint(str(ckpts / "step-6"), ckpts)
    assert choose_checkpoint("auto", ckpts) == ckpts / "step-3"
    assert victim.name in caplog.text and "falling back" in caplog.text


def test_checkpoint_of_another_model_is_refused_listing_the_tensors(q_ref: Path) -> None:
    ckpt = q_ref / "checkpoints" / "step-6"
    state = st.read_state(ckpt)
    hf = {
        **state["config"]["model"]["hf"],
        "vocab_size": 300,
        "intermediate_size": 96,
        "num_hidden_layers": 5,
    }
    other = HFModel(build_hf_config(ModelConfig(name="q", arch=state["config"]["model"]["arch"], hf=hf)))
    with pytest.raises(st.CheckpointError) as info:
        check_training_state(ckpt, state, other.units)
    message = str(info.value)
    assert "model.layers.0.mlp.up_proj.weight: shape (128, 64)" in message
    assert "model.layers.0.mlp.up_proj.weight.exp_avg_sq: shape (128, 64)" in message
    assert "missing tensor model.layers.4.self_attn.q_proj.weight" in message
    assert "missing tensor model.layers.4.mlp.down_proj.weight.step" in message


# ----------------------------------------------------------------------------- export


def _trainer_logits(model: HFModel, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """nodetrain's own forward (the templates and bindings every stage runs) over all blocks."""
    x, ctx = ids, None
    for u in model.units:
        params = {p.local_name: weights[p.hf_name] for p in u.params}
        if u.name == "head" and model.tied:
            params["lm_head.weight"] = weights["model.embed_tokens.weight"]
        if u.index == 1:
            ctx = model.context(x)
        x = model.forward_block(u.index, params, x, ctx)
    return x  # [B, T, V]


def _load(ckpt: Path, dtype):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=dtype, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
        info
    )
    return model


def test_fp32_tied_export_loads_in_transformers_with_the_trainers_logits(q_ref: Path) -> None:
    ckpt = q_ref / "checkpoints" / "step-6"
    hf = _load(ckpt, torch.float32)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight, "tied embeddings must load tied"
    weights = master(ckpt)
    assert "lm_head.weight" not in weights
    cfg = json.loads((ckpt / st.TRAINER_STATE).read_text())["config"]["model"]
    ours = HFModel(
        build_hf_config(
            ModelConfig(name="q", arch=cfg["arch"], hf={**cfg["hf"], "vocab_size": hf.config.vocab_size})
        )
    )
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _trainer_logits(ours, weights, ids)
        got = hf.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_export_holds_the_rounded_master_weights(d_full: Path) -> None:
    ckpt = d_full / "checkpoints" / "step-6"
    hf = _load(ckpt, None)
    assert hf.dtype == torch.bfloat16 and hf.lm_head.weight is not hf.model.embed_tokens.weight
    state = {k: v for k, v in hf.state_dict().items()}
    weights = master(ckpt)
    assert sorted(state) == sorted(weights)
    for k, v in weights.items():
        assert torch.equal(state[k], v.to(torch.bfloat16)), k


# ----------------------------------------------------------------------------- no pickle


def test_resume_load_path_never_unpickles(q_ref: Path, monkeypatch, tmp_path: Path) -> None:
    ckpt = q_ref / "checkpoints" / "step-6"

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the checkpoint load path")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    state = st.verify(ckpt)
    cfg = state["config"]["model"]
    want = master(ckpt)
    vocab = want["model.embed_tokens.weight"].shape[0]
    model = HFModel(
        build_hf_config(ModelConfig(name="q", arch=cfg["arch"], hf={**cfg["hf"], "vocab_size": vocab}))
    )
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="nt-ckpt-np-"))
    store = HostStore.create(
        StoreLayout(tuple(u.numel for u in model.units), torch.float32, (0,)), shm, "nopickle"
    )
    store.unlink()
    shutil.rmtree(shm)
    load_training_state(ckpt, state, store, model.units)
    opt = StoreAdamW(store, model.units, OptimConfig())
    restore_steps(ckpt, opt, model.units)
    assert set(opt.steps_by_name().values()) == {float(STEPS)}
    moments = optimizer(ckpt)
    for u in model.units:
        for p in u.params:
            sl = slice(p.offset, p.offset + p.numel)
            assert torch.equal(store.master(u.index)[sl].view(p.shape), want[p.hf_name])
            assert torch.equal(
                store.buffer(u.index, "exp_avg_sq")[sl].view(p.shape), moments[p.hf_name + ".exp_avg_sq"]
            )


# ----------------------------------------------------------------------------- issue 25


def _vocabulary(ckpt: Path) -> str:
    from tokenizers import Tokenizer

    from nodetrain.data.tokenizer import vocabulary_sha256

    return vocabulary_sha256(Tokenizer.from_file(str(ckpt / "tokenizer.json")))


def test_resume_after_the_corpus_changed_keeps_the_checkpoints_tokenizer(
    work: Path, q_ref: Path, tmp_path: Path
) -> None:
    """The trained BPE and a data.source whose contents changed since the checkpoint: the resumed
    run says what changed and tokenizes the new text with the checkpoint's tokenizer, so every id
    keeps its meaning (it used to train a new BPE and ship it in the next checkpoint). q_ref's step-3,
    resumed on one stage (the tokenizer is no stage's business) from a copy of its corpus with new
    text appended: the check compares the corpus' sha256, wherever the file is."""
    corpus = tmp_path / "data" / "corpus.txt"
    corpus.parent.mkdir()
    shutil.copyfile(work / "corpus.txt", corpus)
    with corpus.open("a") as f:  # new text: a BPE trained now would merge other pairs
        f.write("\n" + "\n".join(" ".join(w[::-1] for w in WORDS[i : i + 8]) for i in range(0, 24, 2)) * 3)
    run = tmp_path / "run"
    out = train(work, 1, run, [*Q, f"checkpoint.resume={q_ref / 'checkpoints' / 'step-3'}"], corpus)
    assert "the contents of data.source=" in out and "changed" in out and "own tokenizer" in out, out[-3000:]
    assert "training a byte-level BPE" not in out
    want = _vocabulary(q_ref / "checkpoints" / "step-3")
    assert _vocabulary(run / "checkpoints" / f"step-{STEPS}") == want
    # the checkpoint's dataset and the one of the new text
    fresh = [
        prepared_dir(work / "prepared"),
        *(m.parent for m in (corpus.parent / "prepared").glob("*/meta.json")),
    ]
    assert len(fresh) == 2 and all(
        json.loads((d / "meta.json").read_text())["vocabulary_sha256"] == want for d in fresh
    )


def test_import_of_a_damaged_checkpoint_is_refused_naming_the_file(
    work: Path, q_ref: Path, tmp_path: Path
) -> None:
    """model.init_from of a checkpoint carrying a manifest checks what it reads against it."""
    src = tmp_path / "step-6"
    shutil.copytree(q_ref / "checkpoints" / "step-6", src)
    victim = sorted(src.glob("model-*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40  # one weight changes, the file stays loadable
    victim.write_bytes(data)
    cmd, env = _cmd(work, 2, tmp_path / "run", [*Q, f"model.init_from={src}", "train.steps=1"])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(f"model.init_from={src}: {victim}: sha256") == 1, out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resuming_an_older_step_keeps_its_chain_and_auto_continues_it(
    work: Path, q_ref: Path, tmp_path: Path
) -> None:
    """q_ref saved step-3 and step-6. Resume step-3 and save step-4 with keep_last=2: the branch point
    stays (step-6, of the abandoned branch, is not counted), and auto then continues step-4 — exactly
    as q_ref ran — not step-6 (keep_last used to delete step-3 and auto to pick step-6)."""
    ckpts = tmp_path / "ckpts"
    shutil.copytree(q_ref / "checkpoints", ckpts)
    run = tmp_path / "run"
    args = [*Q, f"checkpoint.dir={ckpts}", "checkpoint.every=1", "checkpoint.keep_last=2"]
    out = train(
        work, 2, run, [*args, f"checkpoint.resume={ckpts / 'step-3'}", "checkpoint.stop_after_steps=1"]
    )
    assert "starts a new branch from step-3" in out
    assert [p.name for _, p in st.complete_checkpoints(ckpts)] == ["step-3", "step-4", "step-6"]
    assert choose_checkpoint("auto", ckpts) == ckpts / "step-4"
    train(work, 2, run, [*args, "checkpoint.resume=auto", "checkpoint.stop_after_steps=1"])
    _assert_same_steps(records(run), records(q_ref), [4, 5])
    assert [p.name for _, p in st.complete_checkpoints(ckpts)] == ["step-4", "step-5", "step-6"]
    assert st.read_state(ckpts / "step-5")["parent"]["name"] == "step-4"


def test_resume_onto_the_tier_and_back_to_ram_on_another_stage_count(work: Path, q_ref: Path) -> None:
    """q_ref's step-3 (RAM) resumed onto the NVMe tier (store.tier=nvme, on disk, with host RAM allowed
    less than the whole store): steps and step-6 state equal q_ref bit for bit; its step-4 (written
    through the tier) resumed on 1 stage in RAM matches q_ref as the other stage counts do."""
    tier_dir = work / "tier"
    tier_dir.mkdir(exist_ok=True)
    model = HFModel(transformers.AutoConfig.from_pretrained(q_ref / "checkpoints" / "step-3"))
    allowed = store_layout(shape_of(model), torch.float32).nbytes - 1  # as plan/host.py's fit check
    tiered = work / "q_tier"
    args = [*Q, "checkpoint.every=1", "checkpoint.keep_last=0", "plan.rank_overhead_gb=0"]
    tier = ["store.tier=nvme", f"store.tier_dir={tier_dir}", "store.tier_buffers=2"]
    resume = f"checkpoint.resume={q_ref / 'checkpoints' / 'step-3'}"
    out = train(work, 2, tiered, [*args, *tier, resume], faults=f"host_available_bytes={allowed}")
    assert "resuming from" in out and not list(tier_dir.iterdir())
    want = records(q_ref)
    _assert_same_steps(records(tiered), want, range(4, STEPS + 1))
    end, ref_end = tiered / "checkpoints" / "step-6", q_ref / "checkpoints" / "step-6"
    _assert_same_tensors(master(end), master(ref_end))
    _assert_same_tensors(optimizer(end), optimizer(ref_end))
    one = work / "q_tier_one"
    train(work, 1, one, [*args, f"checkpoint.resume={tiered / 'checkpoints' / 'step-4'}"])
    _assert_same_steps(records(one), want, range(5, STEPS + 1), rtol=1e-6)
    _assert_same_tensors(master(one / "checkpoints" / "step-6"), master(ref_end), atol=1e-6, rtol=1e-6)
