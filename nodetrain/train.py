"""Training entry point: compose config → validate → data → store + stage → loop.

Run the default job (Llama-family ~10M model on the Shakespeare plays, 2 pipeline stages, CPU):

    torchrun --nproc_per_node 2 -m nodetrain.train

On one node of 8 GPUs, a real shape (NCCL, one stage per GPU):

    torchrun --nproc_per_node 8 -m nodetrain.train model=llama3_8b train.seq_len=4096 \
        train.micro_batch_size=1 pipeline.microbatches=16

A learning-rate sweep on the same ranks (one process group, one directory and wandb run per job):

    torchrun --nproc_per_node 2 -m nodetrain.train --multirun optim.lr=1e-3,3e-4

Two nodes, each a replica of the 2-stage pipeline (data parallel; see nodetrain/engine/comm/replicas.py):

    torchrun --nnodes 2 --nproc_per_node 2 --node_rank <0|1> --master_addr <node 0> -m nodetrain.train

Every rank shares one run directory (``runs/<launch time>_<id>``), writes ``rank<N>.log`` there,
and rank 0 writes ``metrics.jsonl``, the offline wandb run and ``plots/`` (and the per-step progress
lines into its ``rank0.log``).

Signals (faults.StopRequest): during set-up a SIGINT/SIGTERM ends the launch at once; in the loop
every rank stops after a step they agree on, an evaluation is left between two batches, and a
checkpoint being written is finished first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import signal
import sys
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from nodetrain.checkpoint import Checkpointing
from nodetrain.checkpoint.checkpointing import choose_resume
from nodetrain.checkpoint.state import CheckpointError, config_hash, read_state, step_dir_name, verify_import
from nodetrain.config.batch import BatchShape
from nodetrain.config.checks import DataError, no_effect
from nodetrain.config.registry import register_configs, to_typed
from nodetrain.config.schema import CONFIG_DIR, Config, validate
from nodetrain.core.batch import resolve_batch
from nodetrain.core.topology import Topology
from nodetrain.cost.shape import shape_of
from nodetrain.data import datasets as data
from nodetrain.data import reader
from nodetrain.data.checks import (
    check_init_vocab,
    check_resumed_tokenizer,
    check_vocab,
    open_splits,
    resume_data_config,
    run_data_config,
)
from nodetrain.data.progress import TaskProgress
from nodetrain.engine.engine import Engine
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config, router_aux_of
from nodetrain.plan.host import preflight
from nodetrain.plan.planner import model_of
from nodetrain.run.faults import BadSteps, Stopped, StopRequest, stop_with_launcher
from nodetrain.run.inject import Faults
from nodetrain.run.jobs import Job, Release, current_job, exit_process, fail_fast, refusals_of
from nodetrain.run.metrics import MetricsLogger
from nodetrain.run.outputs import RunOutputs, check_space, check_writable, checkpoint_bytes, checkpoint_dir
from nodetrain.run.process_group import init_distributed, on_rank0

__all__ = ["main", "run"]

log = logging.getLogger("nodetrain")


def _step_batch(ds, batch: BatchShape, seed: int, index: int, num_mb: int):
    """[num_mb, B, T] inputs, labels, position ids (None: 0..T-1) and token mask (bool, False on
    padding; None: none) of batch ``index`` (a pure function of seed and index); records data
    (``data.format=records``) has packed positions and, unpacked or at a row's tail, padding."""
    b, t = batch.micro_batch_size, batch.seq_len
    if isinstance(ds, reader.TokenDataset):
        x, y = reader.batch(ds, seed, index, num_mb * b, t)
        return x.view(num_mb, b, t), y.view(num_mb, b, t), None, None
    x, y, pos = (torch.from_numpy(a).view(num_mb, b, t) for a in ds.batch(seed, index, num_mb * b))
    mask = ds.token_mask(seed, index, num_mb * b)
    return x, y, pos, None if mask is None else torch.from_numpy(mask).view(num_mb, b, t)


def _evaluate(engine: Engine, val, cfg: Config, signals: StopRequest, step: int) -> float | None:
    """Mean validation loss over ``train.eval_batches`` batches, or None when a stop was requested
    (every rank asks :meth:`StopRequest.agreed` before each batch, so all leave it together); rank 0
    shows the progress of an evaluation that lasts (data/progress.py: a line every 5 s on a pipe)."""
    m, n, total, tokens = engine.run.batch.microbatches, cfg.train.eval_batches, 0.0, 0
    shown = dist.get_rank() == 0 and n > 1
    with (
        TaskProgress(f"evaluation at step {step}", n, "batches") if shown else contextlib.nullcontext() as bar
    ):
        for i in range(n):
            if signals.agreed():
                log.warning(
                    "stop requested: the evaluation at step %d ends after %d of %d batches", step, i, n
                )
                return None
            x, y, pos, _ = _step_batch(val, engine.run.batch, cfg.seed, i, m)  # no auxiliary loss
            loss, k = engine.eval_loss(x, y, pos)
            total, tokens = total + loss * k, tokens + k
            if bar is not None:
                bar.advance(1)
    return total / max(tokens, 1)


def _metrics_logger(
    cfg: Config,
    job: Job,
    resolved: dict,
    enabled: bool,
    ckpt: Checkpointing,
    ckpt_dir: Path,
    write,
) -> MetricsLogger:
    """metrics.jsonl and the job's wandb run (named and grouped by the job, see jobs.py); a resumed
    run continues the wandb run its checkpoint recorded unless ``logging.wandb_id`` names another.
    Rows after ``start_step`` that an earlier launch wrote are dropped (one row per step); a launch
    that continues another run's checkpoints starts its file with that run's rows; rows the resumed
    checkpoint carried (a full disk refused them, or they were not yet written) are written back.
    ``write``: Faults.metrics_write."""
    continued = Path(ckpt_dir).parent
    history = continued / "metrics.jsonl" if continued.resolve() != Path(job.run_dir).resolve() else None
    lc = cfg.logging
    return MetricsLogger(
        job.run_dir,
        resolved,
        enabled=enabled,
        use_wandb=lc.wandb,
        project=lc.project,
        run_name=job.name,
        total_steps=cfg.train.steps,
        print_every=lc.log_every,
        group=job.group,
        tags=lc.tags,
        notes=lc.notes,
        entity=lc.entity,
        resume_id=lc.wandb_id or ckpt.wandb_run_id,
        start_step=ckpt.start_step,
        carried=ckpt.metrics_rows,
        write=write,
        history=history,
    )


def run(cfg: Config, run_dir: Path, resolved: dict, job: Job | None = None) -> list[dict]:
    """Train with a validated config; returns the per-step records (on every rank).

    Args:
        job: the Hydra job (store id, wandb group and name); default: a single run in ``run_dir``.

    Raises:
        ConfigError: the config cannot work with this world size, or its host store does not fit
            this node (before any allocation).
        Stopped: a signal ended the run (exit status 128 + its number), after the step every rank
            stopped after (and its checkpoint, ``checkpoint.on_signal=save``).
    """
    job = job or Job.plain(run_dir, cfg.logging)
    signals = StopRequest()  # set-up: a signal ends the launch now; the loop defers it (faults.py)
    with signals:
        try:
            return _claim_and_run(cfg, run_dir, resolved, job, signals)
        except Exception as e:
            if not signals.requested:
                raise
            # another rank ended on the same signal first (its collective broke): not a bug
            log.warning("stopped by %s (%s: %s)", signal.Signals(signals.signum).name, type(e).__name__, e)
            raise Stopped(signals.signum) from None


def _claim_and_run(cfg: Config, run_dir: Path, resolved: dict, job: Job, signals: StopRequest) -> list[dict]:
    if dist.is_initialized():  # a later job of a sweep: every rank checks it together, so that rank 0
        dist.barrier()  # (not still finishing the previous job) is there to print a refusal
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    validate(cfg, world, local)
    faults = Faults.from_env(world)  # test-only (NODETRAIN_FAULTS): read and checked once, here
    stages = cfg.pipeline.stages or local or world
    batch, choices = resolve_batch(cfg, shape_of(model_of(cfg)), stages, max(1, world // stages))
    for line in choices:  # the same arithmetic on every rank: the same choice
        log.info("%s", line)
    ranks = init_distributed(cfg.dist.timeout_s, cfg.dist.backend)
    if ranks[0] == 0:
        for line in no_effect(cfg):
            log.warning("%s", line)
    c = cfg.checkpoint
    outputs = RunOutputs(run_dir, checkpoint_dir(cfg, run_dir), c.resume, config_hash(resolved))
    search = c.resume == "auto" and not c.dir  # continue the newest run of this config (outputs.py)
    on_rank0(lambda: check_writable("store.dir", Path(cfg.store.dir), create=False))
    ckpt_dir = Path(on_rank0(lambda: outputs.acquire(resolved, search)))  # locks held by rank 0
    try:
        return _run(cfg, batch, run_dir, resolved, job, ckpt_dir, signals, faults, *ranks)
    finally:
        outputs.release()


def _checkpointing(
    cfg, batch, run_dir, resolved, model, data_dir, tokenizer_dir, ckpt_dir, resume=None, stop=None
) -> Checkpointing:
    """The run's :class:`Checkpointing`; a ``model.init_from`` directory without weights
    (``FileNotFoundError``) or one that cannot initialise this model (``ValueError``) is the user's to
    fix: a ``CheckpointError`` refusal, printed once without a traceback (jobs.fail_fast)."""
    with refusals_of((ValueError, OSError), CheckpointError):
        return Checkpointing(
            cfg,
            run_dir,
            resolved,
            model,
            data_dir,
            tokenizer_dir=tokenizer_dir,
            ckpt_dir=ckpt_dir,
            resume_path=resume,
            stop=stop,
            batch=batch,
        )


def _prepare(cfg: Config, data_cfg, resume: str | None) -> tuple[str, str]:
    """Rank 0: (the prepared dataset, the tokenizer it was made with). A resumed run keeps the
    tokenizer its checkpoint was trained with (data/checks.py); a ``model.init_from`` checkpoint is
    verified against its manifest before its tokenizer or weights are read."""
    recorded = {}
    if resume is not None:
        recorded = read_state(Path(resume))["data"].get("dataset") or {}
        data_cfg = resume_data_config(data_cfg, recorded, Path(resume))
    elif cfg.model.init_from:
        with refusals_of((ValueError, OSError), CheckpointError):
            verify_import(cfg.model.init_from)
    data_dir = data.prepare(data_cfg, cfg.seed, cfg.train.seq_len)
    if resume is not None:
        check_resumed_tokenizer(data_dir, recorded, Path(resume))
    return str(data_dir), data_cfg.tokenizer


def _run(
    cfg, batch, run_dir, resolved, job, ckpt_dir, signals, faults, rank, world_size, local_rank, device
) -> list[dict]:
    """The run itself, while rank 0 holds the output directories (see :func:`run`): set-up, the
    training loop, teardown."""
    topology, release = Topology.from_env(cfg.pipeline.stages), Release()
    resume, data_dir, data_cfg, train_ds, val_ds, model = _data_and_model(cfg, batch, ckpt_dir)
    _check_fit(cfg, model, topology, ckpt_dir, faults)
    ckpt = _checkpointing(
        cfg,
        batch,
        run_dir,
        resolved,
        model,
        data_dir,
        data_cfg.tokenizer,
        ckpt_dir,
        resume,
        lambda: signals.requested,
    )
    _tell_signals(signals, ckpt)
    engine = build_engine(
        cfg,
        model,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        run_id=job.id,
        device=device,
        init_from=ckpt.init_fn(),
        topology=topology,
        faults=faults,
        batch=batch,
    )
    try:
        ckpt.check_import()  # collective: imported NaN/inf refused by name, before anything is written
        records, metrics = _loop(cfg, job, resolved, engine, ckpt, ckpt_dir, signals, train_ds, val_ds)
    finally:
        engine.close()  # the store's mapping goes here
    release.check(engine.store.path)
    _finish(cfg, run_dir, rank, records, metrics, signals, _newest(ckpt))
    return records


def _data_and_model(cfg, batch: BatchShape, ckpt_dir: Path):
    """The checkpoint to resume (verified, before the data it decides), the prepared data (rank 0
    prepares; a resume keeps its tokenizer) and its splits, and the model sized to their vocabulary:
    ``(resume, data_dir, data_cfg, train_ds, val_ds, model)``. Their problems are the user's
    (``DataError`` refusals)."""
    data_refusals = refusals_of((ValueError, OSError), DataError)
    with refusals_of((ValueError, OSError), DataError):
        data_cfg = run_data_config(cfg)  # model.init_from's tokenizer unless data.tokenizer is set
    resume = on_rank0(lambda: choose_resume(cfg, ckpt_dir))
    data_dir, tokenizer = on_rank0(data_refusals(lambda: _prepare(cfg, data_cfg, resume)))
    data_dir, data_cfg = Path(data_dir), dataclasses.replace(data_cfg, tokenizer=tokenizer)
    with refusals_of((ValueError, OSError), DataError):
        train_ds, val_ds = open_splits(data_dir, cfg, batch)
        # an imported (maybe padded) embedding's rows
        init_rows = check_init_vocab(cfg.model, train_ds, data_cfg.tokenizer)
        hf_config = build_hf_config(cfg.model, vocab_size=init_rows or train_ds.vocab_size)
        model = HFModel(hf_config, router_aux_of(cfg, hf_config, batch.global_microbatches))
        check_vocab(model.config.vocab_size, train_ds, data_cfg.tokenizer, cfg.model.init_from)
    return resume, data_dir, data_cfg, train_ds, val_ds, model


def _check_fit(cfg, model: HFModel, topology: Topology, ckpt_dir: Path, faults: Faults) -> None:
    """Refuse a store the node cannot hold (nodes are alike: node 0 answers for all) and a checkpoint
    that does not fit, before the store exists, not at the first save after hours of training."""
    on_rank0(lambda: preflight(cfg, model, topology.num_stages, faults))
    if cfg.checkpoint.enable:
        ckpt_bytes = checkpoint_bytes(model, cfg.checkpoint.export_dtype)
        on_rank0(lambda: check_space(ckpt_dir, ckpt_bytes, "checkpoint.dir"))


def _tell_signals(signals: StopRequest, ckpt: Checkpointing) -> None:
    """What a stop request needs from the checkpointing: the group an evaluation asks every rank on
    between batches (gloo, main thread), and which checkpoint a forced stop leaves unsaved."""
    signals.group = ckpt.group
    signals.unsaved = lambda: _newest(ckpt)


def _finish(cfg, run_dir: Path, rank: int, records: list[dict], metrics, signals: StopRequest, newest: str):
    """After the store is gone: a full run directory is refused on every rank, the summary line, the
    plots (rank 0), and a run a signal stopped before ``train.steps`` says so (``Stopped``)."""
    on_rank0(lambda: metrics.raise_if_failed(newest))
    log.info(
        "done: %d steps, final loss %.4f", len(records), records[-1]["loss"] if records else float("nan")
    )
    if rank == 0 and cfg.logging.plots:
        _write_plots(run_dir)
    if signals.requested and (not records or records[-1].get("stopped")):
        log.warning("stopped by %s: %s", signal.Signals(signals.signum).name, newest)
        raise Stopped(signals.signum)  # not finished: say so to the caller


def _newest(ckpt: Checkpointing) -> str:
    """Which checkpoint a stopped run leaves, for its last log line."""
    step = ckpt.writer.last_saved if ckpt.writer is not None else None
    if step is None:
        return "no checkpoint of this run was written"
    return f"the newest checkpoint is {ckpt.dir / step_dir_name(step)}"


def _loop(cfg, job, resolved, engine, ckpt, ckpt_dir, signals, train_ds, val_ds):
    """The training loop: (the per-step records, the metrics logger). Collective on every rank."""
    rank = dist.get_rank()
    num_mb = engine.run.batch.global_microbatches  # every replica builds the global batch
    metrics = _metrics_logger(cfg, job, resolved, rank == 0, ckpt, ckpt_dir, engine.faults.metrics_write)
    ckpt.wandb_run_id = metrics.run_id or ckpt.wandb_run_id  # kept in trainer_state.json (rank 0)
    records, bad = [], BadSteps(cfg.train.max_bad_steps)
    # inside: SIGINT/SIGTERM end the run after a step every rank agrees on (faults.StopRequest), also
    # while the last checkpoint is written; a row metrics.jsonl has no room for (rank 0) stops it the
    # same way, and fails it once it is over (_run)
    with signals.deferred():
        ok = False
        try:
            with metrics:
                _steps(cfg, engine, ckpt, metrics, signals, train_ds, val_ds, num_mb, records, bad)
            ok = True
        finally:
            ckpt.close(ok)  # waits for the last save and commits it (a stop request meanwhile is told)
    return records, metrics


def _steps(cfg, engine, ckpt, metrics, signals, train_ds, val_ds, num_mb, records, bad) -> None:
    rank = dist.get_rank()
    start = ckpt.attach(engine)  # on resume: AdamW counts and RNG states, right before the loop
    if cfg.train.eval_every and start == 0:
        val = _evaluate(engine, val_ds, cfg, signals, 0)
        if val is None:
            return
        metrics.log({"step": 0, "val_loss": val})
    for step in range(start, cfg.train.steps):
        engine.faults.maybe_fail(rank, step + 1)  # test-only (NODETRAIN_FAULTS fail_*, run/inject.py)
        x, y, pos, mask = _step_batch(train_ds, engine.run.batch, cfg.seed, step, num_mb)
        asked = signals.requested or metrics.failed is not None
        r = engine.train_step(step, x, y, stop=asked, position_ids=pos, token_mask=mask)
        bad.count(r.skipped)
        rec = _record(step, r, bad)
        last = step + 1 == cfg.train.steps
        interrupted = r.stop and not last
        every = cfg.train.eval_every
        if every and not interrupted and ((step + 1) % every == 0 or last):
            val = _evaluate(engine, val_ds, cfg, signals, step + 1)
            if val is None:
                interrupted = not last
            else:
                rec["val_loss"] = val
        save = interrupted and cfg.checkpoint.on_signal == "save"
        ckpt.metrics_rows = metrics.rows_to_carry(rec)  # a row a full disk refuses is not lost
        stop, stall_s = ckpt.after_step(step + 1, save=save)  # after evaluation (draws no RNG)
        if stall_s is not None:
            rec["ckpt_stall_s"] = stall_s
        if interrupted:
            rec["stopped"] = True  # by a signal (or a full run directory), before train.steps
            log.warning("stop requested: every rank stops after step %d", step + 1)
        metrics.log(rec)
        records.append(rec)
        if stop or interrupted:
            break
        bad.check(step + 1)


def _record(step: int, r, bad: BadSteps) -> dict:
    """The metrics row of step ``step`` (0-based): ``loss`` is the step's objective, with a router
    auxiliary loss the cross-entropy plus ``router_aux_loss_coef · aux_loss`` (transformers'
    ``outputs.loss``), and ``aux_loss`` (transformers' ``outputs.aux_loss``) is a field of its own
    then; ``val_loss`` is the cross-entropy alone (engine.StepResult)."""
    aux = {} if r.aux_loss is None else {"aux_loss": r.aux_loss}
    return {
        "step": step + 1,
        "loss": r.loss,
        **aux,
        "lr": r.lr,
        "grad_norm": r.grad_norm,
        "tokens": r.tokens,
        "tokens_per_s": r.tokens / r.step_s,
        "step_s": r.step_s,
        "stall_s": r.stall_s,
        "p2p_wait_s": r.p2p_wait_s,
        "optim_s": r.optim_s,
        "skipped": int(r.skipped),
        "bad_steps": bad.total,
        **r.breakdown,  # every stage's breakdown (rank 0): see nodetrain/run/breakdown.py
    }


def _write_plots(run_dir: Path) -> None:
    # matplotlib: imported on rank 0 only, when used
    from nodetrain.run.plots import write_plots, write_sweep_plot

    try:
        log.info("plots: %s", ", ".join(p.name for p in write_plots(run_dir)))
        if run_dir.name.isdigit():  # a job of a sweep (see jobs.Job): compare it with the jobs so far
            log.info("sweep plot: %s", write_sweep_plot(run_dir.parent))
    except Exception:  # the run itself succeeded; a plot must not turn it into a failure
        log.exception("writing the plots of %s failed; redraw with python -m nodetrain.plots", run_dir)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    """Hydra entry: converts the composed config once and runs training in the shared run dir."""
    sys.stderr = _STDERR  # composed: this rank speaks again (see __main__)
    stop_with_launcher()  # kill -9 of torchrun: the kernel sends this rank SIGTERM (faults.py)
    with fail_fast():  # under torchrun: the traceback in the log and torchrun's summary, then exit 1
        cfg = to_typed(dict_cfg)
        job = current_job(cfg.logging)
        run(cfg, job.run_dir, OmegaConf.to_container(dict_cfg, resolve=True), job)


_STDERR = sys.stderr

if __name__ == "__main__":
    register_configs()
    if int(os.environ.get("RANK", "0")) != 0:
        # Hydra's composition errors (an unknown key on the command line) are the same on every
        # rank and printed by Hydra itself before main() runs: rank 0 prints them once
        sys.stderr = io.StringIO()
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_process(0)  # every job done and released: skip the interpreter's teardown (jobs.py)
