"""Run nodetrain's Engine for a few steps and report the device memory it held; started by torchrun.

Not a test itself: ``test_memory.py`` launches it and compares each rank's figures with the planner's
``costs.stage_memory`` for the same config. One or more specs (JSON files, run one after another
in the launch's one process group, each with an engine of its own):

    {"arch": "LlamaForCausalLM", "hf": {...}, "overrides": {"pipeline.schedule": "1f1b", ...},
     "out_dir": "<dir>", "run_id": "<names the store file>"}

Writes ``out_dir/rank<r>.json``: {"stage", "blocks", "p2p_peak_buffers", "p2p_peak_bytes" (the
engine's own high-water marks, ``P2P.peak_*``), "window_bytes" (the slots it allocated),
"in_flight_peak" (most micro-batches whose block inputs the stage runner kept at once, read after
each of its forwards, of one micro-batch or of a wave)}.

    python -m torch.distributed.run --nproc_per_node 3 tests/memory_worker.py spec.json [spec.json ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nodetrain.config.schema import Config, ModelConfig, validate
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config
from nodetrain.run.jobs import exit_process


def _config(spec: dict) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(name="memory", arch=spec["arch"], hf=dict(spec["hf"]))
    for key, value in spec["overrides"].items():
        *path, leaf = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        assert hasattr(obj, leaf), f"unknown config key {key}"
        setattr(obj, leaf, value)
    return cfg


def main(spec_paths: list[str]) -> None:
    dist.init_process_group("gloo")
    for spec_path in spec_paths:
        run_spec(json.loads(Path(spec_path).read_text()))
    dist.destroy_process_group()


def run_spec(spec: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(spec)
    validate(cfg, world, int(os.environ["LOCAL_WORLD_SIZE"]))
    model = HFModel(build_hf_config(cfg.model))
    engine = build_engine(
        cfg,
        model,
        rank=rank,
        world_size=world,
        local_rank=int(os.environ["LOCAL_RANK"]),
        run_id=spec["run_id"],
        device=torch.device("cpu"),
    )
    runner, in_flight = engine.runner, [0]
    forward = runner.forward_wave  # every forward, of one micro-batch or a wave (pipeline.wave)

    def counted_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        in_flight[0] = max(in_flight[0], len(runner._saved))
        return out

    runner.forward_wave = counted_forward
    num_mb = engine.run.batch.global_microbatches
    gen = torch.Generator().manual_seed(0)
    shape = (num_mb, cfg.train.micro_batch_size, cfg.train.seq_len)
    for step in range(cfg.train.steps):
        inputs = torch.randint(0, model.config.vocab_size, shape, generator=gen)
        engine.train_step(step, inputs, torch.roll(inputs, -1, dims=-1))
    report = {
        "stage": engine.stage,
        "blocks": list(engine.blocks),
        "p2p_peak_buffers": engine.p2p.peak_buffers,
        "p2p_peak_bytes": engine.p2p.peak_bytes,
        "window_bytes": engine.window.nbytes - engine.window.resident_nbytes,
        "in_flight_peak": in_flight[0],
    }
    (Path(spec["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_process(0)  # skip the interpreter's teardown: ~0.8 s of CPU per rank (run/jobs.py)
