"""Training entry point: compose config → validate → data → store + stage → loop.

Run the default job (Llama-family ~10M model on the Shakespeare plays, 2 pipeline stages, CPU):

    torchrun --nproc_per_node 2 -m nodetrain.train

On one node of 8 GPUs, a real shape (NCCL, one stage per GPU):

    torchrun --nproc_per_node 8 -m nodetrain.train model=llama3_8b train.seq_len=4096 \
        train.micro_batch_size=1 pipeline.microbatches=16

Every rank shares one run directory (``runs/<launch time>_<id>``), writes ``rank<N>.log`` there,
and rank 0 writes ``metrics.jsonl`` and the offline wandb run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from nodetrain import data
from nodetrain.checkpoint import load_hf_weights
from nodetrain.config import Config, grad_accum_of, register_configs, to_typed, validate
from nodetrain.engine import Engine
from nodetrain.metrics import MetricsLogger
from nodetrain.model import HFModel, build_hf_config

__all__ = ["main", "run"]

log = logging.getLogger("nodetrain")


def _init_distributed() -> tuple[int, int, int, torch.device]:
    """Init the process group once per process (a multirun reuses it); gloo on CPU, NCCL on GPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m nodetrain.train`: a one-stage pipeline
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def _on_rank0(fn):
    """Run ``fn`` on rank 0 only; every rank gets its result, or raises its error."""
    box, error = [None, None], None
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as e:  # shared below so that no rank waits forever for rank 0
            error, box[1] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        raise RuntimeError(f"rank 0 failed: {box[1]}")
    return box[0]


def _step_batch(ds: data.TokenDataset, cfg: Config, index: int, num_mb: int):
    """[num_mb, B, T] inputs and labels of batch ``index`` (a pure function of seed and index)."""
    b, t = cfg.train.micro_batch_size, cfg.train.seq_len
    x, y = data.batch(ds, cfg.seed, index, num_mb * b, t)
    return x.view(num_mb, b, t), y.view(num_mb, b, t)


def _evaluate(engine: Engine, val: data.TokenDataset, cfg: Config) -> float:
    m, total, tokens = cfg.pipeline.microbatches, 0.0, 0
    for i in range(cfg.train.eval_batches):
        x, y = _step_batch(val, cfg, i, m)
        loss, n = engine.eval_loss(x, y)
        total, tokens = total + loss * n, tokens + n
    return total / max(tokens, 1)


def run(cfg: Config, run_dir: Path, resolved: dict) -> list[dict]:
    """Train with a validated config; returns the per-step records (on every rank).

    Raises:
        ConfigError: the config cannot work with this world size (before any allocation).
    """
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world_size, local_rank, device = _init_distributed()
    data_dir = Path(_on_rank0(lambda: str(data.prepare(cfg.data, cfg.seed))))
    train_ds, val_ds = data.TokenDataset.open(data_dir, "train"), data.TokenDataset.open(data_dir, "val")
    model = HFModel(build_hf_config(cfg.model, vocab_size=train_ds.vocab_size))
    if model.config.vocab_size < train_ds.vocab_size:
        raise ValueError(
            f"model.hf.vocab_size={model.config.vocab_size} is smaller than the tokenizer's "
            f"{train_ds.vocab_size} ({data_dir}); remove it so the tokenizer's size is used"
        )
    init = (
        (lambda store, units: load_hf_weights(cfg.model.init_from, store, units))
        if cfg.model.init_from
        else None
    )
    engine = Engine(
        cfg,
        model,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        run_id=run_dir.name,
        device=device,
        init_from=init,
    )
    num_mb = grad_accum_of(cfg) * cfg.pipeline.microbatches
    metrics = MetricsLogger(
        run_dir,
        resolved,
        enabled=rank == 0,
        use_wandb=cfg.logging.wandb,
        project=cfg.logging.project,
        run_name=run_dir.name,
        total_steps=cfg.train.steps,
        print_every=cfg.logging.log_every,
    )
    records = []
    try:
        with metrics:
            if cfg.train.eval_every:
                metrics.log({"step": 0, "val_loss": _evaluate(engine, val_ds, cfg)})
            for step in range(cfg.train.steps):
                x, y = _step_batch(train_ds, cfg, step, num_mb)
                r = engine.train_step(step, x, y)
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
                    **r.breakdown,  # every stage's breakdown (rank 0): see nodetrain/breakdown.py
                }
                last = step + 1 == cfg.train.steps
                every = cfg.train.eval_every
                if every and ((step + 1) % every == 0 or last):
                    rec["val_loss"] = _evaluate(engine, val_ds, cfg)
                metrics.log(rec)
                records.append(rec)
    finally:
        engine.close()
    log.info(
        "done: %d steps, final loss %.4f", len(records), records[-1]["loss"] if records else float("nan")
    )
    return records


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    """Hydra entry: converts the composed config once and runs training in the shared run dir."""
    cfg = to_typed(dict_cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run(cfg, run_dir, OmegaConf.to_container(dict_cfg, resolve=True))


if __name__ == "__main__":
    register_configs()
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
