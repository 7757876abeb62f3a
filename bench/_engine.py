"""Shared by the CPU benchmarks: build a config from a shipped model YAML, and a one-rank Engine
in this process (gloo, world size 1) over a private host-store directory.

Not a benchmark itself; ``engine_overhead.py`` and ``cpu_optimizer.py`` import it.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from nodetrain.config.schema import Config, ModelConfig, validate
from nodetrain.engine.engine import Engine
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config

ROOT = Path(__file__).resolve().parents[1]


def model_config(name: str, vocab_size: int, **hf) -> ModelConfig:
    """``conf/model/<name>.yaml`` as a typed ``ModelConfig``, with ``vocab_size`` and ``hf`` set."""
    merged = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf/model" / f"{name}.yaml")
    )
    cfg = OmegaConf.to_object(merged)
    cfg.hf = {**cfg.hf, "vocab_size": vocab_size, **hf}
    return cfg


def init_single_process() -> None:
    """A world of one (gloo) in this process, unless one is already up."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo")


def make_engine(cfg: Config, run_id: str) -> tuple[Engine, HFModel]:
    """A one-stage Engine of ``cfg`` (its ``store.dir`` is replaced by a private /dev/shm dir)."""
    init_single_process()
    cfg.store.dir = tempfile.mkdtemp(prefix="nt-bench-", dir="/dev/shm")
    validate(cfg, 1)
    model = HFModel(build_hf_config(cfg.model))
    engine = build_engine(
        cfg, model, rank=0, world_size=1, local_rank=0, run_id=run_id, device=torch.device("cpu")
    )
    os.rmdir(cfg.store.dir)  # the engine unlinked the store's name; the mapping lives on
    return engine, model


def base_config(model: ModelConfig, **sections) -> Config:
    """A ``Config`` with ``model`` and ``section.key=value`` pairs, e.g. ``train={"seq_len": 128}``."""
    cfg = Config()
    cfg.model = model
    for section, values in sections.items():
        for key, value in values.items():
            assert hasattr(getattr(cfg, section), key), f"unknown key {section}.{key}"
            setattr(getattr(cfg, section), key, value)
    return cfg


def median_time(fn, reps: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (all threads of this process) of ``reps`` calls
    of ``fn``. On a shared machine the CPU seconds are the steadier figure of the work done."""
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def bench_args(description: str, microbatches: int) -> argparse.ArgumentParser:
    """The command-line options the 1-rank engine benchmarks share (model, shape, threads, reps)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="llama_10m")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--microbatches", type=int, default=microbatches)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of the compute")
    ap.add_argument("--reps", type=int, default=4, help="steps per block; three blocks each")
    return ap


def random_batch(args, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sets the compute threads (``args.threads``) and seed 0; returns inputs and next-token labels
    of ``args.batch`` random sequences of ``args.seq_len`` ids, [M, B/M, T] int64 each (M =
    ``args.microbatches``)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1))
    m, b = args.microbatches, args.batch // args.microbatches
    return ids[:, :-1].contiguous().view(m, b, -1), ids[:, 1:].contiguous().view(m, b, -1)
