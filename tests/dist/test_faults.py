"""Faults and bad input (DESIGN invariants 1 and 7): no hang, no leaked store, no NaN in the weights.

Cheapest first: the stop/bad-step bookkeeping and P2P's handle pruning (pure, milliseconds); bad data
refused by the start-up chain train.py runs before the store exists (in-process, one table); then the
real entry point under torchrun (gloo, CPU): a rank raising with 4 ranks, a hang bounded by
``dist.timeout_s``, ``kill -9`` of a rank, and a NaN gradient skipped on every stage, checked against
plain transformers + AdamW, under four placements (four jobs of one ``--multirun`` launch, which
also cleans a stale store (what kill -9 leaks) and spares a live one).
The 2-rank failure is tests/e2e/test_sweeps.py's failing sweep; SIGTERM with a checkpoint is in
tests/e2e/test_checkpoint_runs.py (it reuses that file's uninterrupted reference run).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import ROOT, SONNET, TINY_RUN, job_env, prepared_dir, shm_store_dir, start_job, torchrun_cmd
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_parity import ATOL_WEIGHT, OPTIM, RTOL, lr_schedule

from nodetrain.checkpoint import state as st
from nodetrain.config.schema import Config, ConfigError, DataConfig, ModelConfig
from nodetrain.data import datasets as data
from nodetrain.data import reader
from nodetrain.data.checks import check_vocab, open_splits
from nodetrain.engine.comm.comm import Comm
from nodetrain.engine.comm.p2p import P2P
from nodetrain.model import build_hf_config
from nodetrain.run import inject
from nodetrain.run.faults import BadSteps, NonFiniteError, StopRequest
from nodetrain.run.inject import ENV, NO_FAULTS, Faults, poison_grads

TINY = [
    *TINY_RUN,
    "train.eval_every=0",
    "logging.plots=false",
]


def _launch(nproc: int, overrides: list[str], tmp: Path, faults: str = "") -> subprocess.Popen:
    cmd = torchrun_cmd(nproc, "-m", "nodetrain.train", *overrides)
    return start_job(cmd, job_env(NODETRAIN_RUNS=str(tmp / "runs"), NODETRAIN_FAULTS=faults))


def _finish(proc: subprocess.Popen, timeout_s: float = 240) -> tuple[int, str, float]:
    """(exit code, output, time.time() at exit); kills the whole job after ``timeout_s``."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_job(proc)
        out, _ = proc.communicate()
        pytest.fail(f"the job hung past {timeout_s}s:\n{out[-6000:]}")
    return proc.returncode, out, time.time()


def _kill_job(proc: subprocess.Popen) -> None:
    job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in job:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _log_time(line: str) -> float:
    """Seconds since the epoch of a Hydra log line ``[2026-01-01 12:00:00,123][...] ...``."""
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _run_files_in_shm(run_id: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if run_id in p.name]


# ----------------------------------------------------------------------------- pure bookkeeping


def test_stop_request_turns_signals_into_one_flag_and_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop, stop.deferred():  # the training loop's mode: a flag, not an exit
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread before the next bytecode
        os.kill(os.getpid(), signal.SIGINT)  # the same request again (terminal + torchrun): no exit
        assert stop.signum == signal.SIGTERM
        stop._first_s -= 10  # a signal long after the first one means "now"
        with pytest.raises(SystemExit) as info:
            os.kill(os.getpid(), signal.SIGINT)
        assert info.value.code == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is before


def test_bad_steps_stop_after_max_in_a_row() -> None:
    bad = BadSteps(max_in_a_row=2)
    for step, skipped in enumerate([True, False, True], start=1):
        bad.count(skipped)
        bad.check(step)
    bad.count(True)
    with pytest.raises(NonFiniteError, match=r"train\.max_bad_steps=2: steps 3-4 .*after step 2"):
        bad.check(4)
    assert bad.total == 3


def test_fault_knobs_fire_only_on_their_rank_and_step() -> None:
    faults = Faults(fail_rank=1, fail_step=2, nan_rank=0, nan_step=3)
    faults.maybe_fail(0, 2)
    faults.maybe_fail(1, 3)
    with pytest.raises(RuntimeError, match=r"fail_rank=1, fail_step=2: injected failure"):
        faults.maybe_fail(1, 2)
    grads = [torch.zeros(3), torch.zeros(2)]
    poison_grads(faults, 0, 2, grads)
    poison_grads(faults, 1, 3, grads)
    assert all(torch.isfinite(g).all() for g in grads)
    poison_grads(faults, 0, 3, grads)
    assert torch.isfinite(grads[0]).all() and math.isnan(grads[1][0])


def test_faults_come_from_one_environment_variable_read_as_key_values_or_json() -> None:
    """Test knobs are no config keys: ``NODETRAIN_FAULTS`` sets them (run/inject.py); unset = none."""
    assert Faults.from_env(environ={}) is NO_FAULTS
    assert Faults.from_env(environ={ENV: " "}) is NO_FAULTS
    kv = Faults.from_env(2, {ENV: "fail_rank=1, fail_step=2,fail_mode=hang,copy_delay_s=0.5"})
    assert kv == Faults(fail_rank=1, fail_step=2, fail_mode="hang", copy_delay_s=0.5)
    assert Faults.from_env(environ={ENV: '{"nan_rank": 0, "nan_step": 3}'}) == Faults(nan_rank=0, nan_step=3)


def test_bad_faults_are_refused_at_once_naming_each_key_value_and_fix() -> None:
    text = "fail_rank=2,nan_step=0,fail_mode=crash,copy_delay_s=-1,optim_delay_s=slow,nan_rnak=1,oops"
    with pytest.raises(ConfigError) as info:
        Faults.from_env(2, {ENV: text})
    message = str(info.value)
    assert message.startswith(f"{ENV}='{text}' (test-only fault injection): 9 problem(s):"), message
    for line in (
        "fail_rank=2: not a rank of 2; use -1 (off)",
        "nan_step=0: must be -1 (off) or a 1-based step; use -1",
        "fail_mode=crash: not one of raise, hang; pick one",
        "copy_delay_s=-1.0: must be a finite number >= 0; use 0",
        "optim_delay_s=slow: not a number; give a number",
        "nan_rnak=1: unknown key; use one of copy_delay_s,",
        "oops: not key=value",
        "fail_rank=2 without fail_step: the fault never fires",
        "nan_step=0 without nan_rank: the fault never fires",
    ):
        assert f"  - {line}" in message, message
    with pytest.raises(ConfigError, match="not a JSON object"):
        Faults.from_env(environ={ENV: "{fail_rank: 1}"})
    with pytest.raises(ConfigError, match=r"fail_step=2\.5: not an integer"):
        Faults.from_env(environ={ENV: '{"fail_step": 2.5}'})


def test_nan_injection_is_no_hook_when_off_and_poisons_the_last_unit_at_its_step(monkeypatch) -> None:
    """The engine's one NaN hook: None when ``nan_*`` is off (the optimizer thread calls nothing);
    on, it poisons only the stage's last unit, only at ``nan_step`` (1-based; the hook's step 0-based)."""
    assert Faults().nan_hook(None, 7) is None

    class Store:
        def __init__(self) -> None:
            self.grads = {6: torch.zeros(4), 7: torch.zeros(4)}

        def grad(self, unit: int) -> torch.Tensor:
            return self.grads[unit]

    monkeypatch.setattr(inject.dist, "get_rank", lambda: 0)
    store = Store()
    poison = Faults(nan_rank=0, nan_step=2).nan_hook(store, 7)
    poison(0, 6, 7)  # step 1: not yet
    poison(1, 6)  # step 2, but the last unit is not among these
    assert all(torch.isfinite(g).all() for g in store.grads.values())
    poison(1, 7)
    assert math.isnan(store.grads[7][0]) and torch.isfinite(store.grads[6]).all()


class _Work:
    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited = True
        return True


def test_p2p_drops_completed_sends_as_it_goes() -> None:
    """A completed send's handle (and the activation it holds) is let go at the next group; a held
    send to a peer is waited and let go once a receive from that peer completed."""
    gloo = types.SimpleNamespace(get_backend=lambda group=None: "gloo")
    p2p = P2P(0, 3, (1, 2, 4), torch.float32, Comm(torch.device("cpu"), dist=gloo))
    pending, done, other = _Work(False), _Work(True), _Work(False)
    p2p._keep(1, [pending])
    p2p._keep(1, [done])
    assert p2p._sends == [(1, [pending]), (1, [done])]
    p2p._keep(2, [other])
    assert (1, [done]) not in p2p._sends and (1, [pending]) in p2p._sends and done.waited, (
        "a failed send must raise"
    )
    p2p._release({1})
    assert p2p._sends == [(2, [other])] and pending.waited and not other.waited


# ----------------------------------------------------------------------------- bad data, in-process


def _start_up(cfg: Config) -> None:
    """What train.run does with the data before the host store exists (rank 0's prepare included)."""
    data_dir = data.prepare(cfg.data, cfg.seed)
    train_ds, _ = open_splits(data_dir, cfg)
    check_vocab(build_hf_config(cfg.model, vocab_size=train_ds.vocab_size).vocab_size, train_ds)


def _truncate(d: Path) -> None:
    os.truncate(d / "train.bin", (d / "train.bin").stat().st_size - 3)


def _corrupt(d: Path) -> None:
    tokens = np.memmap(d / "train.bin", dtype=np.uint16, mode="r+")
    tokens[5] = 60000  # an id far beyond the 300-id vocabulary


# (id, text written to the source, change to the prepared dir, config changes, what the message names)
BAD_DATA = [
    ("missing source file", None, None, {}, r"data\.source='.*missing\.txt' matches no"),
    ("empty source file", "", None, {}, r"data\.source=.*holds no text"),
    ("truncated train.bin", SONNET * 20, _truncate, {}, r"train\.bin holds \d+ bytes .* truncated"),
    ("corrupt train.bin", SONNET * 20, _corrupt, {}, r"train\.bin holds token id 60000 >= vocab_size 300"),
    (
        "ids beyond the model vocab",
        SONNET * 20,
        None,
        {"model.hf.vocab_size": 280},
        r"model\.hf\.vocab_size=280 is smaller than the vocabulary of .*tokenizer\.json \(300 ids",
    ),
    (
        "train split shorter than a batch",
        SONNET * 2,
        None,
        {"train.grad_accum": 8},
        r"train\.bin holds \d+ tokens = \d+ window\(s\).* fewer than the 32 sequences of one optimizer step",
    ),
    (
        "val split shorter than an eval batch",
        SONNET * 3,
        None,
        {"train.eval_every": 1, "data.val_fraction": 0.01},
        r"val\.bin holds \d+ tokens .* fewer than the 4 sequences of one evaluation batch",
    ),
    (
        "no tokenizer.json in data.tokenizer",
        SONNET,
        None,
        {"data.tokenizer": "{tmp}"},
        r"data\.tokenizer=.* holds no tokenizer\.json",
    ),
]


@pytest.mark.parametrize("case", BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_bad_data_is_refused_at_start_up(case, tmp_path: Path) -> None:
    _, text, damage, changes, message = case
    source = tmp_path / ("missing.txt" if text is None else "corpus.txt")
    if text is not None:
        source.write_text(text)
    cfg = Config(data=DataConfig(source=str(source), dir=str(tmp_path / "prepared"), vocab_size=300))
    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    cfg.model = ModelConfig(name="tiny", hf=hf)
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.pipeline.microbatches = 16, 2, 2
    cfg.train.eval_every = 0
    for key, value in changes.items():
        section, leaf = key.split(".", 1)
        if section == "model":
            cfg.model.hf["vocab_size"] = value
        else:
            setattr(
                getattr(cfg, section), leaf, value.format(tmp=tmp_path) if isinstance(value, str) else value
            )
    if damage is not None:
        damage(data.prepare(cfg.data))
    t0 = time.perf_counter()
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        _start_up(cfg)
    assert re.search(message, str(info.value)), str(info.value)
    assert "fix" in str(info.value), "the message must say how to fix it"
    assert time.perf_counter() - t0 < 30


# ----------------------------------------------------------------------------- under torchrun


def test_raise_on_rank_1_of_4_ends_every_rank_with_its_traceback(
    tmp_path: Path, corpus, shm_dir: Path
) -> None:
    overrides = [*TINY, *corpus, "model.hf.num_hidden_layers=4", "train.steps=50", f"store.dir={shm_dir}"]
    rc, out, exited = _finish(_launch(4, overrides, tmp_path, "fail_rank=1,fail_step=2"))
    assert rc != 0
    (run,) = (tmp_path / "runs").iterdir()
    failed = [ln for ln in (run / "rank1.log").read_text().splitlines() if "job failed" in ln]
    assert failed, "rank 1 did not log its failure"
    assert exited - _log_time(failed[0]) < 60, f"the job ended {exited - _log_time(failed[0]):.0f}s after"
    assert "fail_rank=1, fail_step=2: injected failure" in out
    root = out[out.index("Root Cause (first observed failure)") :]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root) and "maybe_fail" in root, root[:3000]
    for r in range(4):
        assert "stage" in (run / f"rank{r}.log").read_text(), f"rank {r} never started"
    assert not _run_files_in_shm(run.name)  # shm_dir (the store's directory) is checked by its fixture


def test_a_hang_ends_at_dist_timeout(tmp_path: Path, corpus, shm_dir: Path) -> None:
    """Rank 1 enters a barrier no other rank joins while rank 0 waits for its activation gradient:
    both waits fail after dist.timeout_s=5 instead of torch's default 30 minutes."""
    overrides = [*TINY, *corpus, "train.steps=50", f"store.dir={shm_dir}", "dist.timeout_s=5"]
    rc, out, exited = _finish(_launch(2, overrides, tmp_path, "fail_rank=1,fail_step=2,fail_mode=hang"))
    assert rc != 0
    assert out.count("Timed out waiting 5000ms") >= 2, out[-4000:]  # each rank's own error
    (run,) = (tmp_path / "runs").iterdir()
    hung = [ln for ln in (run / "rank1.log").read_text().splitlines() if "enters a barrier" in ln]
    assert exited - _log_time(hung[0]) < 60


_STORE_MAKER = """
import os, sys, time, torch
from nodetrain.store import HostStore, StoreLayout
store = HostStore.create(StoreLayout((250_000,), torch.float32), sys.argv[1], sys.argv[2])
store.master(0).fill_(7.0)
print(store.path, flush=True)
time.sleep(600)
"""


def _store_maker(shm_dir: Path, run_id: str) -> tuple[subprocess.Popen, Path]:
    """A process that created a host store (by the real code path) and holds it, not yet unlinked."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _STORE_MAKER, str(shm_dir), run_id],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    return proc, Path(proc.stdout.readline().strip())


def test_kill9_of_a_rank_leaves_no_store(tmp_path: Path, corpus, shm_dir: Path) -> None:
    """kill -9 of rank 1 mid-run: the job fails and its store is gone (unlinked once mapped). What
    kill -9 can leak, and the next run cleans, is checked on the NaN run below (:func:`_leaked_stores`)."""
    overrides = [*TINY, *corpus, f"store.dir={shm_dir}"]
    first = _launch(2, [*overrides, "train.steps=500"], tmp_path / "a")
    try:
        deadline = time.monotonic() + 180
        while (
            not list((tmp_path / "a" / "runs").glob("*/metrics.jsonl"))
            or len(next((tmp_path / "a" / "runs").glob("*/metrics.jsonl")).read_text().splitlines()) < 2
        ):
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not reach step 2"
            time.sleep(0.1)
        (rank1,) = [p for p in psutil.Process(first.pid).children() if p.environ().get("RANK") == "1"]
        rank1.kill()  # kill -9 mid-run
        rc, out, _ = _finish(first, timeout_s=90)
    finally:
        if first.poll() is None:
            _kill_job(first)
    assert rc != 0 and "exitcode  : -9" in out
    assert not list(shm_dir.iterdir()), "the killed run left its store (it is unlinked once mapped)"


@contextlib.contextmanager
def _leaked_stores(shm_dir: Path):
    """What kill -9 can leak into ``shm_dir``: a store whose creator died before every rank mapped
    it, and a live run's. Yields ``check(out)``, which asserts that the run whose output is ``out``
    removed the dead one, by name, and spared the live one (its contents too); the live one's
    process is ended (removing its store) on leaving."""
    live, live_path = _store_maker(shm_dir, "alive")  # first: its creation would remove the dead one
    dead, dead_path = _store_maker(shm_dir, "killed-before-attach")
    dead.kill()
    dead.wait()

    def check(out: str) -> None:
        assert f"removed stale host store {dead_path} (5.0 MB) of dead process {dead.pid}" in out
        assert not dead_path.exists()
        assert live_path.exists() and torch.from_file(str(live_path), size=250_000).eq(7.0).all()

    try:
        yield check
    finally:
        live.terminate()  # its SIGTERM handler removes its store (store.py)
        live.wait(timeout=60)
    assert not live_path.exists()


# ----------------------------------------------------------------------------- NaN gradient

NAN_STEPS, NAN_AT = 4, 2  # 1-based step whose gradient is poisoned on the last stage
NAN_HF = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 300,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}  # every field conf/model/llama_10m.yaml sets, so that both sides build the same model


def _reference(model_dir: Path, batches, variant: str = ""):
    """Plain transformers + torch.optim.AdamW over the same batches, with step NAN_AT's update
    skipped: no ``opt.step()``, so AdamW's step count does not advance; the learning-rate schedule
    follows the step index. ``variant="zero_update"`` instead steps AdamW on zero gradients (wrong)."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": OPTIM["weight_decay"]},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    losses = []
    for step, (x, y) in enumerate(batches):  # x, y: [N·B, T]
        logits = model(input_ids=x).logits  # [N·B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=False)
        loss.backward()
        losses.append(loss.item())
        if step + 1 == NAN_AT:
            if variant != "zero_update":
                continue
            for p in model.parameters():
                p.grad.zero_()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        for g in opt.param_groups:
            g["lr"] = lr_schedule(step, NAN_STEPS)
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


PLACEMENTS = {
    "host-optimizer": [],
    "on-device": ["optim.on_device=true", "stream.device_budget=1000000000"],
    "grad-on-device": ["stream.grad_on_device=true", "stream.device_budget=0"],
    "wave": ["pipeline.wave=2", "stream.device_budget=0"],
}
"""The NaN run's placements, one job each of ``nan_runs``' launch. ``wave``: every unit streamed and the
step's two micro-batches run as one wave, so each streamed unit's gradient reaches the store once per
item (its fp32 wave sum): the readiness counts, the skip and the next steps' first arrivals (which
overwrite the skipped step's sums) must follow the items, not the micro-batches."""


def _placement_group(conf_dir: Path) -> None:
    """A Hydra config group ``placement`` under ``conf_dir`` (given with ``--config-dir``): one option
    per entry of PLACEMENTS, its overrides at the config's root, so that ``--multirun
    +placement=<a>,<b>,<c>`` runs one job per placement (a sweep of whole override sets)."""
    (conf_dir / "placement").mkdir(parents=True)
    for name, overrides in PLACEMENTS.items():
        text = OmegaConf.to_yaml(OmegaConf.from_dotlist(overrides))
        (conf_dir / "placement" / f"{name}.yaml").write_text(f"# @package _global_\n{text}")


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory, corpus) -> dict:
    """One launch (2 ranks, ``--multirun``) of the NaN run under each placement of PLACEMENTS, one job
    after another in the launch's process group, with a NaN injected into the last stage's gradient
    at step NAN_AT; the launch also cleans the stores kill -9 leaks (checked on its output). Returns
    per placement its job's run directory, and under ``"reference"`` the batches and the two
    references (:func:`_reference`: right, and ``zero_update``), computed once for the three jobs."""
    tmp = tmp_path_factory.mktemp("nan")
    shm = shm_store_dir()
    model_dir = tmp / "hf"
    torch.manual_seed(11)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**NAN_HF)).save_pretrained(model_dir)
    _placement_group(tmp / "conf")
    hf = [f"++model.hf.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in NAN_HF.items()]
    overrides = [
        *TINY,
        *corpus,
        *hf,
        f"model.init_from={model_dir}",
        "data.tokenizer=bpe",
        f"store.dir={shm}",
    ]
    overrides += ["train.dtype=float32", f"train.steps={NAN_STEPS}", "optim.max_grad_norm=0.3"]
    overrides += [f"optim.{k}={v}" for k, v in OPTIM.items()]
    overrides += ["checkpoint.export_dtype=float32"]
    overrides += [f"+placement={','.join(PLACEMENTS)}"]
    flags = [f"--config-dir={tmp / 'conf'}", "--multirun"]  # before the overrides (argparse)
    try:
        with _leaked_stores(shm) as removed_the_stale_store_only:  # one launch checks both
            rc, out, _ = _finish(
                _launch(2, [*flags, *overrides], tmp, f"nan_rank=1,nan_step={NAN_AT}"), timeout_s=400
            )
            assert rc == 0, out[-4000:]
            removed_the_stale_store_only(out)
        left = sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert not left, f"files left in the store directory: {left}"
    (sweep,) = (tmp / "runs").iterdir()
    runs = {}
    for job in sweep.iterdir():
        if job.is_dir():
            (placement,) = re.findall(
                r"\+placement=([\w-]+)", (job / ".hydra" / "overrides.yaml").read_text()
            )
            runs[placement] = job
    assert sorted(runs) == sorted(PLACEMENTS), runs

    prepared = prepared_dir(Path(corpus[1].split("=", 1)[1]))
    meta = json.loads((prepared / "meta.json").read_text())
    train_ds = reader.TokenDataset.open(prepared, "train")
    seed = Config().seed
    batches = [reader.batch(train_ds, seed, s, 4, 16) for s in range(NAN_STEPS)]  # 2 micro-batches × 2
    assert meta["vocab_size"] == NAN_HF["vocab_size"]
    losses, want = _reference(model_dir, batches)
    _, wrong = _reference(model_dir, batches, variant="zero_update")  # AdamW's count advanced
    runs["reference"] = (losses, want, wrong)
    return runs


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_nan_gradient_is_skipped_on_every_stage(nan_runs: dict, placement) -> None:
    """A NaN gradient on the last stage at step NAN_AT is skipped on every stage (weights equal plain
    transformers + AdamW without that step), also with every unit's optimizer on the device (the NaN
    in the head's device gradient) and with every streamed unit's gradient accumulated on the device
    (the NaN in the head's gradient once its accumulator has landed in the store); the launch also
    cleans the stores kill -9 leaks. The four placements are four jobs of one launch (``nan_runs``),
    each checked on its own job directory."""
    run = nan_runs[placement]
    losses, want, wrong = nan_runs["reference"]
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [int(s == NAN_AT) for s in range(1, NAN_STEPS + 1)]
    assert [r["bad_steps"] for r in records] == [int(s >= NAN_AT) for s in range(1, NAN_STEPS + 1)]
    assert records[NAN_AT - 1]["grad_norm"] is None  # NaN, written as null
    units = NAN_HF["num_hidden_layers"] + 2
    assert {r["num_on_device"] for r in records} == {units if placement == "on-device" else 0}
    assert {r["num_grad_on_device"] for r in records} == {units if placement == "grad-on-device" else 0}
    for r in (0, 1):
        assert (
            f"step {NAN_AT}: loss or gradient norm is NaN/inf; update skipped"
            in (run / f"rank{r}.log").read_text()
        )
    torch.testing.assert_close([r["loss"] for r in records], losses, rtol=RTOL, atol=0)

    ckpt = run / "checkpoints" / f"step-{NAN_STEPS}"
    prefix = json.loads((ckpt / st.TRAINER_STATE).read_text())["weights"]
    got = {}
    for f in ckpt.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            assert torch.isfinite(t).all(), f"{f.name}:{name} holds a non-finite value"
        if f.name.startswith(f"{prefix['model']}"):
            got.update(tensors)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        torch.testing.assert_close(
            got[name], w, rtol=RTOL, atol=ATOL_WEIGHT, msg=lambda m, n=name: f"{n}: {m}"
        )
    # AdamW's count advanced over the skipped step (the zero_update reference): must differ
    assert max(float((got[n] - wrong[n]).abs().max()) for n in want) > 100 * ATOL_WEIGHT


def test_kill9_of_the_launcher_stops_every_rank_within_seconds(tmp_path: Path, corpus, shm_dir: Path) -> None:
    """``kill -9`` of torchrun forwards nothing; the kernel's parent-death signal (faults.py) makes
    each rank stop as on SIGTERM: after the same step, saving it, and leaving no store behind."""
    overrides = [*TINY, *corpus, f"store.dir={shm_dir}", "train.steps=500"]
    job = _launch(2, overrides, tmp_path, "copy_delay_s=0.02")
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        metrics = tmp_path / "runs"
        while not [m for m in metrics.glob("*/metrics.jsonl") if m.read_text().strip()]:
            assert job.poll() is None and time.monotonic() < deadline, "the run did not reach step 1"
            time.sleep(0.1)
        ranks = psutil.Process(job.pid).children()
        assert len(ranks) == 2
        job.kill()  # SIGKILL of the launcher only
        job.wait()
        t0 = time.monotonic()
        _, alive = psutil.wait_procs(ranks, timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        for p in ranks:
            if p.is_running():
                p.kill()
    assert not alive, f"ranks still training {stopped_s:.0f}s after their launcher died"
    assert stopped_s < 30, stopped_s
    (run,) = (tmp_path / "runs").iterdir()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1].get("stopped") is True and records[-1]["step"] < 500, records[-1]
    saved = [p.name for _, p in st.complete_checkpoints(run / "checkpoints")]
    assert saved == [f"step-{records[-1]['step']}"], saved  # checkpoint.on_signal=save


def test_the_wave_job_of_the_nan_run_ran_in_waves(nan_runs: dict) -> None:
    """The ``wave`` placement's job of ``nan_runs`` (checked like the others by
    ``test_nan_gradient_is_skipped_on_every_stage``) really ran one wave of 2 a step: its start-up line."""
    log = (nan_runs["wave"] / "rank0.log").read_text()
    assert "pipeline.wave=2: " in log, "the start-up line of the wave"
