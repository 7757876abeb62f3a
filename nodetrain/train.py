"""Training entry point: compose config → validate → data → store + stage → loop.

Run the default job (Llama-family ~10M model on the Shakespeare plays, 2 pipeline stages, CPU):

    torchrun --nproc_per_node 2 -m nodetrain.train

On one node of 8 GPUs, a real shape (NCCL, one stage per GPU):

    torchrun --nproc_per_node 8 -m nodetrain.train model=llama3_8b train.seq_len=4096 \
        train.micro_batch_size=1 pipeline.microbatches=16

A learning-rate sweep on the same ranks (one process group, one directory and wandb run per job):

    torchrun --nproc_per_node 2 -m nodetrain.train --multirun optim.lr=1e-3,3e-4

Two nodes, each a replica of the 2-stage pipeline (data parallel; see nodetrain/engine/replicas.py):

    torchrun --nnodes 2 --nproc_per_node 2 --node_rank <0|1> --master_addr <node 0> -m nodetrain.train

Every rank shares one run directory (``runs/<launch time>_<id>``), writes ``rank<N>.log`` there,
and rank 0 writes ``metrics.jsonl``, the offline wandb run and ``plots/``.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from nodetrain.checkpoint import Checkpointing
from nodetrain.checkpoint.state import CheckpointError, config_hash
from nodetrain.config.checks import DataError
from nodetrain.config.schema import CONFIG_DIR, Config, grad_accum_of, register_configs, to_typed, validate
from nodetrain.data import datasets as data
from nodetrain.data.checks import check_init_vocab, check_vocab, open_splits, run_data_config
from nodetrain.engine.engine import Engine
from nodetrain.engine.replicas import Topology
from nodetrain.model import HFModel, build_hf_config, router_aux_of
from nodetrain.plan.planner import preflight, resolve_auto
from nodetrain.run.faults import BadSteps, StopRequest, maybe_fail, stop_with_launcher
from nodetrain.run.jobs import REFUSALS, Job, Release, current_job, fail_fast, refusals_of
from nodetrain.run.metrics import MetricsLogger
from nodetrain.run.outputs import RunOutputs, check_space, checkpoint_bytes, checkpoint_dir

__all__ = ["main", "run"]

log = logging.getLogger("nodetrain")


def _init_distributed(timeout_s: float, backend: str = "") -> tuple[int, int, int, torch.device]:
    """Init the process group once per process (a multirun reuses it); gloo on CPU, NCCL on GPU
    unless ``backend`` (``dist.backend``) says gloo. No collective or receive waits longer than
    ``timeout_s`` (``dist.timeout_s``).

    Raises:
        ValueError: NCCL with more ranks on the node than GPUs, or NCCL without CUDA.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and (not cuda or local_rank >= torch.cuda.device_count()):
        have = torch.cuda.device_count() if cuda else 0
        raise ValueError(
            f"dist.backend=nccl needs one GPU per rank: LOCAL_RANK={local_rank}, {have} GPU(s); start at "
            "most that many ranks per node, or set dist.backend=gloo to share GPUs"
        )
    if cuda:  # with gloo, ranks may share a GPU: rank i uses GPU i mod count
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m nodetrain.train`: a one-stage pipeline
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(
            backend, device_id=device if backend == "nccl" else None, timeout=timedelta(seconds=timeout_s)
        )
        log.info("process group: %s, world size %d, device %s", backend, dist.get_world_size(), device)
    else:
        log.info("process group: reused (%s, world size %d)", dist.get_backend(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def _on_rank0(fn):
    """Run ``fn`` on rank 0 only; every rank gets its result, or raises its error (a refusal as the
    same refusal, see jobs.REFUSALS)."""
    box, error = [None, None, None], None
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as e:  # shared below so that no rank waits forever for rank 0
            error, box[1] = e, f"{type(e).__name__}: {e}"
            box[2] = next((i for i, kind in enumerate(REFUSALS) if isinstance(e, kind)), None)
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[2] is not None:
        raise REFUSALS[box[2]](box[1].split(": ", 1)[1])
    if box[1] is not None:
        raise RuntimeError(f"rank 0 failed: {box[1]}")
    return box[0]


def _step_batch(ds, cfg: Config, index: int, num_mb: int):
    """[num_mb, B, T] inputs, labels and position ids (None: 0..T-1) of batch ``index`` (a pure
    function of seed and index); records data (``data.format=records``) has packed positions."""
    b, t = cfg.train.micro_batch_size, cfg.train.seq_len
    if isinstance(ds, data.TokenDataset):
        x, y = data.batch(ds, cfg.seed, index, num_mb * b, t)
        return x.view(num_mb, b, t), y.view(num_mb, b, t), None
    return tuple(torch.from_numpy(a).view(num_mb, b, t) for a in ds.batch(cfg.seed, index, num_mb * b))


def _evaluate(engine: Engine, val, cfg: Config) -> float:
    m, total, tokens = cfg.pipeline.microbatches, 0.0, 0
    for i in range(cfg.train.eval_batches):
        x, y, pos = _step_batch(val, cfg, i, m)
        loss, n = engine.eval_loss(x, y, pos)
        total, tokens = total + loss * n, tokens + n
    return total / max(tokens, 1)


def _metrics_logger(
    cfg: Config,
    job: Job,
    resolved: dict,
    enabled: bool,
    resume_id: str | None,
    start_step: int,
    ckpt_dir: Path,
) -> MetricsLogger:
    """metrics.jsonl and the job's wandb run (named and grouped by the job, see jobs.py); a resumed
    run continues the wandb run its checkpoint recorded unless ``logging.wandb_id`` names another.
    Rows after ``start_step`` that an earlier launch wrote are dropped (one row per step); a launch
    that continues another run's checkpoints starts its file with that run's rows."""
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
        resume_id=lc.wandb_id or resume_id,
        start_step=start_step,
        history=history,
    )


def run(cfg: Config, run_dir: Path, resolved: dict, job: Job | None = None) -> list[dict]:
    """Train with a validated config; returns the per-step records (on every rank).

    Args:
        job: the Hydra job (store id, wandb group and name); default: a single run in ``run_dir``.

    Raises:
        ConfigError: the config cannot work with this world size, or its host store does not fit
            this node (before any allocation).
    """
    job = job or Job.plain(run_dir, cfg.logging)
    if dist.is_initialized():  # a later job of a sweep: every rank checks it together, so that rank 0
        dist.barrier()  # (not still finishing the previous job) is there to print a refusal
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    validate(cfg, world, local)
    stages = cfg.pipeline.stages or local or world
    cfg, choices = resolve_auto(cfg, num_stages=stages, nodes=max(1, world // stages))
    for line in choices:  # the same arithmetic on every rank: the same choice
        log.info("%s", line)
    validate(cfg, world, local)
    ranks = _init_distributed(cfg.dist.timeout_s, cfg.dist.backend)
    c = cfg.checkpoint
    outputs = RunOutputs(run_dir, checkpoint_dir(cfg, run_dir), c.resume, config_hash(resolved))
    search = c.resume == "auto" and not c.dir  # continue the newest run of this config (outputs.py)
    ckpt_dir = Path(_on_rank0(lambda: outputs.acquire(resolved, search)))  # locks held by rank 0
    try:
        return _run(cfg, run_dir, resolved, job, ckpt_dir, *ranks)
    finally:
        outputs.release()


def _checkpointing(cfg, run_dir, resolved, model, data_dir, tokenizer_dir, ckpt_dir) -> Checkpointing:
    """The run's :class:`Checkpointing`; a ``model.init_from`` directory without weights
    (``FileNotFoundError``) or one that cannot initialise this model (``ValueError``) is the user's to
    fix: a ``CheckpointError`` refusal, printed once without a traceback (jobs.fail_fast)."""
    with refusals_of((ValueError, OSError), CheckpointError):
        return Checkpointing(
            cfg, run_dir, resolved, model, data_dir, tokenizer_dir=tokenizer_dir, ckpt_dir=ckpt_dir
        )


def _run(cfg, run_dir, resolved, job, ckpt_dir, rank, world_size, local_rank, device) -> list[dict]:
    """The run itself, while rank 0 holds the output directories (see :func:`run`)."""
    topology, release = Topology.from_env(cfg.pipeline.stages), Release()
    data_refusals = refusals_of((ValueError, OSError), DataError)  # the data's problems are the user's
    with refusals_of((ValueError, OSError), DataError):
        data_cfg = run_data_config(cfg)  # model.init_from's tokenizer unless data.tokenizer is set
    prepare = data_refusals(data.prepare)
    data_dir = Path(_on_rank0(lambda: str(prepare(data_cfg, cfg.seed, cfg.train.seq_len))))
    with refusals_of((ValueError, OSError), DataError):
        train_ds, val_ds = open_splits(data_dir, cfg, topology.num_replicas)
        # an imported (maybe padded) embedding's rows
        init_rows = check_init_vocab(cfg.model, train_ds, data_cfg.tokenizer)
        hf_config = build_hf_config(cfg.model, vocab_size=init_rows or train_ds.vocab_size)
        model = HFModel(hf_config, router_aux_of(cfg, hf_config, topology.num_replicas))
        check_vocab(model.config.vocab_size, train_ds, data_cfg.tokenizer, cfg.model.init_from)
    # refuse a store the node cannot hold (nodes are alike: node 0 answers for all)
    _on_rank0(lambda: preflight(cfg, model, topology.num_stages))
    # a checkpoint must fit before the store exists, not at the first save after hours of training
    if cfg.checkpoint.enable:
        ckpt_bytes = checkpoint_bytes(model, cfg.checkpoint.export_dtype)
        _on_rank0(lambda: check_space(ckpt_dir, ckpt_bytes, "checkpoint.dir"))
    # resume or import is checked before the store exists; checkpoints carry the run's tokenizer
    ckpt = _checkpointing(cfg, run_dir, resolved, model, data_dir, data_cfg.tokenizer, ckpt_dir)
    engine = Engine(
        cfg,
        model,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        run_id=job.id,
        device=device,
        init_from=ckpt.init_fn(),
        topology=topology,
    )
    k = topology.num_replicas  # the global batch: every replica's micro-batches
    num_mb = grad_accum_of(cfg, k) * cfg.pipeline.microbatches * k
    metrics = _metrics_logger(cfg, job, resolved, rank == 0, ckpt.wandb_run_id, ckpt.start_step, ckpt_dir)
    ckpt.wandb_run_id = metrics.run_id or ckpt.wandb_run_id  # kept in trainer_state.json (rank 0)
    records, ok, signals, bad = [], False, StopRequest(), BadSteps(cfg.train.max_bad_steps)
    try:
        with metrics, signals:  # inside: SIGINT/SIGTERM end the run after a step every rank agrees on
            start = ckpt.attach(engine)  # on resume: AdamW counts and RNG states, right before the loop
            if cfg.train.eval_every and start == 0:
                metrics.log({"step": 0, "val_loss": _evaluate(engine, val_ds, cfg)})
            for step in range(start, cfg.train.steps):
                maybe_fail(cfg.test, rank, step + 1)  # test-only (test.fail_*)
                x, y, pos = _step_batch(train_ds, cfg, step, num_mb)
                r = engine.train_step(step, x, y, stop=signals.requested, position_ids=pos)
                bad.count(r.skipped)
                rec = {
                    "step": step + 1,
                    "loss": r.loss,
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
                last = step + 1 == cfg.train.steps
                interrupted = r.stop and not last
                every = cfg.train.eval_every
                if every and not interrupted and ((step + 1) % every == 0 or last):
                    rec["val_loss"] = _evaluate(engine, val_ds, cfg)
                save = interrupted and cfg.checkpoint.on_signal == "save"
                stop, stall_s = ckpt.after_step(step + 1, save=save)  # after evaluation (draws no RNG)
                if stall_s is not None:
                    rec["ckpt_stall_s"] = stall_s
                if interrupted:
                    rec["stopped"] = True  # by a signal, before train.steps
                    log.warning("stop requested by a signal: every rank stops after step %d", step + 1)
                metrics.log(rec)
                records.append(rec)
                if stop or interrupted:
                    break
                bad.check(step + 1)
            ok = True
    finally:
        try:
            ckpt.close(ok)  # waits for the last save and commits it
        finally:
            engine.close()
    store_path = engine.store.path
    del engine, ckpt  # the last references (ckpt's writer holds the store): the mapping goes now
    release.check(store_path)
    log.info(
        "done: %d steps, final loss %.4f", len(records), records[-1]["loss"] if records else float("nan")
    )
    if rank == 0 and cfg.logging.plots:
        _write_plots(run_dir)
    if records and records[-1].get("stopped"):
        raise SystemExit(128 + (signals.signum or signal.SIGTERM))  # not finished: say so to the caller
    return records


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
